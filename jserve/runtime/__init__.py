"""The runtime: what runs the model on a device.

`backends` (the one backend seam: how each operation executes), `runner` (params, KV pages and
the compiled steps; `device_steps` holds the functions it jits, `steps` its typed contract,
`step_rows` the host-side packing), `paged_attention`, `sampler`, `kv_cache` (page sizing and
layout), `sharding` and `distributed` (meshes, multi-host), `huge_pages`. It imports the model
and the bookkeeping, never the engine or the entry points.
"""

"""jserve's kernels.

- `paged_attention/`: paged decode and chunked-prefill attention as Pallas kernels (Mosaic TPU,
  Mosaic GPU, interpret mode on a CPU) behind one entry point (`ops.py`), beside `reference.py`,
  the pure-jnp reference they are tested against.
- `native/`: the native CPU kernels, C++ called through XLA's FFI and built on first use
  (`build.py`): paged attention (checked against `paged_attention/reference.py`), the packed
  matmul (checked against numpy) and the fused decoder layers (checked against the model's own
  layers, tests/test_decoder_layer.py). They share the headers beside them.
"""

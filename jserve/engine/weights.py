"""New weights for a serving engine, from a trainer or a checkpoint, swapped in between steps.

`update_weights(engine, params)` takes a pytree of arrays (numpy, or JAX on any devices or mesh)
named as jserve's checkpoints name them (flat, per-layer weights stacked on axis 0; or a model
state with "layers", `jserve.model.model_params`) or as Hugging Face's safetensors do, and
turns it into the runner's own tree: the served dtype, re-quantized when the engine serves
quantized weights, laid out and placed for the mesh (`sharding.place_params`) or the device,
prepared for the backend (`Backend.prepare_params`: packing). `Runner.replace_params` checks and
swaps it; no step recompiles, no KV page moves, and the prefix cache is dropped (its pages were
computed by the old weights). See docs/architecture.md ("Weights in place, sleep and wake").
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import jax
import numpy as np

from jserve.model import quant
from jserve.model.llama import param_shapes
from jserve.runtime.param_swap import Residency

if TYPE_CHECKING:
    from jserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

POLICIES = ("drain", "abort", "continue")


def checkpoint_layout(config: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` (jserve's names, flat or a model state with "layers", or Hugging Face names) as
    jserve's flat checkpoint layout; the arrays stay where they are (per-layer ones are stacked
    on their devices)."""
    if not isinstance(params, Mapping):
        raise ValueError(f"weights must be a mapping of names to arrays, got {type(params).__name__}")
    flat = dict(params)
    if "layers" in flat:  # a model state: {"layers": {name: stacked}} or {"layers": {i: {name: w}}}
        layers = dict(flat.pop("layers"))
        if layers and all(str(k).isdigit() for k in layers):
            per_layer = [layers[k] for k in sorted(layers, key=int)]
            flat.update({name: _stack([layer[name] for layer in per_layer]) for name in per_layer[0]})
        else:
            flat.update(layers)
    if any("." in k for k in flat):
        return _from_hf(config, flat)
    return flat


def _stack(arrays: list) -> Any:
    if any(quant.is_quantized(a) for a in arrays):
        raise ValueError("per-layer quantized weights: give them stacked ({name: QuantizedWeight})")
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.stack(arrays)
    import jax.numpy as jnp

    return jnp.stack(arrays)


def _from_hf(config: Any, named: Mapping[str, Any]) -> dict[str, Any]:
    """Hugging Face names ([out, in] linears, fused Phi-3 weights) -> jserve's stacked layout,
    through the same name table as reading a safetensors folder (`jserve.model.sources`)."""
    from jserve.model.sources import _destination, _entries

    shapes = param_shapes(config)
    out: dict[str, Any] = {}
    layers: dict[str, dict[int, Any]] = {}
    for entry in _entries(config, [(k, (lambda v=v: v)) for k, v in named.items()]):
        target = _destination(config, entry, shapes)
        if target is None:
            continue
        name, layer, transpose = target
        array = entry[1]()
        array = array.T if transpose and not quant.is_quantized(array) else array
        if layer is None:
            out[name] = array
        else:
            layers.setdefault(name, {})[layer] = array
    for name, parts in layers.items():
        missing = sorted(set(range(config.num_layers)) - set(parts))
        if missing:
            raise ValueError(f"weights are missing {name!r} for layers {missing[:8]}")
        out[name] = _stack([parts[i] for i in range(config.num_layers)])
    return out


def check_source(config: Any, flat: Mapping[str, Any]) -> None:
    """ValueError naming the first weight missing, unexpected, of another shape or not float
    (quantized ones are checked against the served format when swapped)."""
    shapes = param_shapes(config)
    missing, extra = sorted(set(shapes) - set(flat)), sorted(set(flat) - set(shapes))
    if missing or extra:
        raise ValueError(f"weights do not match the served {config.architecture} model: "
                         + (f"missing {missing[:8]}" if missing else f"unexpected {extra[:8]}"))
    for name, shape in shapes.items():
        x = flat[name]
        if quant.is_quantized(x):
            continue
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)}")
        if not np.issubdtype(np.dtype(x.dtype), np.floating) and np.dtype(x.dtype).kind != "V":
            raise ValueError(f"weight {name!r} has dtype {x.dtype}: give floating-point weights")


def _requantized(engine: "LLMEngine", config: Any, flat: dict[str, Any]) -> dict[str, Any]:
    """Float weights quantized as the engine's are (its record's spec), on the host; weights
    given quantized already pass as they are (the swap checks their format)."""
    record = engine.quantization
    if record is None or all(quant.is_quantized(flat[n]) for n in record.get("weights", {})):
        return flat
    if not record.get("spec") or record.get("scheme") not in quant.SCHEMES:
        raise ValueError(f"the engine serves pre-quantized weights ({record['label']}): give the new weights "
                         f"quantized in that format, or serve the float model")
    spec = quant.QuantSpec.from_json(record["spec"])
    host = {k: v if quant.is_quantized(v) else np.asarray(v) for k, v in flat.items()}
    return quant.quantize_params(config, host, spec)


def _cast(x: Any, dtype: Any) -> Any:
    if quant.is_quantized(x) or x.dtype == dtype:
        return x
    return x.astype(dtype)


def serving_params(engine: "LLMEngine", flat: dict[str, Any], *, donate: bool = False) -> Any:
    """Checked checkpoint-layout weights -> the runner's tree (served dtype, quantization, mesh
    layout and shardings, backend packing). `donate`: the source's device buffers may be reused
    or freed on the way (the caller gives them up)."""
    runner = engine.runner
    config = engine.source_config
    spec = Residency.of(runner).params_spec
    dtype = spec["final_norm"].dtype
    flat = {k: _cast(v, dtype) for k, v in _requantized(engine, config, flat).items()}
    if runner.mesh is not None:
        from jserve.runtime.sharding import head_layout, mesh_sizes, place_params, restore_sharding

        if donate:  # off another device set: moved (its buffers freed) before the layout runs
            layout = head_layout(config, mesh_sizes(runner.mesh)["tp"])
            mesh_devices = set(runner.mesh.devices.flat)
            flat = {k: _moved(v, restore_sharding(runner.mesh, k, v.shape, layout), True)
                    if isinstance(v, jax.Array) and set(v.sharding.device_set) != mesh_devices else v
                    for k, v in flat.items()}
        _, params = place_params(config, flat, runner.mesh, layout=runner.backend.param_layout)
    else:
        sharding = jax.tree.leaves(spec)[0].sharding
        if runner.backend.param_layout == "list" and all(isinstance(x, np.ndarray) for x in jax.tree.leaves(flat)):
            from jserve.model import model_params

            flat = model_params(runner.config, flat, "list")  # host views: each layer copied over on its own
        params = jax.tree.map(lambda x: _moved(x, sharding, donate), flat)
    return runner.backend.prepare_params(runner.config, params)


def _moved(x: Any, sharding: Any, donate: bool) -> Any:
    """`x` in `sharding`; a donated JAX source's buffers are freed once copied (not through
    `device_put(donate=)`, whose aliasing between a CPU's devices left `x` live on freed memory).
    Where `x` is in `sharding` already, nothing is copied: the result holds its buffers."""
    out = jax.device_put(x, sharding)
    copied = isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(sharding, x.ndim)
    if donate and copied and not x.is_deleted():
        out.block_until_ready()
        x.delete()
    return out


def _buffers(x: jax.Array) -> set[int]:
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _unshared(new: Any, source: Any) -> Any:
    """`new` with a copy of every array that shares device buffers with one of `source`'s: the
    caller keeps those, and the engine frees its own (the next update, sleep) without touching them."""
    theirs = set().union(*(_buffers(x) for x in jax.tree.leaves(source) if isinstance(x, jax.Array)))
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False)
                        if isinstance(x, jax.Array) and _buffers(x) & theirs else x, new)


def update_weights(engine: "LLMEngine", params: Mapping[str, Any], *, donate: bool = False) -> dict[str, Any]:
    """Convert, check and swap in new weights (the caller has applied the in-flight policy);
    drops the prefix cache. Returns the update's timings."""
    start = time.perf_counter()
    flat = checkpoint_layout(engine.source_config, params)
    check_source(engine.source_config, flat)
    new = serving_params(engine, flat, donate=donate)
    if not donate:
        new = _unshared(new, params)
    prepared = time.perf_counter()
    engine.runner.replace_params(jax.block_until_ready(new))
    engine.reset_prefix_cache()
    done = time.perf_counter()
    logger.info("weights updated in %.2f s (%.2f s converting and placing)", done - start, prepared - start)
    return {"seconds": done - start, "convert_seconds": prepared - start}


def load_weights(path: str | Path, dtype: str) -> dict[str, Any]:
    """A jserve (Orbax) checkpoint folder's or a Hugging Face safetensors folder's weights, on
    the host in `dtype`, for `update_weights`."""
    from jserve.model.checkpoint import is_checkpoint, load_checkpoint
    from jserve.model.sources import read_params

    path = Path(path)
    if is_checkpoint(path):
        return load_checkpoint(path, dtype=dtype, host=True)[1]
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return read_params(path, dtype=dtype)[1]
    raise ValueError(f"{str(path)!r} is neither a jserve checkpoint (params/, config.json, generation.json) "
                     f"nor a Hugging Face folder (config.json, *.safetensors)")

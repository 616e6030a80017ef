"""Random weights of any shape (`--load-format dummy`, vLLM's name): a model's speed and memory
measured without downloading it. Text from them is garbage; shapes, bytes and step times are real.

Each weight is drawn on the device, one at a time (an 8B model in bfloat16 never exists on the
host): normal(0, 0.02) for matrices and biases, a scale of one for the RMSNorms (so activations keep
a sane size through the layers and no step overflows).
"""

from __future__ import annotations

import logging
from typing import Any

from jserve.model.config import ModelConfig
from jserve.model.llama import param_shapes

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")


def dummy_params(config: ModelConfig, dtype: str = "bfloat16", *, seed: int = 0, device: Any = None) -> dict[str, Any]:
    """Checkpoint-layout params (stacked per-layer weights) of `config`'s shapes, random, on `device`
    (default: JAX's first)."""
    import jax
    import jax.numpy as jnp

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} for dummy weights, got {dtype!r}")
    device = device or jax.devices()[0]
    key = jax.random.key(seed)
    out = {}
    for i, (name, shape) in enumerate(sorted(param_shapes(config).items())):
        if name.endswith("norm"):
            # a scale of 1: weight 1, or 0 where the norm scales by (norm_offset + weight) (Gemma)
            fill = jax.jit(lambda s=shape: jnp.full(s, 1.0 - config.norm_offset, dtype),
                           out_shardings=jax.sharding.SingleDeviceSharding(device))
            out[name] = fill()
        else:
            draw = jax.jit(lambda k, s=shape: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dtype),
                           out_shardings=jax.sharding.SingleDeviceSharding(device))
            out[name] = draw(jax.random.fold_in(key, i))
    count = sum(int(v.size) for v in out.values())
    logger.info("dummy weights: %.2fB parameters in %s (random: the text is meaningless)", count / 1e9, dtype)
    return out

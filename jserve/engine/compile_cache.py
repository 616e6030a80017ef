"""A portable compile artifact (`jserve warmup --out DIR`, `jserve serve --compile-cache DIR`):
JAX's persistent compilation cache of every bucket the engine compiles at warm-up, in DIR/xla,
with DIR/manifest.json naming what it was compiled for: the model (its config), the engine's
settings (buckets, page size, lengths, backend, KV dtype, mesh, speculation), the weights' dtype,
JAX's and jaxlib's versions and the device kind. A server started from it whose key differs is
told which fields differ and compiles as usual (into its own cache); one whose key matches reads
every step from the artifact instead of compiling it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CACHE = "xla"
# Settings that do not change what is compiled: the artifact holds every bucket, lazy or not.
_UNKEYED = ("seed", "warmup", "lazy_buckets")


def artifact_key(model: str | None, dtype: str | None, settings: dict[str, Any]) -> dict[str, Any]:
    """What a compile artifact depends on, as plain JSON values."""
    import jax
    import jaxlib

    from jserve.engine.config import EngineConfig
    from jserve.model.checkpoint import read_model_config
    from jserve.model.dtype import current_platform, resolve_dtype

    config, stored_dtype = read_model_config(model)
    engine = EngineConfig.from_settings(**{k: v for k, v in settings.items() if k not in _UNKEYED})
    device = jax.devices()[0]
    return {
        "model": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
        "dtype": resolve_dtype(dtype, stored_dtype, current_platform())[0],  # "auto" and None: the served one
        "engine": {f.name: json.loads(json.dumps(getattr(engine, f.name), default=str))
                   for f in dataclasses.fields(engine) if f.name not in _UNKEYED},
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "device_kind": f"{device.platform}:{device.device_kind}",
        "num_devices": jax.device_count(),
    }


def write_manifest(directory: str | Path, key: dict[str, Any]) -> Path:
    path = Path(directory) / MANIFEST
    path.write_text(json.dumps(key, indent=1, sort_keys=True))
    return path


def cache_dir(directory: str | Path) -> Path:
    """The artifact's compilation cache; every step compiled goes in, the fastest ones too."""
    import os

    os.environ["JSERVE_CACHE_MIN_COMPILE_SECONDS"] = "0"
    return Path(directory) / CACHE


def mismatches(directory: str | Path, key: dict[str, Any]) -> list[str]:
    """The fields where the artifact in `directory` was made for something else ([]: it fits);
    ValueError if `directory` holds no artifact."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ValueError(f"--compile-cache {str(directory)!r} holds no compile artifact (no {MANIFEST}; make one "
                         f"with jserve warmup --out {directory})")
    stored = json.loads(path.read_text())
    out = []
    for name in sorted(set(stored) | set(key)):
        if isinstance(key.get(name), dict) and isinstance(stored.get(name), dict):
            sub = key[name]
            out += [f"{name}.{k}: {stored[name].get(k)!r} there, {sub.get(k)!r} here"
                    for k in sorted(set(stored[name]) | set(sub)) if stored[name].get(k) != sub.get(k)]
        elif stored.get(name) != key.get(name):
            out.append(f"{name}: {stored.get(name)!r} there, {key.get(name)!r} here")
    return out


def resolve(directory: str | Path | None, model: str | None, dtype: str | None, settings: dict[str, Any]):
    """The compilation cache to serve with: the artifact's when its key matches; else None (the
    usual cache) after logging what differs."""
    if directory is None:
        return None
    differ = mismatches(directory, artifact_key(model, dtype, settings))
    if differ:
        logger.warning("the compile artifact in %s was made for something else, compiling as usual: %s",
                       directory, "; ".join(differ[:8]) + (f" (and {len(differ) - 8} more)" if len(differ) > 8 else ""))
        return None
    logger.info("serving from the compile artifact in %s", directory)
    return cache_dir(directory)

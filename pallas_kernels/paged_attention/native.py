"""The native CPU attention kernel (`cpu_native.cc`): built on first use, called as an XLA FFI target.

The shared library is compiled with the machine's C++ compiler (`$CXX`, else `g++`) against the
XLA FFI headers that ship with jaxlib, with `-march=native`, and cached under
`$JSERVE_KERNEL_CACHE` (default `~/.cache/jserve/kernels`), keyed on the source, the jaxlib
version and the CPU's flags. If there is no compiler or the build fails, `available()` says so
once in the log and the "cpu" backend keeps its Pallas interpret-mode kernels (which the
"cpu_pallas" backend always uses).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

logger = logging.getLogger(__name__)

TARGET = "jserve_paged_attention"
_SOURCE = Path(__file__).with_name("cpu_native.cc")
# -ffast-math lets GCC call glibc's vector expf (libmvec) in the softmax loop.
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC")
_lock = threading.Lock()
_state: dict = {}  # "ok": bool once tried; "error": why not


MAX_GROUPS, MAX_HEAD_DIM = 16, 256  # kMaxGroups, kMaxHeadDim in cpu_native.cc


def supports(groups: int, head_dim: int) -> bool:
    """Whether the kernel takes this many query heads per KV head and this head_dim."""
    return groups <= MAX_GROUPS and head_dim <= MAX_HEAD_DIM


def available() -> bool:
    """Build (once per machine and source), load and register the kernel; False if that failed."""
    with _lock:
        if "ok" not in _state:
            try:
                _register(_build())
                _state["ok"] = True
            except Exception as e:  # no compiler, a failed build, an FFI mismatch: fall back
                _state.update(ok=False, error=f"{type(e).__name__}: {e}")
                logger.warning("native CPU attention kernel unavailable, using the Pallas interpret "
                               "kernels: %s", _state["error"])
        return _state["ok"]


def unavailable_reason() -> str | None:
    return _state.get("error")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> Path:
    source = _SOURCE.read_bytes()
    parts = [source, jaxlib.__version__, " ".join(_FLAGS), _cpu_flags(), platform.machine()]
    key = hashlib.sha256(b"\0".join(p if isinstance(p, bytes) else p.encode() for p in parts))
    cache = Path(os.environ.get("JSERVE_KERNEL_CACHE",
                                Path.home() / ".cache" / "jserve" / "kernels"))
    lib = cache / f"paged_attention_{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    cache.mkdir(parents=True, exist_ok=True)
    # Build to a private name, then rename: concurrent processes never see a partial library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    # Compile and link in two steps: linking with -ffast-math would add crtfastmath.o, whose
    # constructor turns on flush-to-zero for the whole process when the library loads.
    obj = tmp + ".o"
    for cmd in ([compiler, *_FLAGS, "-c", "-I", jax.ffi.include_dir(), str(_SOURCE), "-o", obj],
                [compiler, "-shared", obj, "-o", tmp]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            for path in (obj, tmp):
                if os.path.exists(path):
                    os.unlink(path)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.unlink(obj)
    os.replace(tmp, lib)
    logger.info("built the native CPU attention kernel: %s", lib)
    return lib


def _register(lib: Path) -> None:
    handle = ctypes.cdll.LoadLibrary(str(lib))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.JservePagedAttention),
                                platform="cpu")


def paged_attention_rows(q_rows: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         q_start: jax.Array, q_lens: jax.Array, page_indices: jax.Array, *,
                         groups: int, sm_scale: float, soft_cap: float | None,
                         sliding_window: int | None) -> jax.Array:
    """Attention of packed query rows [batch, num_kv_heads, tokens * groups, head_dim]; f32 out.

    Same contract as `cpu.paged_attention_rows` (decode is the one-token case).
    """
    if not available():
        raise RuntimeError(f"native CPU attention kernel unavailable: {unavailable_reason()}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_rows.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q_rows.astype(jnp.float32), k_pages, v_pages, q_start, q_lens, page_indices,
                groups=np.int32(groups), sm_scale=np.float32(sm_scale),
                soft_cap=np.float32(soft_cap or 0.0), sliding_window=np.int32(sliding_window or 0))

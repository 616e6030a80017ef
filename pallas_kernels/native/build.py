"""Native CPU kernels: a C++ source built on first use into a cached shared library whose XLA FFI
targets are then registered with JAX.

The library is compiled with the machine's C++ compiler (`$CXX`, else `g++`) against the XLA FFI
headers that ship with jaxlib, with `-march=native` (or `-march=$JSERVE_NATIVE_ARCH`: e.g.
`x86-64-v3` builds the AVX2 kernels on an AVX-512 machine), and cached under `$JSERVE_KERNEL_CACHE`
(default `~/.cache/jserve/kernels`), keyed on the source, the headers it may include
(`pallas_kernels/native/*.h`), the jaxlib version, the flags and the CPU's flags. Without a
compiler, or if the build fails, `available()` is False and says why once
in the log; every caller keeps a pure-XLA path for that case.
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
import jaxlib

logger = logging.getLogger(__name__)

HEADERS = Path(__file__).parent  # headers the kernels share (parallel_for.h), part of the cache key

# -ffast-math lets GCC contract multiply-adds and call glibc's vector expf (libmvec).
FLAGS = ("-O3", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC")


def flags() -> tuple[str, ...]:
    """The compiler flags: FLAGS and `-march=native`, or `$JSERVE_NATIVE_ARCH`'s target."""
    return (*FLAGS, f"-march={os.environ.get('JSERVE_NATIVE_ARCH') or 'native'}")


class NativeLibrary:
    """One C++ source and the FFI targets (`{target name: exported symbol}`) it defines."""

    def __init__(self, name: str, source: Path, targets: dict[str, str], *, what: str,
                 fallback: str, include_dir: Path = HEADERS, constants: dict[str, int] | None = None):
        """`constants`: `{exported symbol: value}` the Python side relies on (shapes shared across
        the FFI): each is an `extern "C" int` of the library, checked when it loads; a mismatch
        leaves the library unavailable, with the reason."""
        self.name, self.source, self.targets = name, source, dict(targets)
        self.constants = dict(constants or {})
        self.include_dir = include_dir
        self.what, self.fallback = what, fallback
        self._lock = threading.Lock()
        self._ok: bool | None = None
        self._error: str | None = None
        self._handle: ctypes.CDLL | None = None

    def available(self) -> bool:
        """Build (once per machine and source), load and register; False if that failed."""
        with self._lock:
            if self._ok is None:
                try:
                    handle = ctypes.cdll.LoadLibrary(str(self._build()))
                    for symbol, want in self.constants.items():
                        fn = getattr(handle, symbol)
                        fn.restype, fn.argtypes = ctypes.c_int, []
                        if fn() != want:
                            raise RuntimeError(f"{self.source.name}'s {symbol}() is {fn()}, the Python "
                                               f"side expects {want}")
                    for target, symbol in self.targets.items():
                        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)),
                                                    platform="cpu")
                    self._ok, self._handle = True, handle
                except Exception as e:  # no compiler, a failed build, an FFI mismatch: fall back
                    self._ok, self._error = False, f"{type(e).__name__}: {e}"
                    logger.warning("%s unavailable, %s: %s", self.what, self.fallback, self._error)
            return self._ok

    def unavailable_reason(self) -> str | None:
        return self._error

    def function(self, symbol: str, restype=ctypes.c_int):
        """A plain C function the library exports (`extern "C"`), once `available()`."""
        if not self.available():
            raise RuntimeError(f"{self.what} unavailable: {self._error}")
        fn = getattr(self._handle, symbol)
        fn.restype, fn.argtypes = restype, []
        return fn

    def _build(self) -> Path:
        source = self.source.read_bytes()
        headers = [h.read_bytes() for h in sorted(self.include_dir.glob("*.h"))]  # sources include them
        parts = [source, *headers, jaxlib.__version__, " ".join(flags()), _cpu_flags(), platform.machine()]
        key = hashlib.sha256(b"\0".join(p if isinstance(p, bytes) else p.encode() for p in parts))
        cache = Path(os.environ.get("JSERVE_KERNEL_CACHE",
                                    Path.home() / ".cache" / "jserve" / "kernels"))
        lib = cache / f"{self.name}_{key.hexdigest()[:16]}.so"
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
        for cmd in ([compiler, *flags(), "-c", "-I", jax.ffi.include_dir(), "-I", str(self.include_dir),
                     str(self.source), "-o", obj],
                    [compiler, "-shared", obj, "-o", tmp]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                for path in (obj, tmp):
                    if os.path.exists(path):
                        os.unlink(path)
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.unlink(obj)
        os.replace(tmp, lib)
        logger.info("built the %s: %s", self.what, lib)
        return lib


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()

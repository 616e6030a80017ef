"""Native CPU kernels: a C++ source built on first use into a cached shared library whose XLA FFI
targets are then registered with JAX.

The library is compiled with the machine's C++ compiler (`$CXX`, else `g++`) against the XLA FFI
headers that ship with jaxlib, with `-march=native` (or `-march=$JSERVE_NATIVE_ARCH`: e.g.
`x86-64-v3` builds the AVX2 kernels on an AVX-512 machine), and cached under `$JSERVE_KERNEL_CACHE`
(default `~/.cache/jserve/kernels`), keyed on the source, the headers it may include
(`pallas_kernels/native/*.h`), the jaxlib version, the flags and the CPU's flags. Without a
compiler, or if the build fails, `available()` is False and says why once
in the log; every caller keeps a pure-XLA path for that case.
Each source builds in two variants, float only and with the quantized kernels (`NativeLibrary`).
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
    """One C++ source and the FFI targets (`{target name: exported symbol}`) it defines.

    Each source builds in two variants (`variant.h`): the float kernels only (`-DJSERVE_NATIVE_QUANT=0`,
    about half the compile time: what a float model needs, and all a cold start of the default model
    waits for), registered under the target names; and with the quantized kernels too, built the first
    time a quantized weight or page needs them (`target(name, quantized=True)`), registered under
    `<name>_quantized`.
    """

    def __init__(self, name: str, source: Path, targets: dict[str, str], *, what: str,
                 fallback: str, include_dir: Path = HEADERS, constants: dict[str, int] | None = None):
        """`constants`: `{exported symbol: value}` the Python side relies on (shapes shared across
        the FFI): each is an `extern "C" int` of the library, checked when it loads; a mismatch
        leaves the library unavailable, with the reason."""
        self.name, self.source, self.targets = name, source, dict(targets)
        self.constants = dict(constants or {})
        self.include_dir = include_dir
        self.what, self.fallback = what, fallback
        self._locks = {False: threading.Lock(), True: threading.Lock()}  # per variant: quantized?
        self._ok: dict[bool, bool] = {}
        self._error: dict[bool, str] = {}
        self._handle: dict[bool, ctypes.CDLL] = {}

    def available(self, quantized: bool = False) -> bool:
        """Build (once per machine, source and variant), load and register; False if that failed.
        `quantized`: the variant with the quantized kernels too."""
        with self._locks[quantized]:
            if quantized not in self._ok:
                try:
                    handle = ctypes.cdll.LoadLibrary(str(self._build(quantized)))
                    for symbol, want in self.constants.items():
                        fn = getattr(handle, symbol)
                        fn.restype, fn.argtypes = ctypes.c_int, []
                        if fn() != want:
                            raise RuntimeError(f"{self.source.name}'s {symbol}() is {fn()}, the Python "
                                               f"side expects {want}")
                    for target, symbol in self.targets.items():
                        jax.ffi.register_ffi_target(_target_name(target, quantized),
                                                    jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu")
                    self._ok[quantized], self._handle[quantized] = True, handle
                except Exception as e:  # no compiler, a failed build, an FFI mismatch: fall back
                    self._ok[quantized], self._error[quantized] = False, f"{type(e).__name__}: {e}"
                    logger.warning("%s%s unavailable, %s: %s", self.what, " (quantized kernels)" * quantized,
                                   self.fallback, self._error[quantized])
            return self._ok[quantized]

    def unavailable_reason(self, quantized: bool = False) -> str | None:
        return self._error.get(quantized)

    def target(self, name: str, quantized: bool) -> str:
        """The FFI target to call for target `name`: the float build's, or (`quantized`: a
        quantized weight or page among the arguments) the quantized build's, built on first use;
        RuntimeError if that build is unavailable."""
        if not self.available(quantized):
            raise RuntimeError(f"{self.what}{' (quantized kernels)' * quantized} unavailable: "
                               f"{self.unavailable_reason(quantized)}")
        return _target_name(name, quantized)

    def function(self, symbol: str, restype=ctypes.c_int):
        """A plain C function the library exports (`extern "C"`), once `available()`."""
        if not self.available():
            raise RuntimeError(f"{self.what} unavailable: {self.unavailable_reason()}")
        fn = getattr(self._handle[False], symbol)
        fn.restype, fn.argtypes = restype, []
        return fn

    def _build(self, quantized: bool = False) -> Path:
        source = self.source.read_bytes()
        headers = [h.read_bytes() for h in sorted(self.include_dir.glob("*.h"))]  # sources include them
        options = (*flags(), f"-DJSERVE_NATIVE_QUANT={int(quantized)}")
        parts = [source, *headers, jaxlib.__version__, " ".join(options), _cpu_flags(), platform.machine()]
        key = hashlib.sha256(b"\0".join(p if isinstance(p, bytes) else p.encode() for p in parts))
        cache = Path(os.environ.get("JSERVE_KERNEL_CACHE",
                                    Path.home() / ".cache" / "jserve" / "kernels"))
        lib = cache / f"{self.name}{'_quantized' * quantized}_{key.hexdigest()[:16]}.so"
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
        for cmd in ([compiler, *options, "-c", "-I", jax.ffi.include_dir(), "-I", str(self.include_dir),
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


def _target_name(name: str, quantized: bool) -> str:
    return f"{name}_quantized" if quantized else name


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()

"""Shared fixtures: the persistent compilation cache, the real model's checkpoint, markers."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def free_port() -> int:
    """A loopback port nobody listens on (for servers the tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, procs, timeout: float) -> None:
    """Poll `url`/health until it answers 200; fail with the stderr of a server process that
    exited, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"server process exited {p.returncode}: {p.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"{url} did not become healthy in {timeout:.0f} s"
        time.sleep(0.25)


def pytest_configure(config):
    # Eight CPU devices for the sharding tests (tests/test_sharding.py); every other test runs on
    # device 0 as before. Must be set before JAX creates its CPU client.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count=8".strip()
    # The suite is bound by XLA:CPU compilations (tiny models, many shapes): LLVM at -O0 compiles
    # them about 1.4x faster (tests/test_runner.py + tests/test_multi_step.py, empty caches:
    # 280 s -> 203 s, every test passing) with the same numbers (no fast math at either level).
    # Tests only: a served model compiles at XLA's default level. The child processes tests start
    # inherit it.
    if "xla_backend_optimization_level" not in flags:
        flags = f"{flags} --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = flags
    # One persistent compilation cache for the whole run (and across runs on the same machine):
    # engines built by different tests compile the same shapes.
    os.environ.setdefault("JSERVE_COMPILATION_CACHE", str(Path.home() / ".cache" / "jserve" / "jax-tests"))
    # Under pytest-xdist (scripts/test.sh runs the suite on a worker per core), a folder per worker:
    # JAX's cache writes its entries in place, unlocked, so a worker could read another's half-written one.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        os.environ["JSERVE_COMPILATION_CACHE"] = str(Path(os.environ["JSERVE_COMPILATION_CACHE"]) / worker)
    from jserve.llm import enable_compilation_cache

    enable_compilation_cache()
    # Build the native CPU kernels afresh in every run (a few seconds each), so the suite
    # checks the build on this machine's compiler and jaxlib, not a library cached long ago.
    if "JSERVE_KERNEL_CACHE" not in os.environ:
        import tempfile

        config._jserve_kernel_dir = os.environ["JSERVE_KERNEL_CACHE"] = tempfile.mkdtemp(
            prefix="jserve-kernels-")
        if os.environ.get("PYTEST_XDIST_WORKER") is None:
            # Built once here, side by side, before any worker starts (the controller runs no
            # test): else each xdist worker built all three on its first native test (about
            # 40 s of compiler time each).
            from jserve.runtime import backends

            for t in backends.prebuild("cpu", quantized_weights=True, quantized_kv=True, lora=True):
                t.join()


def _memory_maps() -> int:
    """This process's memory mappings (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _rss() -> int:
    """This process's resident memory in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


_PEAK_MAPS = [0, ""]  # the most memory mappings seen after a test, and that test
_PEAK_RSS = [0, ""]  # the most resident memory seen after a test, and that test
_MAPS_LOG = os.environ.get("JSERVE_TEST_MAPS_LOG")  # a file: each test's mappings and time, for diagnosis


def _log_maps(line: str) -> None:
    if _MAPS_LOG:
        with open(_MAPS_LOG, "a") as f:
            f.write(line + "\n")


_GC = {"count": 0, "seconds": 0.0, "cleared": 0}  # collections the suite ran for the mappings


def _collect(clear_caches: bool = False) -> None:
    import gc

    start = time.perf_counter()
    if clear_caches:
        import jax

        jax.clear_caches()
        _GC["cleared"] += 1
    gc.collect()
    _trim_heap()
    _GC["count"] += 1
    _GC["seconds"] += time.perf_counter() - start


def _trim_heap() -> None:
    """Give the C heap's free memory back to the OS (glibc's malloc_trim): freed XLA buffers and
    executables otherwise stay resident in the allocator's arenas, and a worker's resident memory
    only grows (2026-12-05: a worker kept 9.2 GiB after a collection that cleared JAX's caches,
    and the other worker died, most likely by the OOM killer, loading a model beside it; CI
    lost a run so). Measured on an LLM closed and collected: 2.72 GiB resident, 0.43 after this."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


_NEXT_COLLECTION = [15000]  # the mappings past which the next test's teardown collects
_GIB = 1 << 30
_NEXT_RSS = [4 * _GIB]  # the resident bytes past which it collects


def pytest_runtest_teardown(item, nextitem):
    """Collect garbage once a test leaves more memory mappings than `_NEXT_COLLECTION`: the
    engines of finished tests are garbage in reference cycles (every Runner, measured: gc frees
    all of them), and each holds its executables' mappings; one test module makes about 4000 per
    test (test_speculative.py). Past 40000 after that (executables something still holds: JAX's
    caches of jitted kernels, session fixtures), drop JAX's caches too, at the module's end
    (`_free_executables`; within a module only past 52000). The next collection
    waits for 15000 mappings or 6000 more than this one left, whichever is more (at most
    46000): a collection costs about 1.5 s in a worker's full heap, and once the live mappings
    passed 15000 for good a fixed threshold collected after every test (CI, 2026-12-03: 272
    collections, 397 s on one worker of two; 14 and 34 s with this rule, peak 38907).

    Resident memory has the same rule, without dropping JAX's caches (that recompiles the
    session fixtures' warmed-up steps, which their tests count as compilations after warm-up):
    collect past 4 GiB or 2 GiB more than the last collection left (at most 7 GiB). Two workers
    and the processes some tests start share the machine's memory: on a 23 GiB machine the
    kernel killed a worker holding 12 GiB beside another of 9.7 GiB and a 2.3 GiB `jserve
    warmup` (2026-12-04), and pytest-xdist then hung."""
    maps, rss = _memory_maps(), _rss()
    if maps > _PEAK_MAPS[0]:
        _PEAK_MAPS[:] = [maps, item.nodeid]
    if rss > _PEAK_RSS[0]:
        _PEAK_RSS[:] = [rss, item.nodeid]
    _log_maps(f"{time.time():.1f} {maps} {rss >> 20}M {item.nodeid} {os.environ.get('PYTEST_XDIST_WORKER', '')}")
    _maybe_collect(maps, rss, clear_past=52000)


def _maybe_collect(maps: int, rss: int, clear_past: int = 40000) -> None:
    """`pytest_runtest_teardown`'s rule, for `maps` mappings and `rss` resident bytes now. JAX's
    caches are dropped past `clear_past` mappings left: between tests of a module only near the
    kernel's limit, as it recompiles the module's warmed-up engines (whose tests then count
    compilations after warm-up); at a module's end past 40000 (a clear recompiles the session
    fixtures' warmed-up engines too, which the golden tests count)."""
    if maps > _NEXT_COLLECTION[0] or rss > _NEXT_RSS[0]:
        _collect()
        left, rss = _memory_maps(), _rss()
        if left > clear_past:
            _collect(clear_caches=True)
            left, rss = _memory_maps(), _rss()
        _NEXT_COLLECTION[0] = min(max(15000, left + 6000), 46000)  # well below the kernel's 65530
        _NEXT_RSS[0] = min(max(4 * _GIB, rss + 2 * _GIB), 7 * _GIB)


@pytest.fixture(scope="module", autouse=True)
def _free_executables(request):
    """At each test module's end, drop its engines (and their compiled executables) if the
    mappings are past the next collection's threshold (`pytest_runtest_teardown`).

    Every loaded XLA:CPU executable holds a few memory mappings for each of its kernels (three
    per kernel: code, constants, data), and the kernel allows 65530 per process
    (vm.max_map_count). One pytest process runs the whole suite: engines in reference cycles
    that the garbage collector had not reached yet passed that limit within
    tests/test_speculative.py (63121 mappings, then a segfault in the next compilation, without
    these collections), and LLVM then crashes in whatever compilation or cache read comes next.
    The terminal summary prints the peak and what the collections cost.
    """
    yield
    _maybe_collect(_memory_maps(), _rss())  # the module's fixtures are garbage now; the same rule
    _log_maps(f"{time.time():.1f} {_memory_maps()} {_rss() >> 20}M module-end {request.module.__name__}")


_WORKERS: dict[str, tuple] = {}  # under pytest-xdist: each worker's (peak, test, collections), on the controller


def pytest_sessionfinish(session):
    output = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker: report to the controller
    if output is not None:
        output["jserve_maps"] = (*_PEAK_MAPS, _GC["count"], _GC["seconds"], _GC["cleared"], *_PEAK_RSS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    report = getattr(node, "workeroutput", {}).get("jserve_maps")
    if report:
        _WORKERS[node.gateway.id] = tuple(report)


def pytest_terminal_summary(terminalreporter):
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        limit = 0
    reports = dict(_WORKERS) or {"": (*_PEAK_MAPS, _GC["count"], _GC["seconds"], _GC["cleared"], *_PEAK_RSS)}
    for worker, (peak, test, count, seconds, cleared, rss, rss_test) in sorted(reports.items()):
        if peak:
            terminalreporter.write_line(f"{worker + ': ' if worker else ''}memory mappings after a test: at most "
                                        f"{peak} (after {test}; the kernel's limit is {limit or 'unknown'}); "
                                        f"resident memory at most {rss / 2**30:.1f} GiB (after {rss_test}); "
                                        f"{count} collections took {seconds:.1f} s, {cleared} cleared JAX's caches")


def pytest_unconfigure(config):
    kernel_dir = getattr(config, "_jserve_kernel_dir", None)
    if kernel_dir:
        import shutil

        shutil.rmtree(kernel_dir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    import jax

    platforms = {d.platform for d in jax.devices()}
    for item in items:
        if "tpu" in item.keywords and "tpu" not in platforms:
            item.add_marker(pytest.mark.skip(reason="needs a TPU"))
        if "gpu" in item.keywords and "gpu" not in platforms:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))


@pytest.fixture(scope="session")
def golden():
    return json.loads((DATA / "smollm2_golden.json").read_text())


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory) -> Path:
    """The default model converted once per session (reused from checkpoints/ when present)."""
    from jserve.model.checkpoint import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_checkpoint):
    from jserve import LLM

    return LLM(str(smollm2_checkpoint), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128)


def run_python(code: str, kernel_cache, **env):
    """Run `code` in a fresh Python with its own native-kernel cache (and `env` on top); fails the
    test with the child's stderr if it exits non-zero."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JSERVE_KERNEL_CACHE=str(kernel_cache), **env))
    assert done.returncode == 0, done.stderr[-3000:]
    return done

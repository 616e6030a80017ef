"""Huge pages under the CPU runner's weights and KV pages: asked for, granted, contents kept."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA
from jserve.model.checkpoint import read_params
from jserve.runtime import huge_pages
from jserve.runtime.runner import Runner

needs_thp = pytest.mark.skipif(not huge_pages.supported(), reason="no transparent huge pages here")


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@needs_thp
def test_advise_collapses_a_big_array_and_keeps_its_contents():
    x = jnp.arange(3 << 20, dtype=jnp.float32) * 0.5  # 12 MiB
    before = np.asarray(x).copy()
    done = huge_pages.advise({"x": x, "small": jnp.ones(8)})
    assert done >= 10 << 20  # at least the whole 2 MiB pages inside x; the small array skipped
    assert huge_kib_at(x.unsafe_buffer_pointer() + (4 << 20)) >= 2048
    np.testing.assert_array_equal(np.asarray(x), before)


def test_advise_skips_small_arrays_non_arrays_and_deleted_arrays():
    deleted = jnp.zeros(1 << 20)
    deleted.delete()
    assert huge_pages.advise([jnp.ones(1024), np.ones(1 << 20), "text", None, deleted]) == 0


@needs_thp
def test_cpu_runner_puts_its_weights_and_pages_on_huge_pages():
    config, params = read_params(DATA / "arch" / "smollm2")
    params = {k: jnp.asarray(v) for k, v in params.items()}
    kw = dict(num_pages=4096, page_size=16, max_model_len=64, kv_dtype=jnp.float32)
    runner = Runner(config, params, **kw)
    pool = runner.kv[0][0]
    assert pool.nbytes >= 8 << 20
    assert runner.huge_pages.wait() >= pool.nbytes  # every layer's pages, and the weights
    assert huge_kib_at(pool.unsafe_buffer_pointer() + (4 << 20)) >= 2048
    assert Runner(config, params, huge_pages=False, **kw).huge_pages.wait() == 0


def test_jserve_huge_pages_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("JSERVE_HUGE_PAGES", "0")
    assert not huge_pages.supported()
    assert huge_pages.advise(jnp.zeros(1 << 20)) == 0


def test_closing_the_runner_stops_the_advice_thread(monkeypatch):
    """The thread must not outlive its runner (it logs, and the buffers' owner may free them)."""
    stopped = []

    def slow_advise(buffers, stop):
        stopped.append(stop.wait(30))  # a collapse still running when the runner closes
        return 0

    monkeypatch.setattr(huge_pages, "_advise", slow_advise)
    config, params = read_params(DATA / "arch" / "smollm2")
    runner = Runner(config, {k: jnp.asarray(v) for k, v in params.items()}, num_pages=64, page_size=16,
                    max_model_len=64, kv_dtype=jnp.float32)
    runner.close()
    assert stopped == [True] and not runner.huge_pages._thread.is_alive()


def test_a_stopped_advice_leaves_the_remaining_buffers_alone(monkeypatch):
    stop = huge_pages.threading.Event()
    stop.set()
    calls = []

    class Libc:
        class madvise:  # noqa: N801 (libc's name)
            def __new__(cls, *args):
                calls.append(args)
                return 0

    monkeypatch.setattr(huge_pages.ctypes, "CDLL", lambda *a, **k: Libc)
    assert huge_pages._advise([(0, huge_pages.HUGE_PAGE)] * 3, stop) == 0 and calls == []
    stop.clear()
    assert huge_pages._advise([(0, huge_pages.HUGE_PAGE)] * 3, stop) == 3 * huge_pages.HUGE_PAGE
    assert len(calls) == 6  # MADV_HUGEPAGE and MADV_COLLAPSE for each

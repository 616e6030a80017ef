"""`LLM.update_weights` against reloading the model: the default model's checkpoint read to the
host (`jserve.engine.weights.load_weights`), swapped in from those host arrays and from device
arrays, and a new `LLM` built (warm compilation cache); seconds and the process's peak resident
memory above its level before each call (sampled every 2 ms).

    python -m benchmarks.engine.update_weights [--model M] [--out update_weights.json]
"""

from __future__ import annotations

import os
import threading
import time

import jax

from benchmarks.harness import parser, report
from jserve import LLM
from jserve.engine.weights import load_weights

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def timed(fn) -> tuple[float, float, object]:
    """(seconds, peak extra GiB, result) of fn()."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], _rss() - base)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    return round(seconds, 2), round(max(peak[0], _rss() - base) / 2**30, 2), result


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--model", default=None, help="the model (default: jserve's default model)")
    args = p.parse_args(argv)
    llm = LLM(args.model)
    rows = []
    seconds, extra, host = timed(lambda: load_weights(llm.path, llm.dtype))
    rows.append({"what": "read the checkpoint to the host", "s": seconds, "peak_extra_gib": extra})
    seconds, extra, _ = timed(lambda: llm.update_weights(host))
    rows.append({"what": "update_weights from host arrays", "s": seconds, "peak_extra_gib": extra})
    device = jax.device_put(host)
    seconds, extra, _ = timed(lambda: llm.update_weights(device, donate=True))
    rows.append({"what": "update_weights from device arrays", "s": seconds, "peak_extra_gib": extra})
    compiled = llm.stats()["compilations_after_warmup"]
    path = llm.path
    llm.close()
    host = device = None  # the old model's arrays go before the reload
    seconds, extra, fresh = timed(lambda: LLM(str(path)))
    rows.append({"what": "reload: a new LLM", "s": seconds, "peak_extra_gib": extra})
    fresh.close()
    report(rows, args.out, title=f"update_weights vs reload ({compiled} compilations after warm-up)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

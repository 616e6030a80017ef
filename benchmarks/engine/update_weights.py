"""`LLM.update_weights` against reloading the model: the default model's checkpoint read to the
host (`jserve.engine.weights.load_weights`), swapped in from those host arrays and from device
arrays, and a new `LLM` built (warm compilation cache); seconds and the process's peak resident
memory above its level before each call (sampled every 2 ms).

    python -m benchmarks.engine.update_weights [--model M] [--out update_weights.json]

With a bare config.json as the model, random weights of its shapes (`load_format="dummy"`,
bfloat16; `--layers N` keeps the first N layers, for an 8B shape in a small machine's memory), no
warm-up, and no reload row:

    python -m benchmarks.engine.update_weights --model tests/data/configs/llama-3.1-8b.json --layers 2
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

import jax

from benchmarks.harness import parser, report
from jserve import LLM
from jserve.engine.weights import load_weights
from jserve.model.dummy import dummy_params

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
    p.add_argument("--layers", type=int, default=None, help="with a config.json: keep its first N layers")
    args = p.parse_args(argv)
    dummy = args.model is not None and args.model.endswith(".json")
    if dummy:
        config = json.loads(Path(args.model).read_text())
        config["num_hidden_layers"] = args.layers or config["num_hidden_layers"]
        folder = Path(tempfile.mkdtemp(prefix="jserve-update-bench-"))
        (folder / "config.json").write_text(json.dumps(config))
        llm = LLM(str(folder), load_format="dummy", max_model_len=256, max_num_seqs=2, warmup=False)
    else:
        llm = LLM(args.model)
    rows = []
    if dummy:
        seconds, extra, host = timed(lambda: jax.device_get(dummy_params(llm.config, llm.dtype, seed=1)))
        what = f"random weights to the host ({llm.config.num_layers} layers)"
    else:
        seconds, extra, host = timed(lambda: load_weights(llm.path, llm.dtype))
        what = "read the checkpoint to the host"
    rows.append({"what": what, "s": seconds, "peak_extra_gib": extra})
    seconds, extra, _ = timed(lambda: llm.update_weights(host))
    rows.append({"what": "update_weights from host arrays", "s": seconds, "peak_extra_gib": extra})
    device = jax.device_put(host)
    seconds, extra, _ = timed(lambda: llm.update_weights(device, donate=True))
    rows.append({"what": "update_weights from device arrays", "s": seconds, "peak_extra_gib": extra})
    compiled = llm.stats()["compilations_after_warmup"]
    path = llm.path
    llm.close()
    host = device = None  # the old model's arrays go before the reload
    if dummy:
        report(rows, args.out, title=f"update_weights, {args.model} with {llm.config.num_layers} layers "
                                     f"(random {llm.dtype} weights)")
        return 0
    seconds, extra, fresh = timed(lambda: LLM(str(path)))
    rows.append({"what": "reload: a new LLM", "s": seconds, "peak_extra_gib": extra})
    fresh.close()
    report(rows, args.out, title=f"update_weights vs reload ({compiled} compilations after warm-up)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

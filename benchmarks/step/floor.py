"""The decode step against its memory floor, per batch and context, for any model's shapes
(`--load-format dummy`: random weights, nothing downloaded; an 8B config on a GPU).

The floor is the bytes a decode step must read (the weights once, plus every live token's K/V,
`jserve.runtime.step_rows.cost`) over the device's measured copy bandwidth (a jitted copy of a buffer as large
as `--copy-bytes`). A (batch, context) whose pages do not fit in `--kv-bytes` is reported as not
fitting. Prints a table and writes JSON.

    python -m benchmarks.step.floor --model tests/data/configs/llama-3.1-8b.json --load-format dummy \\
        --batches 1,16,64,256 --contexts 1024,4096 --kv-bytes 100GiB --out step_floor.json
    python -m benchmarks.step.floor --batches 1,16 --contexts 256 --out step_floor.json   # CPU, the default model
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import median_ms, parser, report, timings


def parse_args(argv=None) -> argparse.Namespace:
    from jserve.engine.config import parse_bytes

    p = parser(__doc__, out="step_floor.json")
    p.add_argument("--model", default=None, help="checkpoint, HF folder, .gguf, or a config.json (dummy)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="256")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--kv-bytes", type=parse_bytes, default=None, help="KV budget (default: the engine's)")
    p.add_argument("--copy-bytes", type=parse_bytes, default=parse_bytes("256MiB"))
    p.add_argument("--backend", "--attention-backend", dest="backend", default=None)
    return p.parse_args(argv)


def copy_bandwidth(nbytes: int, reps: int = 10) -> float:
    """Bytes per second (read + write) of copying an `nbytes` buffer: a jitted copy on an
    accelerator; on a CPU numpy copies of its slices from one thread per core (XLA:CPU's copy
    runs on one thread, a third of what the cores stream)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import jax.numpy as jnp
    import numpy as np

    if jax.default_backend() == "cpu":
        threads = os.cpu_count() or 1
        src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        parts = np.array_split(np.arange(len(src)), threads)
        bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts]
        with ThreadPoolExecutor(threads) as pool:
            times = timings(lambda: list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds)), reps)
        return 2 * src.nbytes / statistics.median(times)
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / statistics.median(timings(lambda: copy(x), reps, sync=jax.block_until_ready))


def main(argv=None) -> int:
    args = parse_args(argv)
    from jserve import LLM
    from jserve.runtime.step_rows import cost
    from jserve.runtime.steps import StepRow

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    model, tmp = args.model, None
    if model and Path(model).suffix == ".json":  # a bare config.json: a folder holding it
        tmp = tempfile.mkdtemp()
        shutil.copy(model, Path(tmp) / "config.json")
        model = tmp
    settings = dict(max_model_len=max(contexts) + 8, max_num_seqs=max(batches),
                    max_num_batched_tokens=max(max(batches), 512), warmup=False, load_format=args.load_format)
    if args.kv_bytes is not None:
        settings["kv_cache_bytes"] = args.kv_bytes
    if args.backend:
        settings["backend"] = args.backend
    llm = LLM(model, dtype=args.dtype, **settings)
    runner = llm.runner
    bandwidth = copy_bandwidth(args.copy_bytes)
    rows_out = []
    for context in contexts:
        pages_per_row = math.ceil((context + 1) / runner.page_size)
        for batch in batches:
            if batch * pages_per_row >= runner.num_pages:
                rows_out.append({"batch": batch, "context": context, "fits": False})
                continue
            rows = [StepRow(context, [7], list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row)))
                    for i in range(batch)]
            step = median_ms(lambda: runner.execute(rows), args.reps) / 1000  # (the first call compiles)
            floor_bytes = cost(runner.config, rows, param_bytes=runner.param_bytes, num_params=runner.num_params,
                               kv_itemsize=runner.kv_itemsize, kv_scale_bytes=runner.kv_scale_bytes)[0]
            floor = floor_bytes / bandwidth
            rows_out.append({"batch": batch, "context": context, "fits": True, "step_ms": 1000 * step,
                             "floor_ms": 1000 * floor, "ratio": step / floor, "floor_bytes": floor_bytes,
                             "tokens_per_s": batch / step})
    report(rows_out, args.out, ["batch", "context", "fits", "step_ms", "floor_ms", "ratio", "tokens_per_s"],
           title=f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; weights {runner.param_bytes / 1e9:.2f} GB; "
           f"{runner.num_pages} pages of {runner.page_size}; backend {runner.backend}",
           config=vars(args), copy_bandwidth=bandwidth, param_bytes=runner.param_bytes)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

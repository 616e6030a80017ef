"""How many 8k-token sequences of a model with sliding and full layers (Gemma 3 270M by default)
run at once in a fixed KV budget, with one pool for every layer and with hybrid pages
(`jserve.core.hybrid_pages`): the engine's own scheduler and page tables, sized as
`build_engine` sizes them (`plan_memory`, then `split_pages`), driven without the model (each
step's samples are a fixed token). Host-side only: it measures the allocator, not the device.

Each of `--requests` requests has a prompt of `--context` - `--output` random tokens and samples
`--output` tokens (`--max-model-len` apart from `--context`: the pools split for one length,
the sequences of another). Reported per variant: the most sequences decoding at once (every one of them
then holds its whole context's pages in the full layers), the preemptions, and the steps to
finish them all.

    python -m benchmarks.engine.hybrid_capacity [--model checkpoints/gemma3-270m] [--kv-budget 4GiB]
"""

from __future__ import annotations

import numpy as np

from benchmarks.harness import parser, report
from jserve.core.hybrid_pages import HybridPageTable, split_pages
from jserve.core.page_table import PageTable
from jserve.core.plan import Request
from jserve.core.request import SamplingParams
from jserve.core.scheduler import Scheduler, SchedulerConfig
from jserve.engine.config import parse_bytes
from jserve.model.checkpoint import read_model_config
from jserve.runtime.kv_cache import plan_memory


def run(table, config: SchedulerConfig, prompts: list[list[int]], output: int) -> dict:
    """Drive a scheduler over `table` until every request finished; what it held at once."""
    scheduler = Scheduler(config, table)
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(i), list(prompt), params, float(i)))
    steps = most_decoding = most_running = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        steps += 1
        decoding = sum(len(r.prompt_token_ids) <= r.num_computed_tokens for r in scheduler.running)
        most_decoding, most_running = max(most_decoding, decoding), max(most_running, scheduler.num_running)
        scheduler.update(plan, {c.request.request_id: 1 for c in plan.chunks if c.emits_token})
    return {"most_decoding": most_decoding, "most_running": most_running,
            "preemptions": scheduler.num_preemptions, "steps": steps}


def main(argv=None) -> int:
    p = parser(__doc__, out="")
    p.add_argument("--model", default="checkpoints/gemma3-270m", help="a checkpoint (only its config is read)")
    p.add_argument("--kv-budget", type=parse_bytes, default=parse_bytes("4GiB"), help="KV bytes, e.g. 4GiB")
    p.add_argument("--kv-dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence (prompt + output)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the context the pools are split for (default --context): a shorter --context "
                        "shows what the split costs shorter sequences")
    p.add_argument("--output", type=int, default=1024, help="sampled tokens per sequence")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--max-num-seqs", type=int, default=256)
    args = p.parse_args(argv)
    max_len = args.max_model_len or args.context
    model, _ = read_model_config(args.model)
    mem = plan_memory(model, weight_dtype_bytes=2, kv_dtype=args.kv_dtype, page_size=args.page_size,
                      context=max_len, kv_budget_bytes=args.kv_budget,
                      max_num_batched_tokens=args.max_num_batched_tokens)
    sliding = sum(model.layer_is_sliding(i) for i in range(model.num_layers))
    split = split_pages(mem.num_pages, num_layers=model.num_layers, sliding_layers=sliding, page_size=args.page_size,
                        context=max_len, window=model.sliding_window or 0,
                        max_chunk=args.max_num_batched_tokens)
    if split is None:
        raise SystemExit(f"{args.model}: hybrid pages do not apply (no sliding and full layers, or the window "
                         f"holds the context)")
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=max(max_len, args.context) + 1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, model.vocab_size, args.context - args.output).tolist() for _ in range(args.requests)]
    tables = {"one pool": (lambda: PageTable(mem.num_pages, args.page_size), f"{mem.num_pages} pages"),
              "hybrid pages": (lambda: HybridPageTable(*split, args.page_size, sliding_window=model.sliding_window),
                               f"{split[0]} full + {split[1]} sliding pages")}
    rows = [{"variant": name, "pages": pages, **run(make(), config, prompts, args.output)}
            for name, (make, pages) in tables.items()]
    report(rows, args.out, title=f"{args.model}: {args.requests} sequences of {args.context} tokens in "
                                 f"{args.kv_budget / 2**30:g} GiB of {args.kv_dtype} KV (pages of {args.page_size}, "
                                 f"chunks of {args.max_num_batched_tokens}; pools split for {max_len} tokens)",
           model=str(args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

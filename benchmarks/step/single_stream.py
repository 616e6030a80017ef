"""Where one stream's token goes: a per-step breakdown of batch-1 decode, offline (`LLM.generate`
on one prompt of ten token ids, greedy, eos ignored), for one or more models side by side.

For each model one `LLM` (one sequence at a time, no warm-up beyond a first generation). Each
round generates `--max-tokens` tokens from one short prompt, the models taking turns round by
round (a busy machine slows them alike), and times, per decode step:
  - step: `LLMEngine.step` whole (what a token costs the engine; tok/s is its inverse over the
    generation's wall time);
  - schedule: the scheduler's plan; inputs: the runner's host inputs (pack + sampling arrays);
  - forward: the compiled forward, dispatched and waited for; sample: the sampler, likewise;
  - update: the engine's update (the scheduler's bookkeeping, detokenize, stop checks);
  - rest: step minus all of these (device_put, reading the samples back, glue);
and, apart from the generation, the compiled forward and sampler alone (`forward alone`, `sample
alone`: the same call repeated on fixed inputs), the floor (the weights' bytes and the live
K/V over `--bandwidth`, `jserve.runtime.step_rows.cost`) and what Python spends between
`LLM.generate`'s steps (`outside`: the generation's wall time minus its steps). Timing the parts
waits for the forward before the sampler is dispatched, which a plain step overlaps: `step` comes
from rounds without the part timers (`--rounds` of each, alternated). A multi-step decode
(`num_scheduler_steps`) gives several tokens a call: every figure is per token, and its forward and
sampler (one compiled loop) fall into `rest`.

    python -m benchmarks.step.single_stream --models "default;/path/to/int4" --max-tokens 128 --out single.json
    python -m benchmarks.step.single_stream --models "INT4;INT4@num_scheduler_steps=8"
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

from benchmarks.harness import parser, report

PROMPT = {"prompt_token_ids": list(range(100, 110))}  # ten tokens, as the prompts (any vocabulary)
PARTS = ("schedule", "inputs", "forward", "sample", "update")


def parse_args(argv=None):
    p = parser(__doc__, out="single_stream.json")
    p.add_argument("--models", default="default",
                   help="';'-separated MODEL[@NAME=VALUE,...]: 'default' or a checkpoint path, with its own settings")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="plain rounds and timed-parts rounds per model")
    p.add_argument("--bandwidth", type=float, default=27e9, help="B/s for the floor (DESIGN §6)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="an engine setting for every model (JSON value), e.g. num_scheduler_steps=8")
    return p.parse_args(argv)


def _llm(cls, spec: str, settings: dict):
    """An `LLM` for "MODEL[@NAME=VALUE,...]" (MODEL "default": the default model)."""
    model, _, extra = spec.partition("@")
    own = dict(_setting(s) for s in extra.split(",") if s)
    return cls(None if model == "default" else model, **{**settings, **own})


def _setting(text: str):
    name, _, value = text.partition("=")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


class PartTimer:
    """Wraps an engine's parts with time stamps (per call, seconds); `on` switches them."""

    def __init__(self, llm):
        import jax

        self.on = False
        self.tokens: list[int] = []
        self.times: dict[str, list[float]] = {p: [] for p in (*PARTS, "step")}
        engine, runner = llm.engine, llm.runner
        self._restore = []

        def wrap(obj, name, part, sync=None):
            fn = getattr(obj, name)

            def timed(*args, **kwargs):
                if not self.on:
                    return fn(*args, **kwargs)
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                if sync is not None:
                    sync(out)
                self.times[part].append(time.perf_counter() - t)
                return out

            setattr(obj, name, timed)
            self._restore.append((obj, name, fn))

        wrap(engine.scheduler, "schedule", "schedule")
        wrap(runner, "prepare", "inputs")
        wrap(runner.sampler, "full", "sample", jax.block_until_ready)
        wrap(runner.sampler, "greedy", "sample", jax.block_until_ready)  # a call of plain greedy rows
        wrap(engine, "update", "update")
        step_fn = runner.step_fn

        def forward_fn(*shape):
            fn = step_fn(*shape)

            def timed(*args):
                if not self.on:
                    return fn(*args)
                t = time.perf_counter()
                out = jax.block_until_ready(fn(*args))
                self.times["forward"].append(time.perf_counter() - t)
                return out

            return timed

        runner.step_fn = forward_fn
        self._restore.append((runner, "step_fn", step_fn))

    def close(self):
        for obj, name, fn in reversed(self._restore):
            if getattr(obj, name) is not fn:
                delattr(obj, name) if name in vars(obj) else setattr(obj, name, fn)


def alone(llm, reps: int = 20) -> dict[str, float]:
    """The compiled forward and sampler of a batch-1 decode repeated on fixed inputs (ms, median)."""
    import jax

    from benchmarks.harness import median_ms
    from jserve.core.request import SamplingParams
    from jserve.runtime.steps import StepRow

    runner = llm.runner
    context = 16
    row = StepRow(context, [1], list(range(1, 1 + -(-(context + 1) // runner.page_size))),
                  SamplingParams(temperature=0.0))
    call = runner.prepare([row], [[0]], "decode")
    x = call.inputs
    tokens = runner.device_tokens(x.tokens)
    fn = runner.step_fn(*tokens.shape)

    def forward():
        logits, runner.kv = fn(runner.params, runner.kv, tokens, x.positions, x.meta, x.last, x.lora)
        return logits

    logits = jax.block_until_ready(forward())

    def sample():  # the sampler the runner runs for this row (plain greedy: the argmax alone)
        return runner.sampler(logits, x, x)
    result = {"forward alone": median_ms(forward, reps, sync=jax.block_until_ready),
              "sample alone": median_ms(sample, reps, sync=jax.block_until_ready)}
    nbytes, _ = runner.cost([row])
    result["floor bytes"] = nbytes
    return result


def generate_round(llm, sampling, timer: PartTimer, timed: bool) -> tuple[float, int]:
    """One generation; (wall seconds, tokens). With `timed`, the parts' timers run."""
    steps = timer.times["step"]
    timer.tokens = []  # the tokens each step gave (a multi-step call: several)
    engine = llm.engine
    step = engine.step
    made = [0]

    def counted():
        t = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t)
        now = len(out[0].outputs[0].token_ids) if out else made[0]
        timer.tokens.append(max(1, now - made[0]))
        made[0] = now
        return out

    timer.on = timed
    engine.step = counted
    try:
        t = time.perf_counter()
        out = llm.generate([PROMPT], sampling)
        wall = time.perf_counter() - t
    finally:
        timer.on = False
        del engine.step
    return wall, len(out[0].outputs[0].token_ids)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jserve import LLM, SamplingParams

    settings = dict(max_num_seqs=1, max_model_len=args.max_tokens + 64, warmup=False, quality_gate="warn")
    settings.update(_setting(s) for s in args.set)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    names = args.models.split(";")
    llms = {n: _llm(LLM, n, settings) for n in names}
    timers = {}
    for n, llm in llms.items():
        llm.generate([PROMPT], sampling)  # compiles the shapes this prompt needs
        timers[n] = PartTimer(llm)
    plain = {n: [] for n in names}
    parts = {n: {p: [] for p in (*PARTS, "step")} for n in names}
    outside = {n: [] for n in names}
    for _ in range(args.rounds):
        for timed in (False, True):
            for n, llm in llms.items():
                timer = timers[n]
                for v in timer.times.values():
                    v.clear()
                wall, tokens = generate_round(llm, sampling, timer, timed)
                # The first step is the prompt's prefill; a multi-step call's step counts per token.
                decode = [t / k for t, k in zip(timer.times["step"][1:], timer.tokens[1:])]
                if timed:
                    per_call = statistics.median(timer.tokens[1:])  # every part per token, as the step
                    for p in PARTS:  # a multi-step call runs no separate forward or sampler
                        parts[n][p].append(statistics.median(timer.times[p][1:] or [0.0]) / per_call)
                    parts[n]["step"].append(statistics.median(decode))
                else:
                    plain[n].append((tokens / wall, statistics.median(decode), wall - sum(timer.times["step"])))
    rows = []
    for n, llm in llms.items():
        rate, step, out = (statistics.median(x) for x in zip(*plain[n]))
        a = alone(llm)
        floor_ms = 1000 * a.pop("floor bytes") / args.bandwidth
        p = {k: 1000 * statistics.median(v) for k, v in parts[n].items()}
        rest = p["step"] - sum(p[k] for k in PARTS)
        rows.append({"model": n, "tok/s": round(rate, 1), "step ms": round(1000 * step, 2),
                     **{f"{k} ms": round(p[k], 2) for k in PARTS}, "rest ms": round(rest, 2),
                     "timed step ms": round(p["step"], 2),
                     **{f"{k} ms": round(v, 2) for k, v in a.items()},
                     "outside ms/tok": round(1000 * out / args.max_tokens, 3),
                     "floor ms": round(floor_ms, 2), "x floor": round(1000 * step / floor_ms, 2)})
        outside[n] = out
    for t in timers.values():
        t.close()
    for llm in llms.values():
        with contextlib.suppress(Exception):
            llm.close()
    report(rows, args.out, title=f"batch-1 decode, {args.max_tokens} tokens, medians of {args.rounds} rounds",
           settings={k: v for k, v in settings.items()}, prompt=PROMPT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How many JSON-mode chat requests parse at a small max_tokens, with and without
`structured_outputs.close_at_limit` (the output closes within max_tokens where it can).

One `jserve serve` (the default model unless --model); the same --num-requests requests
(`response_format: json_object`, varied prompts, temperature 0.7, a seed each) run once with
the option off and once on; the table counts outputs that parse as a JSON object, the finish
reasons, the mean completion tokens, and the host time filling the masks per step (/metrics).

    python -m benchmarks.serving.json_close --out json_close.json
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

from benchmarks.harness import ServerProcess, parser, report

TOPICS = ["a person", "a book", "a city", "a recipe", "a car", "a movie", "a planet", "a company", "a song",
          "a laptop", "a weather report", "a football match", "an invoice", "a user account", "a flight"]


def parse_args(argv=None):
    p = parser(__doc__, out="bench_json_close.json")
    p.add_argument("--model", default=None, help="what `jserve serve --model` takes (default: the default model)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--serve-args", default="", help="more `jserve serve` flags")
    return p.parse_args(argv)


def ask(url: str, i: int, max_tokens: int, close: bool) -> dict:
    body = {"messages": [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as a JSON object "
                                                     f"with several fields (example {i})."}],
            "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "response_format": {"type": "json_object"},
            "structured_outputs": {"close_at_limit": close}}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    try:
        parsed = isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    except ValueError:
        parsed = False
    return {"parsed": parsed, "finish": out["choices"][0]["finish_reason"], "tokens": out["usage"]["completion_tokens"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    flags = (["--model", args.model] if args.model else []) + args.serve_args.split()
    rows = []
    with ServerProcess(flags) as server, concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for close in (False, True):
            before = server.metrics()
            runs = list(pool.map(lambda i: ask(server.url, i, args.max_tokens, close), range(args.num_requests)))
            after = server.metrics()
            steps = after["jserve_structured_mask_steps"] - before["jserve_structured_mask_steps"]
            mask_ms = 1000 * (after["jserve_structured_mask_seconds"] - before["jserve_structured_mask_seconds"])
            rows.append({"close_at_limit": close, "requests": len(runs), "parsed": sum(r["parsed"] for r in runs),
                         "stop": sum(r["finish"] == "stop" for r in runs),
                         "length": sum(r["finish"] == "length" for r in runs),
                         "mean_tokens": round(sum(r["tokens"] for r in runs) / len(runs), 1),
                         "mask_ms_per_step": round(mask_ms / max(steps, 1), 3)})
    report(rows, args.out, title=f"json_object at max_tokens {args.max_tokens}", model=args.model or "default")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Workloads of the serving benchmark: the four length patterns, their mix, a shared-system-prompt
chat workload (prefix caching) and a JSONL replay, all deterministic in a seed.

Prompts are random words from a fixed vocabulary, so input lengths are approximate (one word is
roughly one token); the server's ``usage.prompt_tokens`` gives the exact count.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Short, common English words: each is (almost always) one token with a leading space in BPE vocabularies.
_WORDS = (
    "the of and to in is for on that with as it was at by be this are from or an have not they "
    "which one you were all we her she there can has more if will would about out up what so their "
    "time some them into only other new could its then two these may first any like now my over "
    "such our man me even most made after also did many off before must well back through years "
    "much where your way down should because long each just those people how too little state good "
    "very make world still own see men work here take both between life being under never day same "
    "another know while last might us great old year come since against go came right used three "
    "small house part place case point group number home water room mother area money story fact "
    "month lot study book eye job word business issue side kind head far black long both city car "
    "game line end road tree open sea plan stone fire red blue green light night tea sun cat dog"
).split()

# (input_len, output_len) before --scale.
SHORT_IN, LONG_IN, SHORT_OUT, LONG_OUT = 32, 512, 32, 256
WORKLOADS = {
    "short-short": (SHORT_IN, SHORT_OUT),
    "short-long": (SHORT_IN, LONG_OUT),
    "long-short": (LONG_IN, SHORT_OUT),
    "long-long": (LONG_IN, LONG_OUT),
}
NAMED_WORKLOADS = (*WORKLOADS, "mix", "shared-prefix")


@dataclass
class RequestSpec:
    """One request to send: a prompt (completions) or a message list (chat), and its output length."""

    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    input_len: int  # approximate (words), the server's usage.prompt_tokens is exact
    kind: str = ""



def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def _spec(endpoint: str, prompt: str, max_tokens: int, input_len: int, kind: str,
          system: str | None = None) -> RequestSpec:
    if endpoint == "chat":
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return RequestSpec(None, messages, max_tokens, input_len, kind)
    full = f"{system}\n\n{prompt}" if system else prompt
    return RequestSpec(full, None, max_tokens, input_len, kind)


def build_workload(workload: str, num_requests: int | None, endpoint: str, scale: float,
                   seed: int) -> list[RequestSpec]:
    """The requests of a named workload or a JSONL file, deterministic in ``seed``."""
    rng = random.Random(seed)
    if workload in WORKLOADS or workload == "mix":
        n = num_requests or 64
        kinds = list(WORKLOADS) if workload == "mix" else [workload]
        order = [kinds[i % len(kinds)] for i in range(n)]
        rng.shuffle(order)
        specs = []
        for kind in order:
            in_len, out_len = (_scaled(x, scale) for x in WORKLOADS[kind])
            specs.append(_spec(endpoint, _words(rng, in_len), out_len, in_len, kind))
        return specs
    if workload == "shared-prefix":
        n = num_requests or 64
        sys_len, q_len, out_len = _scaled(LONG_IN, scale), _scaled(SHORT_IN, scale), _scaled(SHORT_OUT, scale)
        system = "You are a helpful assistant. " + _words(rng, sys_len)
        return [_spec(endpoint, _words(rng, q_len), out_len, sys_len + q_len, "shared-prefix", system=system)
                for _ in range(n)]
    path = Path(workload)
    if not path.is_file():
        raise ValueError(f"--workload: {workload!r} is neither one of {', '.join(NAMED_WORKLOADS)} nor a file")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"--workload: {path} has no records")
    n = num_requests or len(records)
    specs = []
    for i in range(n):  # cycle through the file when more requests are asked for than it holds
        rec = records[i % len(records)]
        if "prompt" in rec or "messages" in rec:
            max_tokens = int(rec.get("max_tokens", rec.get("output_len", SHORT_OUT)))
            if "messages" in rec:
                msgs = rec["messages"]
                specs.append(RequestSpec(None if endpoint == "chat" else "\n".join(m["content"] for m in msgs),
                                         msgs if endpoint == "chat" else None, max_tokens,
                                         sum(len(m["content"].split()) for m in msgs), "file"))
            else:
                specs.append(_spec(endpoint, rec["prompt"], max_tokens, len(rec["prompt"].split()), "file"))
        elif "input_len" in rec:
            in_len, out_len = int(rec["input_len"]), int(rec.get("output_len", rec.get("max_tokens", SHORT_OUT)))
            specs.append(_spec(endpoint, _words(rng, in_len), out_len, in_len, "file"))
        else:
            raise ValueError(f"{path}:{i % len(records) + 1}: need 'prompt' (+ 'max_tokens') or "
                             f"'input_len' (+ 'output_len')")
    return specs


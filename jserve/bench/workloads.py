"""Workloads of the serving benchmark: the four length patterns, their mix, a shared-system-prompt
chat workload (prefix caching), a multi-turn chat workload (a growing history: the host KV tier),
an input-copying workload (speculative decoding) and a JSONL replay, all deterministic in a seed.

Prompts are random words from a fixed vocabulary (``copy``: English sentences), so input lengths
are approximate (one word is roughly one token); the server's ``usage.prompt_tokens`` gives the
exact count.
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
NAMED_WORKLOADS = (*WORKLOADS, "mix", "shared-prefix", "multi-turn", "copy")
MULTI_TURN_CHATS = 8  # the multi-turn workload's conversations, their turns sent turn by turn

# The copy workload: a passage of these sentences (a seeded selection) that the request asks to be
# repeated ("copy") or returned with its typos fixed ("edit"), so the output repeats the prompt.
_SENTENCES = (
    "The library opens at nine in the morning and closes at six in the evening on weekdays.",
    "Every spring the river floods the low fields, and the farmers move their sheep to the hills.",
    "She packed a small bag with two shirts, a book of poems and a bottle of water.",
    "The old bridge was built of stone more than three hundred years ago.",
    "When the train stopped at the station, a young man with a red scarf stepped onto the platform.",
    "Our team meets every Monday to review the open issues and plan the work for the week.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and a glass of warm milk.",
    "After the storm, the streets were covered with leaves and broken branches.",
    "The museum has a large collection of maps, coins and letters from the early settlers.",
    "He wrote a short note to his neighbour and left it under the door.",
    "Please make sure that all windows are closed before you leave the building.",
    "The garden behind the house is full of roses, tomatoes and tall sunflowers.",
    "In the evening the children played football in the park until it was too dark to see the ball.",
    "The company will release a new version of the software at the end of the month.",
    "A cold wind blew from the north, and the sky turned grey over the mountains.",
    "The teacher asked the students to read the first chapter and write a summary of it.",
    "Fresh bread, cheese and fruit are sold at the market in the main square every Saturday.",
    "The doctor told him to drink more water and to walk for half an hour every day.",
    "Our flight was delayed by two hours because of the heavy fog at the airport.",
    "The small boat sailed slowly along the coast, past the lighthouse and the white cliffs.",
    "If you have any questions about your order, please contact our support team by email.",
    "The city council decided to plant a thousand new trees along the main roads.",
    "My grandmother kept all her old photographs in a wooden box under the bed.",
    "The concert was so popular that the tickets were sold out within an hour.",
    "Before the meeting, please read the report and bring your notes with you.",
    "The new road through the valley will shorten the journey to the coast by an hour.",
    "Most of the birds leave the island in autumn and return in the first weeks of spring.",
    "The kitchen was warm and smelled of coffee, fresh bread and apples.",
    "Our neighbours are painting their house blue and planting a hedge along the fence.",
    "The hotel offers free breakfast, a small pool and bicycles for its guests.",
    "Three students from our school won prizes in the national science competition.",
    "The lights in the old theatre went out, and the audience waited in silence.",
)
COPY_OUT = 192  # output tokens before --scale; the passage is slightly longer
_TOKENS_PER_WORD = 1.1  # SmolLM2's tokenizer on _SENTENCES
_COPY_CHAT = {"copy": "Repeat the following text exactly:\n\n{text}",
              "edit": "Fix the typos in the following text and return the full corrected text:\n\n{text}"}
# Completions: a document whose second copy has begun (its first words), which the model continues.
_COPY_DOC = {"copy": "Original:\n{text}\n\nExact copy:\n{head}",
             "edit": "Draft (with typos):\n{text}\n\nFinal version (typos fixed):\n{head}"}
_HEAD_WORDS = 4


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


def _multi_turn(rng: random.Random, n: int, endpoint: str, scale: float) -> list[RequestSpec]:
    """Chats over one shared system prompt, each turn's prompt its whole history (earlier user
    messages and answers, written here: a later turn's prefix is the turn before's prompt) and a
    new message; all chats' turn 1, then their turn 2, ..."""
    chats = min(MULTI_TURN_CHATS, n)
    system = "You are a helpful assistant. " + _words(rng, _scaled(LONG_IN, scale))
    user_len, answer_len, out_len = (_scaled(x, scale) for x in (SHORT_IN, 2 * SHORT_IN, SHORT_OUT))
    history: list[list[dict]] = [[{"role": "system", "content": system}] for _ in range(chats)]
    specs = []
    for i in range(n):
        messages = history[i % chats]
        messages.append({"role": "user", "content": _words(rng, user_len)})
        words = sum(len(m["content"].split()) for m in messages)
        if endpoint == "chat":
            specs.append(RequestSpec(None, [dict(m) for m in messages], out_len, words, "multi-turn"))
        else:
            specs.append(RequestSpec("\n\n".join(m["content"] for m in messages), None, out_len, words, "multi-turn"))
        messages.append({"role": "assistant", "content": _words(rng, answer_len)})
    return specs


def _passage(rng: random.Random, n_tokens: int) -> str:
    """Sentences in a seeded order (a new order after each pass) until about ``n_tokens`` tokens."""
    out: list[str] = []
    pool: list[str] = []
    words = 0
    while words * _TOKENS_PER_WORD < n_tokens:
        if not pool:
            pool = rng.sample(_SENTENCES, len(_SENTENCES))
        out.append(pool.pop())
        words += len(out[-1].split())
    return " ".join(out)


def _with_typos(rng: random.Random, text: str, n: int) -> str:
    """``text`` with two inner letters swapped in ``n`` words of six letters or more, past the first
    ``_HEAD_WORDS`` (the completions prompt repeats those)."""
    words = text.split(" ")
    long = [i for i, w in enumerate(words) if i >= _HEAD_WORDS and w.isalpha() and len(w) >= 6]
    for i in rng.sample(long, min(n, len(long))):
        w = words[i]
        j = rng.choice([k for k in range(1, len(w) - 2) if w[k] != w[k + 1]])
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def _copy_spec(rng: random.Random, endpoint: str, kind: str, out_len: int) -> RequestSpec:
    passage = _passage(rng, out_len + 16)
    text = _with_typos(rng, passage, max(1, out_len // 64)) if kind == "edit" else passage
    if endpoint == "chat":
        prompt = _COPY_CHAT[kind].format(text=text)
    else:
        prompt = _COPY_DOC[kind].format(text=text, head=" ".join(passage.split(" ")[:_HEAD_WORDS]))
    return _spec(endpoint, prompt, out_len, len(prompt.split()), kind)


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
    if workload == "multi-turn":
        return _multi_turn(rng, num_requests or 64, endpoint, scale)
    if workload == "copy":
        order = [("copy", "edit")[i % 2] for i in range(num_requests or 64)]
        rng.shuffle(order)
        return [_copy_spec(rng, endpoint, kind, _scaled(COPY_OUT, scale)) for kind in order]
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


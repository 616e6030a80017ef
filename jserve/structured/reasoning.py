"""A reasoning model's thoughts out of its text: `<think>` ... `</think>`, whole and streamed.

For `--reasoning-parser` (vLLM's names): the text before the end tag is the reasoning, the text
after it the content; a start tag before the end tag is dropped (older Qwen3 templates let the
model write it, newer ones and DeepSeek-R1's put it in the prompt). Without an end tag the whole
text is reasoning (the output stopped while thinking). The tags go in neither part.

Thinking is off, so everything is content, where the prompt already closed the block (it ends
with the end tag: an `enable_thinking: false` template's empty block) and, for `qwen3`, where the
request's `chat_template_kwargs` set `enable_thinking` false (vLLM's rule). With an output
constraint, `wrap_grammar` lets the thinking run free and applies the constraint after the end tag.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """Splits a choice's text into (reasoning, content); `thinking` False: all of it is content."""

    start: str = START
    end: str = END
    thinking: bool = True

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole text; None where a part is empty."""
        if not self.thinking:
            return None, text or None
        reasoning, tag, content = text.partition(self.end)
        i = reasoning.find(self.start)
        if i >= 0:
            reasoning = reasoning[:i] + reasoning[i + len(self.start):]
        return reasoning or None, (content or None) if tag else None

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class ReasoningStream:
    """One choice's text as it arrives: `feed` each piece, then `finish`; each returns the
    (reasoning, content) it lets out. A piece that may begin a tag is held back until the next,
    so the parts streamed concatenate to `ReasoningParser.parse`'s for any split of the text."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self._held = ""
        self._started = False  # the start tag was taken out (or can no longer be)
        self._ended = not parser.thinking  # past the end tag: content from here on

    def feed(self, piece: str) -> tuple[str, str]:
        if self._ended:
            return "", piece
        p = self.parser
        text = self._held + piece
        j = text.find(p.end)
        if j >= 0:
            self._held, self._ended = "", True
            return self._drop_start(text[:j]), text[j + len(p.end):]
        tags = (p.end,) if self._started else (p.start, p.end)
        keep = max((k for tag in tags for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)
        self._held = text[len(text) - keep:]
        return self._drop_start(text[:len(text) - keep]), ""

    def _drop_start(self, reasoning: str) -> str:
        """The first start tag out of the reasoning (a held piece never holds a whole tag)."""
        i = -1 if self._started else reasoning.find(self.parser.start)
        if i < 0:
            return reasoning
        self._started = True
        return reasoning[:i] + reasoning[i + len(self.parser.start):]

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning (the output ended before any end tag)."""
        held, self._held = self._held, ""
        return self._drop_start(held), ""


def get_parser(name: str, chat_template_kwargs: dict | None = None, prompt: str | None = None) -> ReasoningParser:
    """The parser `name` for one request: its template kwargs and rendered prompt say whether it
    thinks at all. ValueError naming an unknown name."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: choose one of {', '.join(REASONING_PARSERS)}")
    kwargs = chat_template_kwargs or {}
    off = name == "qwen3" and kwargs.get("enable_thinking", True) is False
    return ReasoningParser(thinking=not off and not prompt_closes_thinking(prompt or ""))


def prompt_closes_thinking(prompt: str, end: str = END) -> bool:
    """The generation prompt ends with a closed thinking block (only whitespace after the end tag)."""
    return prompt.rstrip().endswith(end)


def check_tokenizer(name: str, encode: Callable[[str], list[int]]) -> None:
    """ValueError unless the tokenizer writes each tag as one token (as the models' own do)."""
    for tag in (START, END):
        ids = encode(tag)
        if len(ids) != 1:
            raise ValueError(f"--reasoning-parser {name}: this tokenizer has no {tag} token (it encodes it as "
                             f"{len(ids)} tokens), so the model does not write that format")


def wrap_grammar(grammar: str, start_id: int, end_id: int) -> str:
    """An llguidance grammar (JSON text, or a Lark grammar's text) that allows thinking before
    `grammar`'s text: an optional start token, free text holding neither tag, the end token, then
    `grammar`."""
    try:
        inner: Any = json.loads(grammar)
    except ValueError:
        inner = {"grammars": [{"lark_grammar": grammar}]}
    subs = [dict(g) for g in inner["grammars"]]
    subs[0]["name"] = body = subs[0].get("name") or "constraint"
    lark = (f"start: <[{start_id}]>? THOUGHT <[{end_id}]> @{body}\n"
            f"THOUGHT: /(.|\\n)*/ & ~/(.|\\n)*({_lark_re(START)}|{_lark_re(END)})(.|\\n)*/\n")
    return json.dumps({**inner, "grammars": [{"lark_grammar": lark}, *subs]})


def _lark_re(text: str) -> str:
    return "".join("\\" + c if c in "/\\.^$|?*+()[]{}" else c for c in text)

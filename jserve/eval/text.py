"""The evaluation text: English prose extracted from the standard library's `pydoc_data/topics.py`.

`pydoc_prose` says how the prose is extracted (deterministically, from `pydoc_data.topics`).
The text depends on the Python version (topics.py is regenerated for each release): reports carry
its sha256 and the version, and compare only measurements made on the same text. With CPython
3.13.0 the default is 160,073 characters, 35,605 tokens with SmolLM2's tokenizer.
`write_text` writes it to a file, so another tool (llama.cpp's `llama-perplexity -f`) reads the
identical bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
from pathlib import Path

DEFAULT_MAX_CHARS = 160_000
MIN_WORDS = 8
_UNDERLINE = re.compile(r"[*=\-~^]{3,}")


@dataclasses.dataclass(frozen=True)
class EvalText:
    """A text and where it came from."""

    text: str
    source: str  # "pydoc_data.topics (Python 3.13.0, 160000 chars)" or the file's path

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def describe(self) -> dict:
        return {"source": self.source, "sha256": self.sha256, "chars": len(self.text)}


def _prose_paragraphs(topic: str) -> list[str]:
    out = []
    for para in re.split(r"\n[ \t]*\n", topic):
        lines = [line for line in para.split("\n") if line.strip()]
        if not lines or any(line[0].isspace() for line in lines):
            continue
        if any(_UNDERLINE.fullmatch(line.strip()) for line in lines):
            continue
        words = para.split()
        if len(words) < MIN_WORDS:
            continue
        out.append(" ".join(words))
    return out


def pydoc_prose(max_chars: int | None = DEFAULT_MAX_CHARS) -> str:
    """The default evaluation text; `max_chars` None: all of it.

    Every CPython ships `pydoc_data.topics.topics`, a dict from help-topic names to reStructuredText
    rendered as plain text. The extraction (`pydoc_prose`) is deterministic:

    1. the topics' values in sorted key order;
    2. each value split into paragraphs at blank lines;
    3. a paragraph is kept when none of its lines is indented (indented blocks are code, grammar
       productions and tables), it is not a heading (a line underlined with `*`, `=`, `-`, `~` or `^`),
       and it has at least 8 words;
    4. each kept paragraph's whitespace collapsed to single spaces, paragraphs joined by a blank line;
    5. paragraphs taken in order until the text reaches `DEFAULT_MAX_CHARS` characters (the paragraph
       that crosses the limit is kept whole).
    """
    from pydoc_data.topics import topics

    paragraphs: list[str] = []
    total = 0
    for key in sorted(topics):
        for para in _prose_paragraphs(topics[key]):
            if max_chars is not None and total >= max_chars:
                return "\n\n".join(paragraphs) + "\n"
            paragraphs.append(para)
            total += len(para) + 2
    return "\n\n".join(paragraphs) + "\n"


def default_text(max_chars: int | None = DEFAULT_MAX_CHARS) -> EvalText:
    version = ".".join(map(str, sys.version_info[:3]))
    limit = "all" if max_chars is None else f"{max_chars} chars"
    return EvalText(pydoc_prose(max_chars), f"pydoc_data.topics prose (Python {version}, {limit})")


def load_text(path: str | Path | None = None) -> EvalText:
    """The text in a UTF-8 file, or the default text when `path` is None."""
    if path is None:
        return default_text()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8: {e}") from None
    if not text.strip():
        raise ValueError(f"{p} is empty")
    return EvalText(text, str(p))


def write_text(path: str | Path, text: EvalText | None = None) -> EvalText:
    """Write `text` (default: the default text) to `path` as UTF-8, byte for byte, and return it."""
    text = text or default_text()
    Path(path).write_bytes(text.text.encode("utf-8"))
    return text

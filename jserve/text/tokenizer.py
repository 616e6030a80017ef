"""Text <-> token ids for the engine: one `Tokenizer` over three sources.

Backends: a Hugging Face `tokenizer.json` (run by the `tokenizers` library), a sentencepiece
`.model`, or the vocabulary embedded in a GGUF file (rebuilt as one of the two by
`jserve.text.tokenizer_gguf`). The special ids, BOS policy and chat template live on `Tokenizer`;
`save()` writes a self-contained folder that `load()` reads back.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jserve.text.chat_template import render_chat_template
from jserve.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

JSERVE_CONFIG = "jserve_tokenizer.json"
_HF, _SPM = "hf", "sentencepiece"
_FILES = {_HF: "tokenizer.json", _SPM: "tokenizer.model"}


class _HFBackend:
    """A `tokenizers.Tokenizer`: added tokens written in the text are matched by the library."""

    kind = _HF

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_file(cls, path: Path) -> "_HFBackend":
        import tokenizers
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @classmethod
    def from_str(cls, text: str) -> "_HFBackend":
        import tokenizers
        return cls(tokenizers.Tokenizer.from_str(text))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def piece_to_id(self, piece: str) -> int | None:
        return self.tokenizer.token_to_id(piece)

    def post_processor_adds_bos(self, bos_token_id: int) -> bool:
        with_special = self.tokenizer.encode("a", add_special_tokens=True).ids
        return with_special[:1] == [bos_token_id] and len(with_special) > len(self.encode("a"))

    def save(self, path: Path) -> None:
        self.tokenizer.save(str(path))


class _SPMBackend:
    """A sentencepiece model; control/unknown pieces written in the text are split out first.

    Each text run between special pieces is encoded on its own, so sentencepiece's dummy-prefix
    space is added after every special piece, as llama.cpp and transformers' slow tokenizer do.
    """

    kind = _SPM

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece
        self.model_proto = model_proto
        self.sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self.sp.get_piece_size()
        self.special_ids = frozenset(i for i in range(self.vocab_size)
                                     if (self.sp.is_control(i) or self.sp.is_unknown(i)) and self.sp.id_to_piece(i))
        self._special_by_piece = {self.sp.id_to_piece(i): i for i in sorted(self.special_ids)}
        pieces = sorted(self._special_by_piece, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, pieces)) + ")") if pieces else None

    @classmethod
    def from_file(cls, path: Path) -> "_SPMBackend":
        return cls(path.read_bytes())

    def encode(self, text: str) -> list[int]:
        parts = self._special_re.split(text) if self._special_re else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:  # re.split puts the captured special pieces at odd positions
                ids.append(self._special_by_piece[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        out: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in self.special_ids:
                out.append(self.sp.decode(run))
                run = []
                if not skip_special_tokens:
                    out.append(self.sp.id_to_piece(token_id))
            else:
                run.append(token_id)
        out.append(self.sp.decode(run))
        return "".join(out)

    def id_to_piece(self, token_id: int) -> str | None:
        return self.sp.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else None

    def piece_to_id(self, piece: str) -> int | None:
        token_id = self.sp.piece_to_id(piece)
        return None if token_id == self.sp.unk_id() and piece != self.sp.id_to_piece(token_id) else token_id

    def save(self, path: Path) -> None:
        path.write_bytes(self.model_proto)


_Backend = _HFBackend | _SPMBackend


class Tokenizer:
    """Encodes text, decodes ids, renders chat templates and streams detokenized text.

    Attributes:
      vocab_size: number of ids, added and special tokens included.
      bos_token_id, pad_token_id, unk_token_id: special ids, or None.
      eos_token_ids: every id that ends generation; the tokenizer's own EOS first.
      add_bos: whether encode(..., add_special_tokens=True) prepends BOS.
      chat_template: jinja2 chat template, or None.
      kind: "hf" (tokenizer.json) or "sentencepiece" (tokenizer.model).
    """

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 pad_token_id: int | None = None, unk_token_id: int | None = None, add_bos: bool = False,
                 chat_template: str | None = None) -> None:
        self._backend = backend
        self.kind: str = backend.kind
        self.vocab_size: int = backend.vocab_size
        for name, value in (("bos_token_id", bos_token_id), ("pad_token_id", pad_token_id),
                            ("unk_token_id", unk_token_id), *(("eos_token_ids", e) for e in eos_token_ids)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")
        if add_bos and bos_token_id is None:
            raise ValueError("add_bos=True needs a bos_token_id")
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special_token_ids: frozenset[int] = backend.special_ids

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={self.eos_token_ids}, add_bos={self.add_bos})")

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in it become their single ids.

        With add_special_tokens, BOS is prepended when `add_bos` is set.
        """
        ids = self._backend.encode(text)
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text for `ids`. Ids at or past `vocab_size` (a model's padded vocabulary) decode to ""."""
        ids = [int(i) for i in ids]
        if ids and min(ids) < 0:
            raise ValueError(f"negative token id {min(ids)} in decode()")
        return self._backend.decode([i for i in ids if i < self.vocab_size], skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level / '▁' form), or None if there is none."""
        return self._backend.id_to_piece(int(token_id))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.id_to_piece(i) for i in ids]

    def piece_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary string, or None."""
        return self._backend.piece_to_id(piece)

    def detokenizer(self, prompt_ids: Sequence[int] = (), *,
                    skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A streaming detokenizer for text generated after `prompt_ids`."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **extra: Any) -> str:
        """Renders `messages` with the chat template as transformers does (see jserve.text.chat_template).

        `bos_token`, `eos_token`, `unk_token` and `pad_token` are template variables; `extra`
        (tools, documents, custom flags) is passed to the template too.
        """
        special = {name: self.id_to_piece(token_id) for name, token_id in (
            ("bos_token", self.bos_token_id), ("eos_token", self.eos_token_ids[0] if self.eos_token_ids else None),
            ("unk_token", self.unk_token_id), ("pad_token", self.pad_token_id)) if token_id is not None}
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, special_tokens=special, **extra)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **extra: Any) -> list[int]:
        """Prompt ids for a conversation: the rendered template, encoded without adding BOS."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, **extra)
        return self.encode(text, add_special_tokens=False)

    # -- files ----------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Writes tokenizer.json or tokenizer.model plus jserve_tokenizer.json into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(directory / _FILES[self.kind])
        config = {"kind": self.kind, "bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids),
                  "pad_token_id": self.pad_token_id, "unk_token_id": self.unk_token_id, "add_bos": self.add_bos,
                  "chat_template": self.chat_template}
        (directory / JSERVE_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        """Reads a folder written by save(), or a Hugging Face model folder.

        A Hugging Face folder needs tokenizer.json (preferred) or tokenizer.model; special tokens,
        add_bos_token and the chat template come from tokenizer_config.json, special_tokens_map.json,
        chat_template.jinja / chat_template.json and generation_config.json when present.
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"tokenizer directory {str(directory)!r} does not exist")
        if (directory / JSERVE_CONFIG).is_file():
            config = json.loads((directory / JSERVE_CONFIG).read_text())
            kind = config.get("kind")
            if kind not in _FILES:
                raise ValueError(f"{directory / JSERVE_CONFIG}: unknown tokenizer kind {kind!r}")
            backend_cls = _HFBackend if kind == _HF else _SPMBackend
            return cls(backend_cls.from_file(directory / _FILES[kind]), bos_token_id=config.get("bos_token_id"),
                       eos_token_ids=config.get("eos_token_ids", []), pad_token_id=config.get("pad_token_id"),
                       unk_token_id=config.get("unk_token_id"), add_bos=bool(config.get("add_bos")),
                       chat_template=config.get("chat_template"))
        return _load_hf_folder(cls, directory)

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> "Tokenizer":
        """Rebuilds the tokenizer stored in a GGUF file (a path or a `gguf.GGUFReader`).

        Supports tokenizer.ggml.model "gpt2" (byte-level BPE; see tokenizer_gguf.PRE_TOKENIZERS for
        the pre-tokenizer names) and "llama" (sentencepiece BPE with byte fallback; Gemma's, with
        its whitespace-run pieces, as Hugging Face's tokenizer.json: tokenizer_gguf.spm_bpe_tokenizer_json).
        """
        from jserve.text import tokenizer_gguf as gguf_text

        meta = gguf_text.read_gguf_metadata(path_or_reader)
        model = meta.get("tokenizer.ggml.model")
        if model == "gpt2":
            text, default_add_bos = gguf_text.bpe_tokenizer_json(meta)
            backend: _Backend = _HFBackend.from_str(text)
        elif model == "llama" and gguf_text.has_spaced_pieces(meta):
            backend, default_add_bos = _HFBackend.from_str(gguf_text.spm_bpe_tokenizer_json(meta)), True
        elif model == "llama":
            backend, default_add_bos = _SPMBackend(gguf_text.spm_model_proto(meta)), True
        else:
            raise ValueError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r} "
                             "(supported: 'gpt2', 'llama')")
        ids = {key: meta.get(f"tokenizer.ggml.{key}_token_id") for key in
               ("bos", "eos", "eot", "eom", "padding", "unknown")}
        ids = {key: (int(v) if v is not None and 0 <= int(v) < backend.vocab_size else None) for key, v in ids.items()}
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)) and ids["bos"] is not None
        eos = [ids[key] for key in ("eos", "eot", "eom") if ids[key] is not None]
        return cls(backend, bos_token_id=ids["bos"], eos_token_ids=eos, pad_token_id=ids["padding"],
                   unk_token_id=ids["unknown"], add_bos=add_bos, chat_template=meta.get("tokenizer.chat_template"))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value: Any) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default", next(iter(named.values()), None))
    return value if isinstance(value, str) else None


def _load_hf_folder(cls: type[Tokenizer], directory: Path) -> Tokenizer:
    if (directory / "tokenizer.json").is_file():
        backend: _Backend = _HFBackend.from_file(directory / "tokenizer.json")
    elif (directory / "tokenizer.model").is_file():
        backend = _SPMBackend.from_file(directory / "tokenizer.model")
    else:
        raise ValueError(f"{str(directory)!r} has no tokenizer.json, tokenizer.model or {JSERVE_CONFIG}")
    config = _read_json(directory / "tokenizer_config.json")
    special_map = _read_json(directory / "special_tokens_map.json")
    generation = _read_json(directory / "generation_config.json")

    def special_id(name: str, generation_key: str) -> int | None:
        for source in (config, special_map):
            if name in source:  # an explicit null (e.g. Qwen2's bos_token) means "none"
                content = _token_content(source[name])
                token_id = backend.piece_to_id(content) if content is not None else None
                if content is not None and token_id is None:
                    logger.warning("%s %r from %s is not in the vocabulary", name, content, directory)
                return token_id
        if isinstance(backend, _SPMBackend) and not config and not special_map:
            default = {"bos_token": backend.sp.bos_id(), "eos_token": backend.sp.eos_id(),
                       "pad_token": backend.sp.pad_id(), "unk_token": backend.sp.unk_id()}[name]
            return default if default >= 0 else None
        value = generation.get(generation_key)
        return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None

    bos = special_id("bos_token", "bos_token_id")
    eos = special_id("eos_token", "eos_token_id")
    generation_eos = generation.get("eos_token_id", [])
    eos_ids = ([eos] if eos is not None else []) + (
        list(generation_eos) if isinstance(generation_eos, list) else [generation_eos])
    if "add_bos_token" in config:
        add_bos = bool(config["add_bos_token"])
    elif isinstance(backend, _HFBackend):
        add_bos = bos is not None and backend.post_processor_adds_bos(bos)
    else:
        add_bos = True  # transformers' LlamaTokenizer default for sentencepiece models
    template_file = directory / "chat_template.jinja"
    chat_template = (template_file.read_text(encoding="utf-8") if template_file.is_file() else
                     _pick_chat_template(_read_json(directory / "chat_template.json").get("chat_template"))
                     or _pick_chat_template(config.get("chat_template")))
    return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids, pad_token_id=special_id("pad_token", "pad_token_id"),
               unk_token_id=special_id("unk_token", "unk_token_id"), add_bos=add_bos and bos is not None,
               chat_template=chat_template)

"""Rebuild the tokenizer embedded in a GGUF file's metadata.

GPT-2-style byte-level BPE vocabularies become a Hugging Face ``tokenizer.json`` (string) and
llama/SPM vocabularies become a sentencepiece ``ModelProto`` (bytes), except Gemma's, whose
whitespace-run pieces llama.cpp writes with literal spaces: it becomes a ``tokenizer.json`` as Hugging
Face publishes Gemma's (`spm_bpe_tokenizer_json`). `jserve.text.tokenizer` loads all of them.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# GGUF metadata value types (gguf.GGUFValueType).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

# llama.cpp token types (tokenizer.ggml.token_type), the same numbers as sentencepiece's piece types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True}
_SPLIT_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                     "use_regex": False}
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


@dataclass(frozen=True)
class _PreTokenizer:
    """What the original Hugging Face tokenizer.json did for one llama.cpp `tokenizer.ggml.pre` name."""

    pre_tokenizer: dict[str, Any]
    normalizer: dict[str, Any] | None = None
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_GPT2 = _PreTokenizer(_GPT2_BYTE_LEVEL)
_STARCODER = _PreTokenizer({"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True}, _GPT2_BYTE_LEVEL]})
_LLAMA3 = _PreTokenizer({"type": "Sequence", "pretokenizers": [_split(_LLAMA3_REGEX), _SPLIT_BYTE_LEVEL]},
                        ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizer({"type": "Sequence", "pretokenizers": [_split(_QWEN2_REGEX), _SPLIT_BYTE_LEVEL]},
                       normalizer={"type": "NFC"})
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "gpt-2": _GPT2, "smollm": _STARCODER, "starcoder": _STARCODER, "refact": _STARCODER,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "qwen2": _QWEN2,
}


def read_gguf_metadata(path_or_reader: Any, prefix: str = "tokenizer.") -> dict[str, Any]:
    """Returns the GGUF metadata whose keys start with `prefix`, as Python values.

    Args:
      path_or_reader: a GGUF file path, or an open `gguf.GGUFReader`.
      prefix: keep only keys starting with this.
    Returns:
      key -> str | int | float | bool | list[str] | numpy array (numeric arrays).
    """
    if isinstance(path_or_reader, (str, Path)):
        return read_gguf_kv(Path(path_or_reader), prefix)[0]
    fields = getattr(path_or_reader, "fields", None)
    if fields is None:
        raise ValueError(f"expected a GGUF path or gguf.GGUFReader, got {type(path_or_reader).__name__}")
    out: dict[str, Any] = {}
    for key, field in fields.items():
        if key.startswith(prefix):
            value = field.contents()
            if isinstance(value, list) and value and not isinstance(value[0], str):
                value = np.asarray(value)
            out[key] = value
    return out


def read_gguf_kv(path: Path, prefix: str = "") -> tuple[dict[str, Any], int, int]:
    """A GGUF file's metadata whose keys start with `prefix` (as `read_gguf_metadata`), its tensor
    count, and the offset where its tensor infos start (`jserve.model.gguf_file` reads those).

    gguf.GGUFReader slices a memmap once per string (tens of seconds for Gemma's 262144-token
    vocabulary on a busy 2-core machine); the header holds plain length-prefixed records, so it
    is parsed directly."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<4sI", buf, 0)
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (magic {magic!r})")
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian files are not supported)")
        num_tensors, num_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24

        def read_str(pos: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, pos)
            return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n

        def read_value(vtype: int, pos: int) -> tuple[Any, int]:
            if vtype == _STRING:
                return read_str(pos)
            if vtype == _ARRAY:
                item_type, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if item_type in _NUMPY_DTYPES:
                    dtype = np.dtype(_NUMPY_DTYPES[item_type])
                    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy()
                    return (arr.astype(bool) if item_type == 7 else arr), pos + count * dtype.itemsize
                items = []
                for _ in range(count):
                    item, pos = read_value(item_type, pos)
                    items.append(item)
                return items, pos
            if vtype not in _SCALAR_FORMATS:
                raise ValueError(f"{path}: unknown GGUF value type {vtype}")
            (value,) = struct.unpack_from(_SCALAR_FORMATS[vtype], buf, pos)
            return value, pos + struct.calcsize(_SCALAR_FORMATS[vtype])

        out: dict[str, Any] = {}
        for _ in range(num_kv):
            key, pos = read_str(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            value, pos = read_value(vtype, pos + 4)
            if key.startswith(prefix):
                out[key] = value
        return out, num_tensors, pos


def _token_types(meta: dict[str, Any], num_tokens: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * num_tokens
    types = [int(t) for t in types]
    if len(types) != num_tokens:
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {num_tokens} tokens")
    return types


def _scores(meta: dict[str, Any], num_tokens: int) -> np.ndarray:
    scores = meta.get("tokenizer.ggml.scores")
    scores = np.zeros(num_tokens, np.float32) if scores is None else np.asarray(scores, np.float32)
    if len(scores) != num_tokens:
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {num_tokens} tokens")
    return scores


def _first_ids(tokens: list[str]) -> dict[str, int]:
    """Each token string's id; a duplicate string keeps its first id, as llama.cpp does."""
    ids: dict[str, int] = {}
    for i, token in enumerate(tokens):
        ids.setdefault(token, i)
    if len(ids) != len(tokens):
        logger.warning("GGUF vocabulary has %d duplicate token strings", len(tokens) - len(ids))
    return ids


def bpe_tokenizer_json(meta: dict[str, Any]) -> tuple[str, bool]:
    """Builds a Hugging Face tokenizer.json for a `tokenizer.ggml.model == "gpt2"` vocabulary.

    Returns:
      (tokenizer.json text, llama.cpp's default for add_bos when the GGUF does not say).
    Raises:
      ValueError: for a pre-tokenizer name (tokenizer.ggml.pre) this module does not know.
    """
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ValueError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre_name!r}; "
                         f"supported: {sorted(PRE_TOKENIZERS)}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = _token_types(meta, len(tokens))
    vocab = _first_ids(tokens)
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == CONTROL}
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    merges = list(meta.get("tokenizer.ggml.merges", []))
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": pre.normalizer, "pre_tokenizer": pre.pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre.ignore_merges, "vocab": vocab, "merges": merges},
    }
    return json.dumps(tokenizer, ensure_ascii=False), pre.add_bos


def spm_model_proto(meta: dict[str, Any]) -> bytes:
    """Builds a serialized sentencepiece ModelProto for a `tokenizer.ggml.model == "llama"` vocabulary.

    llama.cpp runs these as SPM BPE (merge order = piece score) with byte fallback; this is the
    same model sentencepiece itself runs, so the ids agree with the original `.model` file.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb  # heavy protobuf import, only when needed

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = _token_types(meta, len(tokens))
    scores = _scores(meta, len(tokens))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if UNKNOWN not in types:  # sentencepiece refuses a model without an unknown piece
        if unk_id is None or not 0 <= unk_id < len(tokens):
            raise ValueError("GGUF llama vocabulary has no unknown token (no token_type 2, no unknown_token_id)")
        types[unk_id] = UNKNOWN
    model = pb.ModelProto()
    spec = model.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = BYTE in types
    spec.unk_id = types.index(UNKNOWN)
    for name, key in (("bos_id", "bos"), ("eos_id", "eos"), ("pad_id", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        setattr(spec, name, -1 if token_id is None else int(token_id))
    norm = model.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    for token, score, token_type in zip(tokens, scores, types):
        piece = model.pieces.add()
        piece.piece = token
        piece.score = float(score)
        piece.type = token_type if token_type in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
    return model.SerializeToString()


def has_spaced_pieces(meta: dict[str, Any]) -> bool:
    """Whether a "llama" vocabulary has user-defined pieces made of spaces (Gemma's whitespace runs).

    llama.cpp's converter writes user-defined pieces with literal spaces where sentencepiece keeps
    "▁", and sentencepiece matches them only after turning spaces into "▁": rebuilt into a
    ModelProto as they are, they never match, and a run of spaces becomes one token per space.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    types = _token_types(meta, len(tokens))
    return any(t == USER_DEFINED and token and not token.strip(" ") for token, t in zip(tokens, types))


def _derived_merges(vocab: dict[str, int], scores: list[float]) -> list[list[str]]:
    """BPE merges for a vocabulary stored without them, as transformers derives them for Gemma:
    every split of a piece into two pieces, ranked by the piece's id (Gemma's ids follow its merge
    order, where its user-defined pieces' scores are -1000 placeholders), then by the halves' scores."""
    merges: list[list[str]] = []
    for token in vocab:  # in id order, as built
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        if len(splits) > 1:
            splits.sort(key=lambda s: (scores[vocab[s[0]]], scores[vocab[s[1]]]), reverse=True)
        merges.extend([a, b] for a, b in splits)
    return merges


def spm_bpe_tokenizer_json(meta: dict[str, Any]) -> str:
    """Builds a Hugging Face tokenizer.json for a "llama" vocabulary with spaced pieces (Gemma's).

    As Gemma's published tokenizer.json runs it: spaces become "▁" and the text runs through a
    BPE with byte fallback, whose merges `_derived_merges` rebuilds. User-defined pieces are added
    tokens matched whole in the raw text first (newline and tab runs, HTML tags), control pieces too
    (special); a whitespace-run piece, spelled with "▁" again as there, never matches raw text, so
    the BPE reaches it by merges, and a run longer than the longest piece splits as they do.
    """
    raw: list[str] = list(meta["tokenizer.ggml.tokens"])
    spaced = {i for i, token in enumerate(raw) if token and not token.strip(" ")}
    tokens = ["▁" * len(token) if i in spaced else token for i, token in enumerate(raw)]
    types = _token_types(meta, len(tokens))
    unk_id = types.index(UNKNOWN) if UNKNOWN in types else meta.get("tokenizer.ggml.unknown_token_id")
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] != USER_DEFINED}
             for i in range(len(tokens)) if types[i] in (CONTROL, UNKNOWN, USER_DEFINED)]
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    decoder = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
               {"type": "Fuse"}]
    normalizer: dict[str, Any] = replace
    if meta.get("tokenizer.ggml.add_space_prefix", True):  # sentencepiece's dummy prefix, then its strip
        normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace]}
        decoder.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    vocab = _first_ids(tokens)
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
        "pre_tokenizer": None, "post_processor": None, "decoder": {"type": "Sequence", "decoders": decoder},
        "model": {"type": "BPE", "dropout": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "unk_token": None if unk_id is None else tokens[int(unk_id)], "fuse_unk": True,
                  "byte_fallback": BYTE in types, "ignore_merges": False, "vocab": vocab,
                  "merges": _derived_merges(vocab, _scores(meta, len(tokens)).tolist())},
    }
    return json.dumps(tokenizer, ensure_ascii=False)

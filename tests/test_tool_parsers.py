"""jserve.structured.tool_parsers: hermes and llama3_json tool calls, parsed whole and streamed at any split."""

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jserve.structured.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    ToolCallDelta,
    get_parser,
    parser_for_template,
)

HERMES = get_parser("hermes")
LLAMA = get_parser("llama3_json")


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def run_stream(parser, pieces):
    """Feed `pieces`, finish; return (content pieces, deltas, stream)."""
    stream = parser.stream()
    contents, deltas = [], []
    for piece in [*pieces, None]:
        content, ds = stream.feed(piece) if piece is not None else stream.finish()
        contents.append(content)
        deltas.extend(ds)
    return contents, deltas, stream


def assert_stream_matches_parse(parser, text, pieces):
    assert "".join(pieces) == text
    content, calls = parser.parse(text)
    contents, deltas, stream = run_stream(parser, pieces)
    assert "".join(contents) == content
    got = [(c.name, c.arguments) for c in stream.calls]
    assert got == [(c.name, c.arguments) for c in calls]
    # deltas: a call's first delta carries id and name; its pieces of arguments concatenate to ToolCall.arguments
    by_index: dict[int, list[ToolCallDelta]] = {}
    for d in deltas:
        by_index.setdefault(d.index, []).append(d)
    assert sorted(by_index) == list(range(len(stream.calls)))
    for i, call in enumerate(stream.calls):
        first, *rest = by_index[i]
        assert (first.id, first.name) == (call.id, call.name)
        assert all(d.id is None and d.name is None for d in rest)
        assert "".join(d.arguments for d in by_index[i]) == call.arguments


# ---- hermes


def test_hermes_no_calls():
    assert HERMES.parse("Just an answer.\n") == ("Just an answer.", [])
    assert HERMES.parse("") == ("", [])


def test_hermes_one_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>'
    content, calls = HERMES.parse(text)
    assert content == ""
    assert calls_of(calls) == [("get_weather", {"city": "Zürich", "unit": "c"})]
    assert calls[0].arguments == '{"city": "Zürich", "unit": "c"}'  # ensure_ascii=False
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


def test_hermes_two_calls_and_content_before():
    text = (
        "Let me look both up.\n\n"
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"arguments": {"y": [1, 2]}, "name": "b"}</tool_call>\n'
    )
    content, calls = HERMES.parse(text)
    assert content == "Let me look both up."
    assert calls_of(calls) == [("a", {"x": 1}), ("b", {"y": [1, 2]})]
    assert calls[0].id != calls[1].id


def test_hermes_arguments_as_string_and_missing():
    content, calls = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"hi\\"}"}</tool_call>')
    assert (content, calls_of(calls)) == ("", [("f", {"q": "hi"})])
    assert calls_of(HERMES.parse('<tool_call>{"name": "now"}</tool_call>')[1]) == [("now", {})]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {"x": 1}',  # invalid JSON
        '{"arguments": {"x": 1}}',  # no name
        '{"name": 3, "arguments": {}}',  # name not a string
        '{"name": "f", "arguments": [1]}',  # arguments not an object
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": {}} trailing',
        '{"name": "f", "arguments": {"x": NaN}}',
    ],
)
def test_hermes_invalid_call_stays_content(body):
    text = f"Before <tool_call>{body}</tool_call> after"
    assert HERMES.parse(text) == (text, [])


def test_hermes_invalid_and_valid_mixed():
    text = '<tool_call>{oops}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = HERMES.parse(text)
    assert content == "<tool_call>{oops}</tool_call>"
    assert calls_of(calls) == [("g", {})]


def test_hermes_unclosed_call():
    # a complete call whose closing tag never came (e.g. max_tokens) is a call; an unfinished one is content
    assert calls_of(HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')[1]) == [("f", {"x": 1})]
    text = 'Hi <tool_call>\n{"name": "f", "argu'
    assert HERMES.parse(text) == (text, [])


def test_hermes_stream_content_goes_out_at_once():
    stream = HERMES.stream()
    assert stream.feed("Hello") == ("Hello", [])
    assert stream.feed(" world <tool") == (" world", [])  # " <tool" could still open a call: held back
    assert stream.feed("box>") == (" <toolbox>", [])
    assert stream.feed(" <tool_call>") == ("", [])
    content, deltas = stream.feed('{"name": "f", "arguments": {"a": "b"}}</tool_call>')
    assert content == "" and len(deltas) == 1
    assert deltas[0] == ToolCallDelta(index=0, id=stream.calls[0].id, name="f", arguments='{"a": "b"}')
    assert stream.finish() == ("", [])
    assert stream.finish() == ("", [])


def test_hermes_stream_unfinished_call_flushed_as_content():
    stream = HERMES.stream()
    assert stream.feed("ok <tool_call>{") == ("ok", [])
    assert stream.finish() == (" <tool_call>{", [])
    assert stream.calls == []


# ---- llama3_json


def test_llama_plain_text():
    assert LLAMA.parse("  The answer is {42}.") == ("The answer is {42}.", [])
    assert LLAMA.parse("") == ("", [])


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  \n<|python_tag|> "])
def test_llama_one_call(prefix):
    content, calls = LLAMA.parse(prefix + '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert (content, calls_of(calls)) == ("", [("get_weather", {"city": "Paris"})])


def test_llama_arguments_key_and_semicolons():
    text = '{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {"s": "é"}};'
    content, calls = LLAMA.parse(text)
    assert (content, calls_of(calls)) == ("", [("a", {"x": 1}), ("b", {"s": "é"})])
    assert len({c.id for c in calls}) == 2


def test_llama_not_a_call_is_content():
    for text in ['{"result": 3}', '{"name": "f", "parameters": [1]}', '<|python_tag|>{"name": "f", "param', "{oops}"]:
        assert LLAMA.parse(text) == (text, [])
    # text after the calls is content, and so is a later object that is not a call (with its separator)
    content, calls = LLAMA.parse('{"name": "f", "parameters": {}} and then')
    assert (content, calls_of(calls)) == ("and then", [("f", {})])
    content, calls = LLAMA.parse('{"name": "f", "parameters": {}}; {"nope": 1}')
    assert (content, calls_of(calls)) == ('; {"nope": 1}', [("f", {})])


def test_llama_stream_decides_from_first_characters():
    stream = LLAMA.stream()
    assert stream.feed("  <|pyth") == ("", [])
    assert stream.feed("on_tag|>") == ("", [])
    assert stream.feed('{"name": "f", ') == ("", [])
    content, deltas = stream.feed('"parameters": {"x": "}"}}')
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", '{"x": "}"}')]
    stream = LLAMA.stream()
    assert stream.feed(" Sure") == ("Sure", [])
    assert stream.feed(", here") == (", here", [])


# ---- streaming equals parsing, whatever the split

TEXTS = [
    (HERMES, "Plain text, no tools at all."),
    (HERMES, 'I will call it.\n<tool_call>\n{"name": "f", "arguments": {"a": "x<tool_call>y"}}\n</tool_call>\n'),
    (
        HERMES,
        ' <tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>\n\n<tool_call>\n'
        '{"name": "b", "arguments": {"n": [1, {"m": null}], "s": "日本語"}}</tool_call> tail text',
    ),
    (HERMES, 'x <tool_call>{bad json}</tool_call> y <tool_call>{"name": "c", "arguments": {}}'),
    (HERMES, "a <tool_ca b </tool_call> <tool_call>"),
    (LLAMA, '<|python_tag|>{"name": "f", "parameters": {"q": "a;b}", "n": 2}}'),
    (LLAMA, ' {"name": "a", "parameters": {}} ; {"name": "b", "arguments": {"z": "ü"}}\n{"name": "c"}'),
    (LLAMA, "Not JSON; just words {with braces}."),
    (LLAMA, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {'),
    (LLAMA, '<|python_tag|>brave_search.call(query="x")'),
]


@pytest.mark.parametrize("parser,text", TEXTS)
def test_stream_equals_parse_every_two_way_split(parser, text):
    for i in range(len(text) + 1):
        assert_stream_matches_parse(parser, text, [text[:i], text[i:]])


@pytest.mark.parametrize("parser,text", TEXTS)
def test_stream_equals_parse_random_and_single_char_splits(parser, text):
    assert_stream_matches_parse(parser, text, list(text))
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert_stream_matches_parse(parser, text, pieces)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(
    args=st.lists(st.dictionaries(st.text(max_size=6), _json_values, max_size=3), min_size=1, max_size=3),
    before=st.text(max_size=10),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
    hermes=st.booleans(),
)
def test_stream_equals_parse_hypothesis(args, before, cuts, hermes):
    if hermes:
        parser = HERMES
        text = before + "".join(
            f"<tool_call>\n{json.dumps({'name': f'fn{i}', 'arguments': a})}\n</tool_call>\n" for i, a in enumerate(args)
        )
    else:
        parser = LLAMA
        text = "; ".join(json.dumps({"name": f"fn{i}", "parameters": a}) for i, a in enumerate(args))
    cuts = sorted({c for c in cuts if c < len(text)})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert_stream_matches_parse(parser, text, pieces)
    expected_ok = not hermes or "</tool_call>" not in json.dumps(args)  # a closing tag inside a string ends the call
    if expected_ok:
        assert calls_of(parser.parse(text)[1]) == [(f"fn{i}", a) for i, a in enumerate(args)]


# ---- shapes, registry, templates


def test_ids_unique_and_stable():
    text = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{}}}}</tool_call>' for i in range(5))
    _, deltas, stream = run_stream(HERMES, list(text))
    assert [d.id for d in deltas] == [c.id for c in stream.calls]
    assert len({c.id for c in stream.calls}) == 5
    assert ToolCall("f", "{}").id != ToolCall("f", "{}").id


def test_to_openai_shapes():
    first = ToolCallDelta(index=1, id="call_abc", name="f", arguments='{"a"')
    assert first.to_openai() == {
        "index": 1,
        "id": "call_abc",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a"'},
    }
    assert ToolCallDelta(index=1, arguments=": 1}").to_openai() == {"index": 1, "function": {"arguments": ": 1}"}}


def test_get_parser():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    assert get_parser("hermes").name == "hermes" and get_parser("llama3_json").name == "llama3_json"
    with pytest.raises(ValueError, match=r"'mistral'.*hermes, llama3_json"):
        get_parser("mistral")


QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n\\nYou may call one or more functions..."
    "<tools>{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}</tools>\\n\\nFor each function call, return a "
    'json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n{%- endif %}'
)
LLAMA_MARKERS = [
    '{{- "Environment: ipython\\n" }}',
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name\' }}',
    'Respond in the format {\\"name\\": function name, \\"parameters\\": dictionary',  # quotes escaped
    "{%- if message.tool_calls %}{{- '<|python_tag|>' }}{%- endif %}",
]
LLAMA_TEMPLATE = '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}' + "".join(LLAMA_MARKERS)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_parser_for_template():
    assert parser_for_template(QWEN_TEMPLATE) == "hermes"
    assert parser_for_template(LLAMA_TEMPLATE) == "llama3_json"
    for marker in LLAMA_MARKERS:
        assert parser_for_template("<|begin_of_text|>" + marker) == "llama3_json", marker
    assert parser_for_template(CHATML_TEMPLATE) is None
    assert parser_for_template(None) is None and parser_for_template("") is None


def test_names_outside_the_tools_and_plain_json_stay_content():
    other = '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    text = other + '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = get_parser("hermes", names=["f"]).parse(text)
    assert [c.name for c in calls] == ["f"] and content == other
    llama = get_parser("llama3_json", names=["f", "John"])
    assert llama.parse('{"name": "John", "age": 30}') == ('{"name": "John", "age": 30}', [])  # no arguments
    assert llama.parse('{"name": "g", "parameters": {}}')[1] == []  # not among the tools
    assert [c.name for c in llama.parse('{"name": "f", "parameters": {"x": 1}}')[1]] == ["f"]

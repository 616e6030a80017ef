"""jserve's generic tool-call format (jserve/structured/generic_tools.py) without a model: the
answer's schema, reading answers back whole and streamed at any split, the conversation rendered
for a template without a tool format, and the server's choice of the format."""

from __future__ import annotations

import json

import jsonschema
import pytest

from jserve.server import structured
from jserve.server.errors import APIError
from jserve.structured.generic_tools import (
    GENERIC,
    GenericToolParser,
    generic_messages,
    generic_schema,
    template_shows_tools,
)
from jserve.text.chat_template import render_chat_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful AI assistant<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}")  # SmolLM2-Instruct's template: no tools


def test_schema_takes_calls_or_a_response():
    schema = generic_schema([WEATHER, TIME], parallel=True)
    good = [{"response": "Hello"},
            {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
            {"tool_calls": [{"name": "get_time", "arguments": {}},
                            {"name": "get_weather", "arguments": {"city": "X"}}]}]
    bad = [{}, {"response": 3}, {"tool_calls": []}, {"tool_calls": [{"name": "other", "arguments": {}}]},
           {"tool_calls": [{"name": "get_weather", "arguments": {}}]}, {"response": "x", "tool_calls": []},
           {"tool_calls": [{"name": "get_time"}]}]
    for value in good:
        jsonschema.validate(value, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    one = generic_schema([WEATHER, TIME], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[2], one)
    jsonschema.validate(good[1], one)
    nested = generic_schema([WEATHER], parallel=True, response={"type": "object", "required": ["a"]})
    jsonschema.validate({"response": {"a": 1}}, nested)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "text"}, nested)
    jsonschema.validate({"response": 5}, generic_schema([WEATHER], True, response={}))  # {}: any value


def test_llguidance_compiles_the_schema():
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(generic_schema([WEATHER, TIME], parallel=False))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""  # no error


ANSWERS = [
    ('{"response": "Hi \\u00e9\\n\\"there\\" \\ud83d\\ude00 \\\\ end"}', 'Hi é\n"there" 😀 \\ end', []),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
     '"arguments": {}}]}', "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ('{"response": {"a": [1, {"b": "}"}]}}', '{"a": [1, {"b": "}"}]}', []),  # a response_format's value
    ('{"response": "cut sho', "cut sho", []),  # max_tokens: what was written
    ('{"tool_calls": [{"name": "get_weather", "argum', '{"tool_calls": [{"name": "get_weather", "argum', []),
    ('{"tool_calls": [{"name": "get_time", "arguments": {}}, {"na', "", [("get_time", "{}")]),
    ("  plain text, no JSON ", "plain text, no JSON", []),
    ('{"other": 1}', '{"other": 1}', []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", ANSWERS, ids=range(len(ANSWERS)))
def test_read_back_whole_and_streamed_at_any_split(text, content, calls):
    parser = GenericToolParser()
    got, got_calls = parser.parse(text)
    assert (got, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    for size in (1, 2, 3, 7):
        stream = parser.stream()
        pieces, deltas = [], []
        for i in range(0, len(text), size):
            c, d = stream.feed(text[i:i + size])
            pieces.append(c)
            deltas += d
        c, d = stream.finish()
        pieces.append(c)
        deltas += d
        assert "".join(pieces) == content, size
        assert [(d.name, d.arguments) for d in deltas] == calls
        assert [d.index for d in deltas] == list(range(len(calls)))
        assert [d.id for d in deltas] == [c.id for c in stream.calls]


def test_a_response_streams_before_it_is_complete():
    stream = GenericToolParser().stream()
    assert stream.feed('{"resp') == ("", [])
    assert stream.feed('onse": "Hel') == ("Hel", [])
    assert stream.feed("lo \\u00") == ("lo ", [])  # the escape waits for its last digits
    assert stream.feed('e9"}') == ("é", [])
    assert stream.finish() == ("", []) and stream.calls == []


def _conversation():
    return [{"role": "user", "content": "Weather in Paris and the time?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"},
            {"role": "user", "content": "Thanks"}]


def test_messages_for_a_template_without_tools():
    out = generic_messages(_conversation(), [WEATHER, TIME], parallel=True)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and '{"response": ' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                                            {"name": "get_time", "arguments": {}}]}
    assert "tool_calls" not in out[2]
    results = [json.loads(line) for line in out[3]["content"].split("\n")]  # the two results, one message
    assert results == [{"tool_response": {"name": "get_weather", "content": "21 C"}},
                       {"tool_response": {"name": "get_time", "content": "noon"}}]
    with_system = generic_messages([{"role": "system", "content": "Be brief."}, *_conversation()], [WEATHER],
                                   parallel=False)
    assert with_system[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert "to call one tool" in with_system[0]["content"] and len(with_system) == 5
    rendered = render_chat_template(SMOL, out)
    assert "21 C" in rendered and '"arguments": {"city": "Paris"}' in rendered and "You are a helpful" not in rendered


def test_template_shows_tools():
    hermes = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
              "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    refuses = ("{% if tools %}{{ raise_exception('no tools') }}{% endif %}"
               "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_shows_tools(hermes)
    assert not template_shows_tools(SMOL)
    assert not template_shows_tools(refuses)
    assert not template_shows_tools(None)


def test_server_picks_the_generic_format_without_a_parser():
    body = {"tools": [WEATHER], "parallel_tool_calls": False}
    tools = structured.parse_tools(body, None)
    assert (tools.choice, tools.parser) == ("auto", GENERIC)
    spec, field = structured.chat_constraint(body, tools)
    assert field == "tools" and spec.json == generic_schema([WEATHER], parallel=False)
    hermes = structured.parse_tools(body, "hermes")  # a parser, given or implied, wins
    assert hermes.parser == "hermes"
    assert structured.chat_constraint(body, hermes) == (None, None)
    required = structured.parse_tools({**body, "tool_choice": "required"}, None)
    assert required.parser is None  # forced: its own grammar, the template's own rendering
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    spec, field = structured.chat_constraint({**body, "response_format": fmt}, tools)
    assert field == "response_format" and spec.json["anyOf"][1]["properties"]["response"] == {"type": "object"}
    with pytest.raises(APIError) as e:
        structured.chat_constraint({**body, "structured_outputs": {"choice": ["a"]}}, tools)
    assert e.value.param == "structured_outputs"

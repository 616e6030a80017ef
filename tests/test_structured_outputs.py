"""Structured outputs and tool calls over the OpenAI server: every spelling of a constraint, the
official client's `parse` and tool round trips (plain and streamed), errors as 400s naming what is
wrong, and 64 concurrent mixed requests. The server is test_server.py's (a tiny random model with
SmolLM2's 49152-token vocabulary), so whatever it writes is the grammar's doing: the schemas here
are bounded, so every output ends within max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Literal

import aiohttp
import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server import MODEL, assert_error, client, engine, engine_idle, expected, request, server  # noqa: F401

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK),
                                          max_tokens=kw.pop("max_tokens", 80), **kw)


# ------------------------------------------------------------------------------ constraints

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client, temperature):
    out = chat(client, temperature=temperature, seed=3, n=2,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                      "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_every_spelling_constrains(client):
    """response_format json_object, structured_outputs (json, regex, choice, grammar) and the
    guided_* fields, on chat and completions."""
    cases = [
        ({"extra_body": {"structured_outputs": {"json": PERSON}}},
         lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"extra_body": {"structured_outputs": {"regex": r"[0-9]{3}-[A-Z]{2}"}}},
         lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
        ({"extra_body": {"structured_outputs": {"choice": ["red", "green", "blue"]}}},
         lambda t: t in ("red", "green", "blue")),
        ({"extra_body": {"structured_outputs": {"grammar": 'start: "x" ("y" | "z") "!"'}}},
         lambda t: t in ("xy!", "xz!")),
        ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}},  # GBNF
         lambda t: t in ("yes", "no")),
        ({"extra_body": {"guided_json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"extra_body": {"guided_regex": "a{2,4}b"}}, lambda t: re.fullmatch("a{2,4}b", t)),
        ({"extra_body": {"guided_choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"extra_body": {"guided_grammar": 'start: "ok"'}}, lambda t: t == "ok"),
    ]
    for kwargs, ok in cases:
        text = chat(client, temperature=1.0, seed=1, **kwargs).choices[0].message.content
        assert ok(text), (kwargs, text)
        extra = {**kwargs.get("extra_body", {}), **{k: v for k, v in kwargs.items() if k != "extra_body"}}
        done = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=80, temperature=1.0, seed=2,
                                         extra_body=extra)
        assert done.choices[0].finish_reason == "stop" and ok(done.choices[0].text), (kwargs, done.choices[0])


def test_json_object(client):
    """Any JSON object: unbounded (the keys are free), so a random model may run to max_tokens."""
    for seed in range(3):
        out = chat(client, temperature=1.0, seed=seed, response_format={"type": "json_object"})
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(out.choices[0].message.content), dict)
            return
    pytest.fail("no json_object output ended within max_tokens in three tries")


def test_streamed_constrained_output_and_logprobs(client):
    stream = chat(client, stream=True, temperature=0.7, seed=5, logprobs=True, top_logprobs=2,
                  extra_body={"structured_outputs": {"json": PERSON}})
    text, finish, lps = "", None, 0
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        lps += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == "stop" and lps > 0


def test_truncated_output_says_length(client):
    out = chat(client, max_tokens=3, response_format={"type": "json_schema",
                                                      "json_schema": {"name": "p", "schema": PERSON}})
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)


def test_client_parse_with_pydantic(client):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        age: int = pydantic.Field(ge=0, le=99)
        role: Literal["admin", "user"]

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model=MODEL, messages=ASK, max_tokens=60, response_format=Person, temperature=0.5, seed=1)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 99


def test_constraint_with_penalties_stop_and_prefix_cache(client):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3,
              "maxItems": 3}
    for _ in range(2):  # the second run hits the prefix cache
        out = chat(client, temperature=0.8, seed=9, frequency_penalty=1.0, presence_penalty=0.5, top_p=0.9,
                   extra_body={"structured_outputs": {"json": schema}, "repetition_penalty": 1.2, "top_k": 50,
                               "min_p": 0.01})
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    out = chat(client, temperature=0, stop=[","], extra_body={"structured_outputs": {"json": schema}})
    assert out.choices[0].finish_reason == "stop" and "," not in out.choices[0].message.content


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}},
     "response_format.json_schema.schema", "JSON schema object"),
    ({"guided_json": "[" * 30000}, "guided_json", "nested too deeply"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name and a schema"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra", "unsupported field"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"grammar": 'start: "a" missing'}}, "structured_outputs", "missing"),
    ({"guided_grammar": "root ::= root"}, "guided_grammar", "can produce no text"),
    ({"guided_json": {"$ref": "#"}}, "guided_json", "can produce no text"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tools", "strin"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "unsupported"),
    ({"structured_outputs": {"json": '{"type": '}}, "structured_outputs", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one constraint"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json",
     "one output constraint"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    # auto, and this template knows no tools: the generic format's answer takes a JSON constraint only
    ({"tools": [WEATHER], "structured_outputs": {"regex": "a+"}}, "structured_outputs", "JSON schema only"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools[0].function.name", "letters"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "twice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "constrains the output already"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]", "function"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     "boolean"),
]


@pytest.mark.parametrize("extra,param,needle", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_constraints_are_400s_naming_them(server, extra, param, needle):
    status, _, body = request(server, "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": ASK, "max_tokens": 5, **extra})
    assert_error(status, body, 400, contains=(needle,))
    assert body["error"]["param"] == param, body


def test_a_schema_too_hard_to_compile_in_time_is_a_400(server, monkeypatch):
    """A compilation that outlasts the limit (made slow here: real ones this slow are rare) is a
    400, and the server goes on serving."""
    import time

    grammars = server.state.engine.engine.grammars
    real = grammars._compile
    monkeypatch.setattr(grammars, "timeout", 0.2)
    monkeypatch.setattr(grammars, "_compile", lambda spec, key: (time.sleep(1.0), real(spec, key))[1])
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{3,9}@x"}
                                               for i in range(30)}}
    status, _, body = request(server, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}})
    assert_error(status, body, 400, contains=("could not be compiled within",))
    monkeypatch.undo()
    status, _, body = request(server, "POST", "/v1/chat/completions", {  # the server goes on serving
        "model": MODEL, "messages": ASK, "max_tokens": 5, "response_format": {"type": "json_object"}})
    assert status == 200, body


# ------------------------------------------------------------------------------ fuzz

_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=6), st.sampled_from(["string", "object", "array", "integer", "$ref", "#/x"]))
_ANY = st.recursive(_SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "const", "anyOf", "$ref", "pattern",
                                     "format", "minimum", "maxLength", "required", "x"]), inner, max_size=4)),
    max_leaves=10)
_REGEX = st.text(alphabet="ab()[]{}|*+?.^$\\-0123456789,", max_size=12)
_CONSTRAINT = st.one_of(
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries({
        "type": st.sampled_from(["json_schema", "json_object", "text", "xml"]),
        "json_schema": st.fixed_dictionaries({"name": st.text(max_size=5), "schema": _ANY})})}),
    st.fixed_dictionaries({"structured_outputs": st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"]),
        st.one_of(_ANY, _REGEX), max_size=2)}),
    st.fixed_dictionaries({"guided_regex": _REGEX}),
    st.fixed_dictionaries({"guided_grammar": st.one_of(_REGEX, st.text(max_size=20))}),
    st.fixed_dictionaries({"guided_choice": _ANY}),
    st.fixed_dictionaries({"tools": st.one_of(_ANY, st.lists(st.fixed_dictionaries({
        "type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=4),
                                                                        "parameters": _ANY})}), max_size=2)),
        "tool_choice": st.one_of(_ANY, st.sampled_from(["auto", "required", "none"])),
        "parallel_tool_calls": _SCALAR}),
)


@settings(max_examples=int(os.environ.get("JSERVE_FUZZ_EXAMPLES", 150)), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(extra=_CONSTRAINT, chat=st.booleans())
def test_fuzz_constraints_never_5xx(server, extra, chat):
    body = {"model": MODEL, "max_tokens": 3, **extra, **({"messages": ASK} if chat else {"prompt": "Hi"})}
    status, _, answer = request(server, "POST", "/v1/chat/completions" if chat else "/v1/completions", body)
    assert status < 500, (body, answer)
    if status >= 400:
        assert_error(status, answer, status)
        assert answer["error"]["param"], answer  # every refusal names its field


# ------------------------------------------------------------------------------ tools

def _check_weather(call):
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def _collect(stream):
    """A streamed chat reply assembled the way the openai client's users do."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_round_trip(client, choice):
    out = chat(client, tools=[WEATHER, TIME], tool_choice=choice, temperature=0.8, seed=4, parallel_tool_calls=False)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    if isinstance(choice, dict):
        _check_weather(call)
    else:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    # the call and its result go back through the chat template, and the model answers
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = chat(client, messages=history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_streamed(client, choice):
    stream = chat(client, tools=[WEATHER, TIME], tool_choice=choice, stream=True, temperature=0.8, seed=4,
                  parallel_tool_calls=False)
    content, calls, finish = _collect(stream)
    assert finish == "tool_calls" and content == "" and calls
    for call in calls:
        assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
        json.loads(call["arguments"])
    # the same call, not streamed
    plain = chat(client, tools=[WEATHER, TIME], tool_choice=choice, temperature=0.8, seed=4,
                 parallel_tool_calls=False).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in plain.tool_calls] == \
        [(c["name"], c["arguments"]) for c in calls]


def test_required_parallel_calls(client):
    schema_calls = []
    for seed in range(6):
        out = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed)
        if out.choices[0].finish_reason != "tool_calls":
            assert out.choices[0].finish_reason == "length"
            continue
        schema_calls.append(len(out.choices[0].message.tool_calls))
        assert len({c.id for c in out.choices[0].message.tool_calls}) == len(out.choices[0].message.tool_calls)
    assert schema_calls and min(schema_calls) >= 1


def test_auto_tool_calls_with_a_parser(server):
    """tool_choice auto reads the model's own format: here the hermes parser over a grammar that
    writes one call in it (the tiny model knows no tools; the grammar plays the model)."""
    old = server.state.ctx
    server.state.ctx = type(old)(**{**old.__dict__, "tool_parser": "hermes"})
    try:
        grammar = ('start: "Let me check. <tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
                   '{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}}\\n</tool_call>"')
        body = {"model": MODEL, "messages": ASK, "max_tokens": 60, "tools": [WEATHER],
                "structured_outputs": {"grammar": grammar}}
        status, _, reply = request(server, "POST", "/v1/chat/completions", body)
        assert status == 200, reply
        message = reply["choices"][0]["message"]
        assert reply["choices"][0]["finish_reason"] == "tool_calls"
        assert message["content"] == "Let me check."
        assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                        "arguments": '{"city": "Paris", "unit": "celsius"}'}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        content, calls, finish = _collect(client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60, tools=[WEATHER], stream=True,
            extra_body={"structured_outputs": {"grammar": grammar}}))
        assert (content, finish) == ("Let me check.", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    finally:
        server.state.ctx = old


# ------------------------------------------------------------------------------ load

def test_64_concurrent_mixed_requests(server):
    """Half constrained (eight different schemas, each in greedy and sampled requests), half free;
    every output right, no compilation after warm-up, no request lost, every page back."""
    schemas = [{"type": "object", "properties": {f"f{i}": {"type": "integer", "minimum": 0, "maximum": 10 ** i},
                                                 "ok": {"type": "boolean"}},
                "required": [f"f{i}", "ok"], "additionalProperties": False} for i in range(8)]
    before = server.call(server.state.engine.stats())
    # Counts of this test's own requests: the module's server also ran the fuzz test's random grammars.
    compiled, refused = before["compilations_after_warmup"], before["grammar_errors"]

    async def one(session, i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Request {i}"}], "max_tokens": 40,
                "temperature": 0.0 if i % 4 < 2 else 1.0, "seed": i}
        if i % 2 == 0:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": f"s{i % 16 // 2}", "schema": schemas[i % 16 // 2]}}
        else:
            body["ignore_eos"] = True
        async with session.post(server.url + "/v1/chat/completions", json=body) as resp:
            return i, resp.status, await resp.json()

    async def go():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(64)))

    results = asyncio.run(go())
    assert len(results) == 64
    for i, status, reply in results:
        assert status == 200, reply
        choice = reply["choices"][0]
        if i % 2 == 0:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), schemas[i % 16 // 2])
        else:
            assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 40
    stats = engine_idle(server)
    assert stats["compilations_after_warmup"] == compiled
    assert stats["pages_in_use"] == 0 and stats["grammar_errors"] == refused
    assert stats["mask_steps"] > 0 and stats["mask_seconds_per_step"] > 0
    status, _, text = request(server, "GET", "/metrics")
    values = dict(re.findall(r"^(jserve_structured_\w+|jserve_grammar\w+) ([0-9.e+-]+)$", text.decode(), re.M))
    assert float(values["jserve_structured_mask_seconds_per_step"]) > 0
    assert float(values["jserve_structured_requests"]) >= 32 and float(values["jserve_grammar_errors"]) == refused

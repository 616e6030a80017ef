"""Tools with any model, live: the real default model (SmolLM2-135M-Instruct, whose chat template has
no tool format) behind the OpenAI server, tool_choice "auto" in jserve's generic format, driven by
raw HTTP, the openai client, LangChain (`bind_tools`, a `ToolMessage` round trip) and instructor
(its tool and JSON modes). The 135M model's judgement is not under test: the grammar guarantees
the shape, and these check that each client gets well-formed calls or content back."""

from __future__ import annotations

import json
from typing import Iterable, Literal

import jsonschema
import openai
import pydantic
import pytest

from test_server import request, serving
from test_structured_outputs import _collect

pytestmark = pytest.mark.slow
MODEL = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASKS = ["What is the weather in Paris?", "Say hello to me in one short sentence."]


@pytest.fixture(scope="module")
def tool_server(smollm2_checkpoint):
    from jserve import LLM

    # warmup=False: no test here checks compilation; each compiles only the shapes the requests run
    llm = LLM(str(smollm2_checkpoint), max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=128, warmup=False)
    with serving(llm.engine, MODEL) as srv:
        assert srv.state.ctx.tool_parser is None  # the template shows no tools: the generic format
        yield srv


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _check_message(choice, parallel: bool = True) -> list:
    """A call or content, well formed: the calls' names and arguments valid for their tools (where
    max_tokens cut a run of parallel calls, the complete ones)."""
    message = choice.message
    assert choice.finish_reason in ("tool_calls", "stop", "length"), choice
    if message.tool_calls:
        assert choice.finish_reason != "stop" and message.content is None
        assert parallel or len(message.tool_calls) == 1
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name])
        return message.tool_calls
    assert choice.finish_reason != "tool_calls" and isinstance(message.content, str)
    if choice.finish_reason == "stop":
        assert not message.content.startswith('{"response"')  # the wrapper is read, not passed on
    return []


def test_auto_gives_a_tool_call_or_content(client):
    calls = 0
    for ask in ASKS:
        for seed, parallel in ((0, True), (1, False), (2, False)):
            out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}],
                                                 tools=[WEATHER, TIME], temperature=0.8 if seed else 0, seed=seed,
                                                 max_tokens=200, parallel_tool_calls=parallel)
            calls += len(_check_message(out.choices[0], parallel))
    assert calls  # the weather question gets a call (the format works), whatever the other gets


def test_streamed_equals_whole(client):
    for ask in ASKS:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": ask}], tools=[WEATHER, TIME], temperature=0.8,
                  seed=5, max_tokens=200, parallel_tool_calls=False)
        whole = client.chat.completions.create(**kw).choices[0]
        content, calls, finish = _collect(client.chat.completions.create(stream=True, **kw))
        assert finish == whole.finish_reason
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert content == (whole.message.content or "")


def test_tool_result_round_trip_and_a_response_format(client, tool_server):
    ask = [{"role": "user", "content": ASKS[0]}]
    forced = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME], max_tokens=80,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = forced.choices[0].message.tool_calls[0]
    history = ask + [forced.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"}]
    for seed in range(2):
        out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], seed=seed,
                                             temperature=0.8, max_tokens=200)
        _check_message(out.choices[0])
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}}, "required": ["answer"],
              "additionalProperties": False}
    body = {"model": MODEL, "messages": ask, "tools": [WEATHER], "max_tokens": 120, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    status, _, reply = request(tool_server, "POST", "/v1/chat/completions", body)
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    if not message.get("tool_calls"):
        jsonschema.validate(json.loads(message["content"]), schema)


def test_langchain_bind_tools_and_tool_message_round_trip(tool_server):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        return f"21 degrees {unit} in {city}"

    llm = ChatOpenAI(model=MODEL, base_url=tool_server.url + "/v1", api_key="x", temperature=0, max_tokens=120,
                     max_retries=0)
    human = HumanMessage("What is the weather in Paris?")
    auto = llm.bind_tools([get_weather]).invoke([human])
    assert isinstance(auto, AIMessage) and (auto.tool_calls or auto.content)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([human])
    assert len(forced.tool_calls) == 1 and forced.tool_calls[0]["name"] == "get_weather"
    call = forced.tool_calls[0]
    assert {"city", "unit"} <= set(call["args"]) and call["id"]  # the tool's schema allows more
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = llm.bind_tools([get_weather]).invoke([human, forced, result])
    assert isinstance(answer, AIMessage) and not answer.invalid_tool_calls
    assert answer.tool_calls or isinstance(answer.content, str) and answer.content
    for call in answer.tool_calls:
        assert call["name"] == "get_weather" and {"city", "unit"} <= set(call["args"])
    chunks = list(llm.bind_tools([get_weather]).stream([human, forced, result]))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in answer.tool_calls]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])  # JSON, MD_JSON: no grammar holds the fields
def test_instructor_modes(client, mode):
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(model=MODEL, response_model=City, max_retries=2, max_tokens=120,
                                           temperature=0, messages=[{"role": "user", "content":
                                                                     "Paris is the capital of France."}])
    assert isinstance(city, City) and city.name and city.country


def test_instructor_parallel_tools(client):
    """PARALLEL_TOOLS sends tool_choice auto: the generic format's calls, read back as objects."""
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=instructor.Mode.PARALLEL_TOOLS)
    found = patched.chat.completions.create(model=MODEL, response_model=Iterable[Weather | City], max_tokens=200,
                                            parallel_tool_calls=False,
                                            temperature=0, messages=[{"role": "user", "content":
                                                                      "What is the weather in Paris?"}])
    found = list(found)
    assert found and all(isinstance(x, (Weather, City)) for x in found)

"""The request fields that constrain the output, and tools, validated (every error a 400 naming the field).

Constraints come in the spellings clients use, one per request: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `choice`,
`grammar`, `json_object`) and its older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. Tools (`tools`, `tool_choice`, `parallel_tool_calls`) are chat only: a
"required" or named choice becomes a constraint (`jserve.structured.tools`), "auto" needs a
tool-call parser (`--tool-call-parser`, or the one the chat template implies); without one, the
tools go to the model in jserve's generic format (`jserve.structured.generic_tools`), "auto" answers
constrained to tool calls or a response.

A `structured_outputs` holding only options (`close_at_limit`, `disable_any_whitespace`) applies
them to the constraint another field gives (`response_format`, `guided_*`, a forced tool choice).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from jserve.core.request import StructuredOutputsParams
from jserve.server import fields
from jserve.server.errors import bad_request
from jserve.structured.generic_tools import GENERIC, generic_schema
from jserve.structured.tools import function_of, tool_constraint

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = frozenset({"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                                 "close_at_limit"})
_OPTIONS = ("close_at_limit", "disable_any_whitespace")  # alone, they apply to the constraint given elsewhere
_RESPONSE_FORMAT = frozenset({"type", "json_schema"})
_JSON_SCHEMA = frozenset({"name", "schema", "strict", "description"})
_TOOL = frozenset({"type", "function"})
_FUNCTION = frozenset({"name", "description", "parameters", "strict"})
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools: the OpenAI tool objects, the choice ("none", "auto", "required", or
    `{"type": "function", "function": {"name": ...}}`), whether several calls may come, and for
    "auto" the parser that reads the model's own format (`GENERIC` where the chat template shows
    none that jserve reads: the tools then reach the model as text, `generic_tools`)."""

    tools: tuple[dict, ...]
    choice: str | dict
    parallel: bool = True
    parser: str | None = None

    @property
    def forced_name(self) -> str | None:
        return self.choice["function"]["name"] if isinstance(self.choice, dict) else None

    @property
    def calls_expected(self) -> bool:
        """Whether the output may hold tool calls to read back."""
        return self.choice != "none"


def _schema_size(value: Any, name: str) -> None:
    try:
        size = len(json.dumps(value, ensure_ascii=False))
    except RecursionError:
        raise bad_request(f"{name} is nested too deeply", param=name) from None
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(f"{name} is larger than {MAX_SCHEMA_BYTES // 1024} KiB", param=name)


def _object(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise bad_request(f"{name} must be an object, got {type(value).__name__}", param=name)
    return value


def _response_format(body: dict) -> StructuredOutputsParams | None:
    fmt = _object(body, "response_format")
    if fmt is None:
        return None
    fields.check_fields(fmt, _RESPONSE_FORMAT, "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be one of text, json_object, json_schema, got {kind!r:.60}",
                          param="response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with a name and a schema",
                          param="response_format.json_schema")
    fields.check_fields(spec, _JSON_SCHEMA, "response_format.json_schema")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not _NAME.fullmatch(name)):
        raise bad_request(f"response_format.json_schema.name must be 1 to 64 letters, digits, '_', '-' or '.', "
                          f"got {name!r:.80}", param="response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be a boolean",
                          param="response_format.json_schema.strict")
    schema = spec.get("schema")
    if schema is None:
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise bad_request(f"response_format.json_schema.schema must be a JSON schema object, got "
                          f"{type(schema).__name__}", param="response_format.json_schema.schema")
    _schema_size(schema, "response_format.json_schema.schema")
    return _make({"json": schema}, "response_format.json_schema.schema")


def _make(kwargs: dict, where: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e).replace("structured_outputs", where, 1), param=where) from None


def _structured_outputs(body: dict) -> StructuredOutputsParams | None:
    spec = _object(body, "structured_outputs")
    if spec is None:
        return None
    fields.check_fields(spec, _STRUCTURED_OUTPUTS, "structured_outputs")
    kwargs = {k: v for k, v in spec.items() if v is not None}
    for name in _OPTIONS:
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise bad_request(f"structured_outputs.{name} must be a boolean", param=f"structured_outputs.{name}")
    if not set(kwargs) - set(_OPTIONS):
        return None  # options only (`_with_options`)
    if "json" in kwargs:
        _schema_size(kwargs["json"], "structured_outputs.json")
    return _make(kwargs, "structured_outputs")


def _guided(body: dict) -> StructuredOutputsParams | None:
    given = [name for name in _GUIDED if body.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give one constraint, got {', '.join(given)}", param=given[1])
    name = given[0]
    value = body[name]
    if name == "guided_json":
        _schema_size(value, name)
    spec = _make({_GUIDED[name]: value}, "structured_outputs")
    return spec


def _with_options(spec: StructuredOutputsParams | None, field: str | None,
                  body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint with the options of a `structured_outputs` that names no constraint of its
    own (`{"close_at_limit": true}` beside `response_format`); 400 if there is no constraint."""
    given = body.get("structured_outputs")
    options = {k: given[k] for k in _OPTIONS if isinstance(given, dict) and given.get(k) is not None}
    if not options or field == "structured_outputs":
        return spec, field
    if spec is None:
        name = next(iter(options))
        raise bad_request(f"structured_outputs.{name} needs an output constraint: response_format json_object or "
                          f"json_schema, structured_outputs json, regex, choice or grammar, guided_*, or a forced "
                          f"tool_choice", param=f"structured_outputs.{name}")
    return dataclasses.replace(spec, **options), field


def parse_constraint(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The one output constraint a body asks for and the field it came from, or (None, None);
    400 if it asks for several."""
    return _with_options(*_own_constraint(body), body)


def _own_constraint(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    guided = next((name for name in _GUIDED if body.get(name) is not None), "guided_json")
    found = [(name, spec) for name, spec in (("response_format", _response_format(body)),
                                             ("structured_outputs", _structured_outputs(body)),
                                             (guided, _guided(body))) if spec is not None]
    if len(found) > 1:
        raise bad_request(f"give one output constraint, got {found[0][0]} and {found[1][0]}", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _tool(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                          param=where)
    fields.check_fields(tool, _TOOL, where)
    fn = tool["function"]
    fields.check_fields(fn, _FUNCTION, f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', got "
                          f"{name!r:.80}", param=f"{where}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"{where}.function.description must be a string", param=f"{where}.function.description")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                          param=f"{where}.function.parameters")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad_request(f"{where}.function.strict must be a boolean", param=f"{where}.function.strict")
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def parse_tools(body: dict, default_parser: str | None) -> ToolRequest | None:
    """A chat body's tools, or None when it has none (a `tool_choice` other than "none" without
    tools is a 400). `default_parser`: the server's tool-call parser for "auto" (None: "auto"
    answers in jserve's generic format)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", param="tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [function_of(t)["name"] for t in parsed]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tools: the function name {dup!r} appears twice", param="tools")
    _schema_size([function_of(t).get("parameters") for t in parsed], "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fields.check_fields(choice, _TOOL, "tool_choice")
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", param="tool_choice")
        fields.check_fields(fn, frozenset({"name"}), "tool_choice.function")
        if fn["name"] not in names:
            raise bad_request(f"tool_choice names the function {fn['name']!r:.80}, which is not among the tools",
                              param="tool_choice")
        choice = {"type": "function", "function": {"name": fn["name"]}}
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be none, auto, required or a named function, got {choice!r:.60}",
                          param="tool_choice")
    return ToolRequest(parsed, choice, True if parallel is None else parallel,
                       (default_parser or GENERIC) if choice == "auto" else None)


def chat_constraint(body: dict, tools: ToolRequest | None) -> tuple[StructuredOutputsParams | None, str | None]:
    """A chat request's constraint (its own, or its forced tool choice's: not both) and its field."""
    own, field = _own_constraint(body)
    if tools is not None and tools.parser == GENERIC:
        return _with_options(_generic_constraint(tools, own, field), field or "tools", body)
    forced = tool_constraint(tools.tools, tools.choice, tools.parallel) if tools is not None else None
    if own is not None and forced is not None:
        raise bad_request("tool_choice 'required' or a named function constrains the output already: drop "
                          "response_format / structured_outputs, or use tool_choice 'auto'", param="tool_choice")
    return _with_options(*((own, field) if own is not None else (forced, "tools" if forced is not None else None)),
                         body)


def _generic_constraint(tools: ToolRequest, own: StructuredOutputsParams | None,
                        field: str | None) -> StructuredOutputsParams:
    """"auto" in the generic format: tool calls or a response; the request's own JSON constraint,
    if any, is the response's schema (as llama.cpp nests it)."""
    response = None
    if own is not None and own.kind == "json_object":
        response = {"type": "object"}
    elif own is not None and own.kind == "json":
        try:
            response = json.loads(own.json) if isinstance(own.json, str) else own.json
        except ValueError as e:
            raise bad_request(f"{field}: the schema is not valid JSON: {e}", param=field) from None
    elif own is not None:
        raise bad_request(f"{field}: with tools and tool_choice 'auto' on a model whose chat template shows no "
                          f"tool-call format, the answer can be constrained by a JSON schema only, not a "
                          f"{own.kind}: use response_format, or tool_choice 'none'", param=field)
    whitespace = own.disable_any_whitespace if own is not None else True
    return StructuredOutputsParams(json=generic_schema(tools.tools, tools.parallel, response),
                                   disable_any_whitespace=whitespace)

"""The structured-output schema suite (tests/structured_schemas.py) against llguidance, no model.

Every schema must compile on SmolLM2's tokenizer without errors or warnings (llguidance warns
about keywords it ignores), accept its own example, and every text a random walk through the
grammar's token masks produces must pass `validate` (json + jsonschema with formats): so each
schema is supported end to end by the library, and what it constrains is what jsonschema checks.
"""

import json

import jsonschema
import numpy as np
import pytest

from schema_validation import SchemaCase, validate
from structured_schemas import SCHEMAS

llg = pytest.importorskip("llguidance")
lln = pytest.importorskip("llguidance.numpy")

EOS = 2
N_VOCAB = 49152
# What the engine will compile schemas with: compact JSON, as json.dumps writes it.
OVERRIDES = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
WALKS = 5  # random walks per bounded schema (different seeds)
MAX_WALK_TOKENS = 400
UNBOUNDED_WALK_TOKENS = 60  # unbounded cases: walk this far, check it stays in the grammar

CASES = [pytest.param(case, id=case.name) for case in SCHEMAS]


@pytest.fixture(scope="module")
def jserve_tokenizer(smollm2_checkpoint):
    from jserve.text.tokenizer import Tokenizer

    return Tokenizer.load(smollm2_checkpoint)


@pytest.fixture(scope="module")
def llg_tokenizer(jserve_tokenizer):
    return llg.LLTokenizer(jserve_tokenizer._backend.tokenizer.to_str(), n_vocab=N_VOCAB, eos_token=[EOS])


def grammar(case: SchemaCase) -> str:
    return llg.LLMatcher.grammar_from_json_schema(case.schema, overrides=OVERRIDES)


def allowed_tokens(matcher, mask) -> np.ndarray:
    lln.fill_next_token_bitmask(matcher, mask, 0)
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:N_VOCAB])


def _nodes(schema):
    """Every sub-schema (dicts reached through the schema keywords that hold schemas)."""
    yield schema
    for key in ("properties", "$defs"):
        for sub in schema.get(key, {}).values():
            yield from _nodes(sub)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for sub in schema.get(key, []):
            yield from _nodes(sub)
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"])


def _types(node) -> set:
    t = node.get("type", [])
    return {t} if isinstance(t, str) else set(t)


def test_suite_covers_what_it_promises():
    assert len(SCHEMAS) >= 24
    assert len({c.name for c in SCHEMAS}) == len(SCHEMAS)
    assert 1 <= sum(not c.bounded for c in SCHEMAS) <= 2
    keywords, formats = set(), set()
    for case in SCHEMAS:
        assert case.prompt and len(case.prompt) < 200, case.name
        for node in _nodes(case.schema):
            keywords |= set(node)
            if "format" in node:
                formats.add(node["format"])
    for kw in ("properties", "required", "items", "minItems", "maxItems", "enum", "const", "anyOf", "oneOf",
               "minimum", "maximum", "exclusiveMinimum", "pattern", "minLength", "maxLength",
               "additionalProperties", "$defs", "$ref", "prefixItems"):
        assert kw in keywords, kw
    assert {"date", "time", "date-time", "email", "uuid", "ipv4"} <= formats
    assert any(c.schema.get("type") == "array" for c in SCHEMAS)
    types = set().union(*(_types(n) for c in SCHEMAS for n in _nodes(c.schema)))
    assert {"object", "array", "string", "integer", "number", "boolean", "null"} <= types
    # optional properties somewhere: a property not in its object's required list
    assert any(set(n.get("properties", {})) - set(n.get("required", [])) for c in SCHEMAS for n in _nodes(c.schema))


@pytest.mark.parametrize("case", [c for c in CASES if c.values[0].bounded])
def test_bounded_cases_are_bounded(case):
    """What lets a 135M model finish inside ~200 tokens: no free string over 40 characters, no
    array over 5 items, no object that takes extra keys."""
    for node in _nodes(case.schema):
        types = _types(node)
        if "string" in types and not ({"enum", "const", "format", "pattern"} & set(node)):
            assert node.get("maxLength", 1 << 30) <= 40, node
        if "array" in types and node.get("items") is not False:
            assert node.get("maxItems", 1 << 30) <= 5, node
        if "object" in types:
            assert node.get("additionalProperties") is False, node


@pytest.mark.parametrize("case", CASES)
def test_example_validates_and_is_accepted(case, llg_tokenizer, jserve_tokenizer):
    """The case's example passes `validate`, and llguidance accepts its compact json.dumps."""
    text = json.dumps(case.example, ensure_ascii=False)
    assert validate(case, text) == case.example
    matcher = llg.LLMatcher(llg_tokenizer, grammar(case), log_level=0)
    assert matcher.consume_tokens(jserve_tokenizer.encode(text, add_special_tokens=False)), matcher.get_error()
    assert matcher.is_accepting(), text


def test_validate_rejects():
    by_name = {c.name: c for c in SCHEMAS}
    bad = [
        ("book", '{"title": "Dune", "author": "Frank Herbert", "year": "1965"}'),
        ("book", '{"title": "Dune", "author": "Frank Herbert"}'),
        ("book", '{"title": "Dune", "author": "Frank Herbert", "year": 1965, "isbn": "x"}'),
        ("weekday_enum", '{"day": "Funday", "mood": "happy"}'),
        ("event_const", '{"version": 3, "kind": "login", "user": "al", "success": true}'),
        ("shape_oneof", '{"shape": "circle", "radius": 0}'),
        ("meeting_datetime", '{"title": "t", "date": "2025-02-30", "start_time": "10:00:00Z", '
                             '"created_at": "2025-03-10T08:15:00Z"}'),
        ("meeting_datetime", '{"title": "t", "date": "2025-02-03", "start_time": "25:00:00Z", '
                             '"created_at": "2025-03-10T08:15:00Z"}'),
        ("meeting_datetime", '{"title": "t", "date": "2025-02-03", "start_time": "10:00:00Z", '
                             '"created_at": "2025-02-30T08:15:00Z"}'),
        ("user_account", '{"id": "not-a-uuid", "email": "jo@example.org", "username": "jo_smith"}'),
        ("user_account", '{"id": "3f2b8c1e-9d4a-4e7b-a1c2-5d6e7f8a9b0c", "email": "jo", "username": "jo_smith"}'),
        ("server_addresses", '{"name": "w", "ipv4": "256.1.1.1", "ipv6": "::1", "port": 80}'),
        ("product_pattern", '{"sku": "AB-1234", "color_hex": "#ff0000", "name": "mug"}'),
        ("shopping_list", '{"store": "s", "items": ["milk"]}'),
        ("leaderboard_top_level_array", "[]"),
    ]
    for name, text in bad:
        with pytest.raises(jsonschema.ValidationError):
            validate(by_name[name], text)
    with pytest.raises(json.JSONDecodeError):
        validate(by_name["book"], '{"title": "Dune"')
    # RFC 3339 times (with offsets and fractions) are valid "time"s, not only %H:%M:%S
    ok = '{"title": "t", "date": "2024-02-29", "start_time": "23:59:60.25-05:30", "created_at": "2024-02-29t08:15:00z"}'
    validate(by_name["meeting_datetime"], ok)


@pytest.mark.parametrize("case", CASES)
def test_schema_compiles_without_warnings(case, llg_tokenizer):
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar(case), llg_tokenizer)
    assert not is_error and not messages, messages


@pytest.mark.parametrize("case", CASES)
def test_random_walk_validates(case, llg_tokenizer, jserve_tokenizer):
    """Sample uniformly among the allowed tokens (EOS whenever it is allowed) until the matcher
    stops: the text must validate. Unbounded cases walk a while and must stay in the grammar."""
    g = grammar(case)
    mask = lln.allocate_token_bitmask(1, N_VOCAB)
    for seed in range(WALKS if case.bounded else 1):
        rng = np.random.default_rng(seed)
        matcher = llg.LLMatcher(llg_tokenizer, g, log_level=0)
        tokens = []
        limit = MAX_WALK_TOKENS if case.bounded else UNBOUNDED_WALK_TOKENS
        while not matcher.is_stopped() and len(tokens) < limit:
            allowed = allowed_tokens(matcher, mask)
            assert allowed.size, f"empty mask after {jserve_tokenizer.decode(tokens)!r}: {matcher.get_error()}"
            token = EOS if EOS in allowed else int(rng.choice(allowed))
            assert matcher.consume_token(token), matcher.get_error()
            if token == EOS:
                break
            tokens.append(token)
        assert not matcher.is_error(), matcher.get_error()
        text = jserve_tokenizer.decode(tokens)
        assert text == llg_tokenizer.decode_bytes(tokens).decode("utf-8")
        if not case.bounded:
            continue
        assert matcher.is_stopped() or matcher.is_accepting(), f"no end in {limit} tokens: {text!r}"
        try:
            validate(case, text)
        except (ValueError, jsonschema.ValidationError) as e:
            pytest.fail(f"seed {seed}: {text!r} does not validate: {e}")

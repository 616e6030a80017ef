"""structured_outputs.close_at_limit: the closing mask on a tiny byte vocabulary (the output always
completes when the budget allows the shortest completion, never when it does not), the engine's
finish reasons with a tiny random model, and the server's field and its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jserve.core.request import SamplingParams, StructuredOutputsParams
from jserve.structured import closing
from jserve.structured.closing import Closer
from jserve.structured.grammar import GrammarMatcher, allowed_tokens, bitmask_width, fill_bitmasks, grammar_text
from test_server import MODEL, assert_error, engine, expected, request, server  # noqa: F401
from test_structured_engine import _engine, _run, tokenizer, wide  # noqa: F401

# A byte vocabulary with a few merges, the kind that opens structure several bytes at a time.
MERGES = [b'{"', b'": "', b'", "', b'"}', b'"]}', b'": [', b'": {"', b'[{"', b"true", b"null", b'"]', b"}}", b"12"]
EOS = 0
TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}  # a free string


class _Bytes:
    """An llguidance tokenizer source: token 0 is EOS, then every printable byte, then MERGES."""

    def __init__(self):
        self.tokens = [b"<eos>"] + [bytes([b]) for b in range(32, 127)] + MERGES
        self.eos_token_id, self.bos_token_id, self.special_token_ids = EOS, None, [EOS]

    def __call__(self, text):
        data = text.encode() if isinstance(text, str) else text
        return [1 + b - 32 for b in data]


@pytest.fixture(scope="module")
def tiny():
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    source = _Bytes()
    tok = llguidance.LLTokenizer(TokenizerWrapper(source), n_vocab=len(source.tokens))
    return tok, Closer([b"" if t == EOS else b for t, b in enumerate(source.tokens)], [EOS]), source.tokens


def _generate(tiny, grammar: str, budget: int, close: bool, rng) -> tuple[bytes, bool]:
    """A random 'model' that favours opening structure, run to the budget: (its bytes, whether the
    grammar ended)."""
    import llguidance

    tok, closer, vocab = tiny
    matcher = GrammarMatcher(llguidance.LLMatcher(tok, grammar, log_level=0), closer, budget if close else None)
    opening = {t for t, b in enumerate(vocab) if b in (b'{"', b'": [', b'": {"', b'[{"', b'", "')}
    out = []
    for _ in range(budget):
        mask = np.full((1, bitmask_width(len(vocab))), -1, np.int32)
        fill_bitmasks([(matcher, 0)], mask)
        ids = allowed_tokens(mask[0], len(vocab))
        favoured = [t for t in ids if t in opening]
        token = int(rng.choice(favoured if favoured and rng.random() < 0.4 else ids))
        assert matcher.consume(token), (out, token)
        out.append(token)
        if matcher.is_stopped:
            break
    return b"".join(vocab[t] for t in out if t != EOS), matcher.is_stopped


def _json_object() -> str:
    return grammar_text(StructuredOutputsParams(json_object=True))


def test_closing_mask_completes_json_within_every_budget_that_allows_it(tiny):
    """Without it, random outputs mostly run past the budget; with it, every one of 150 parses,
    and none takes more tokens than its budget."""
    rng = np.random.default_rng(0)
    budgets = rng.integers(2, 80, 150)
    plain = [_generate(tiny, _json_object(), int(b), False, rng) for b in budgets]
    closed = [_generate(tiny, _json_object(), int(b), True, rng) for b in budgets]
    assert sum(ended for _, ended in plain) < 100
    for text, ended in closed:
        assert ended
        assert isinstance(json.loads(text), dict), text


def test_closing_a_schema_and_a_lark_grammar(tiny):
    """Required keys and an enum (forced bytes) and a Lark grammar close as well."""
    rng = np.random.default_rng(1)
    schema = grammar_text(StructuredOutputsParams(json={"type": "object", "required": ["kind", "items"],
                                                        "properties": {"kind": {"enum": ["alpha", "beta"]},
                                                                       "items": {"type": "array"}}}))
    lark = grammar_text(StructuredOutputsParams(grammar='start: "(" item ("," item)* ")"\nitem: /[a-z]+/ | start'))
    for grammar, budget in [(schema, 30), (schema, 45), (lark, 12), (lark, 40)]:
        for _ in range(10):
            text, ended = _generate(tiny, grammar, budget, True, rng)
            assert ended, (budget, text)
    for _ in range(10):
        data = json.loads(_generate(tiny, schema, 40, True, rng)[0])
        assert data["kind"] in ("alpha", "beta") and isinstance(data["items"], list)


def test_a_budget_below_the_shortest_completion_is_left_alone(tiny):
    """`{"kind": "alpha", "items": []}` needs more than 5 tokens: nothing is narrowed, the output
    ends unfinished (the engine says "length")."""
    import llguidance

    tok, closer, vocab = tiny
    schema = grammar_text(StructuredOutputsParams(json={"type": "object", "required": ["kind", "items"],
                                                        "properties": {"kind": {"enum": ["alpha", "beta"]},
                                                                       "items": {"type": "array"}}}))
    matcher = GrammarMatcher(llguidance.LLMatcher(tok, schema, log_level=0), closer, 5)
    shortest = closer.shortest(matcher._matcher, 64)
    assert shortest is not None and shortest > 5
    mask = np.full((1, bitmask_width(len(vocab))), -1, np.int32)
    free = mask.copy()
    fill_bitmasks([(matcher, 0)], mask)
    fill_bitmasks([(GrammarMatcher(llguidance.LLMatcher(tok, schema, log_level=0)), 0)], free)
    np.testing.assert_array_equal(mask, free)
    assert matcher.estimate is None


def test_the_mask_is_untouched_far_from_the_budget_and_narrowed_near_it(tiny):
    import llguidance

    tok, closer, vocab = tiny
    far = GrammarMatcher(llguidance.LLMatcher(tok, _json_object(), log_level=0), closer, closing.CLOSE_HORIZON + 3)
    near = GrammarMatcher(llguidance.LLMatcher(tok, _json_object(), log_level=0), closer, 4)
    for m in (far, near):
        for t in (len(vocab) - len(MERGES) + MERGES.index(b'{"'), 1 + ord("a") - 32):
            assert m.consume(t)
    masks = np.full((2, bitmask_width(len(vocab))), -1, np.int32)
    fill_bitmasks([(far, 0), (near, 1)], masks)
    assert far.estimate is None and len(allowed_tokens(masks[0], len(vocab))) > 50
    kept = {vocab[t] for t in allowed_tokens(masks[1], len(vocab))}
    assert near.estimate == 2  # '": "' then '"}', the 2 tokens left
    assert kept == {b'": "'}, kept
    assert near.valid_prefix([1, 2]) == 0 and far.valid_prefix([1 + ord("b") - 32]) == 0


# ------------------------------------------------------------------------------ the engine

def test_engine_finish_reasons(wide, tokenizer):  # noqa: F811
    """A tiny random model at max_tokens 12 (it writes long strings): with close_at_limit every
    output parses and says "stop"; max_tokens 1 cannot hold one ("length"); the compiler's
    default applies to a constraint that leaves the option unset."""
    engine = _engine(wide, tokenizer)
    ids = tokenizer.encode("Some JSON:", add_special_tokens=False)

    def params(close, max_tokens=12, seed=0):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=
                              StructuredOutputsParams(json=TEXT, close_at_limit=close))

    outs = _run(engine, {f"c{s}": (ids, params(True, seed=s)) for s in range(6)}
                | {f"p{s}": (ids, params(False, seed=s)) for s in range(6)} | {"short": (ids, params(True, 1))})
    for s in range(6):
        out = outs[f"c{s}"].outputs[0]
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text)["text"], str), out.text
        assert len(out.token_ids) <= 12
    assert sum(outs[f"p{s}"].outputs[0].finish_reason == "length" for s in range(6)) >= 3
    assert outs["short"].outputs[0].finish_reason == "length"
    engine.grammars.close_at_limit = True
    outs = _run(engine, {f"d{s}": (ids, params(None, seed=s)) for s in range(4)})
    assert all(json.loads(outs[f"d{s}"].outputs[0].text) is not None for s in range(4))


# ------------------------------------------------------------------------------ the server

def test_server_close_at_limit_beside_response_format(server):  # noqa: F811
    """The option beside response_format: every output parses (without it, most run out)."""
    finishes = {True: [], False: []}
    for close in (True, False):
        for seed in range(4):
            status, _, body = request(server, "POST", "/v1/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 10,
                "temperature": 1.0, "seed": seed, "structured_outputs": {"close_at_limit": close},
                "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TEXT}}})
            assert status == 200, body
            choice = body["choices"][0]
            finishes[close].append(choice["finish_reason"])
            if close:
                assert isinstance(json.loads(choice["message"]["content"])["text"], str)
    assert finishes[True] == ["stop"] * 4 and "length" in finishes[False], finishes
    status, _, body = request(server, "POST", "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 10, "seed": 1, "temperature": 1.0,
        "structured_outputs": {"json_object": True, "close_at_limit": True}})
    assert status == 200 and isinstance(json.loads(body["choices"][0]["text"]), dict), body


@pytest.mark.parametrize("extra,param,needle", [
    ({"structured_outputs": {"close_at_limit": "yes"}, "response_format": {"type": "json_object"}},
     "structured_outputs.close_at_limit", "boolean"),
    ({"structured_outputs": {"json_object": True, "close_at_limit": 1}}, "structured_outputs.close_at_limit",
     "boolean"),
    ({"structured_outputs": {"close_at_limit": True}}, "structured_outputs.close_at_limit", "needs an output"),
])
def test_close_at_limit_errors_name_the_field(server, extra, param, needle):  # noqa: F811
    status, _, body = request(server, "POST", "/v1/chat/completions",
                              {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                               **extra})
    assert_error(status, body, 400, contains=(needle,))
    assert body["error"]["param"] == param, body


def test_serve_flag():
    import argparse

    from jserve.server.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert parser.parse_args(["serve"]).structured_outputs_close_at_limit is False
    assert parser.parse_args(["serve", "--structured-outputs-close-at-limit"]).structured_outputs_close_at_limit

"""The embedding model's routes (`--task embed`), vLLM's shapes: /v1/embeddings (float or base64
vectors, Matryoshka `dimensions`), /v1/score (cosine similarity of text_1 and text_2's
embeddings) and /rerank, /v1/rerank (documents by their similarity to the query).

Each input is tokenized (off the event loop when large), admitted like a generation request, and
embedded by `AsyncLLMEngine.encode`; every route of the other task is refused with a 400 that
names the `--task` to serve it (`require_task`).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from jserve.engine.embed_engine import PoolingParams
from jserve.server import fields, protocol, readers, tokenizer_pool
from jserve.server.body import read_json
from jserve.server.errors import APIError, bad_request

ENCODING_FORMATS = ("float", "base64")


def require_task(state: Any, task: str, route: str) -> None:
    """400 where the served model's task is not `task` (an embedding model serves no completions,
    a generation model no embeddings), naming the flag that serves it."""
    served = state.engine.task
    if served != task:
        raise APIError(400, f"{route} needs a model served with --task {task}; this server's model "
                            f"{state.model_name!r} is served with --task {served}", code="wrong_task")


async def _begin(request: web.Request, key: web.AppKey, route: str, allowed: frozenset[str]) -> tuple[Any, dict]:
    state = request.app[key]
    state.check_ready()
    require_task(state, "embed", route)
    body = await read_json(request, state.timeouts.body)
    fields.check_fields(body, allowed)
    protocol.check_model(body, state.ctx)
    return state, body


def _texts(value: Any, name: str, *, ids_allowed: bool) -> list:
    """A field's inputs: a string, a list of strings, or (`ids_allowed`) token ids or lists of them."""
    is_ids = isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    if isinstance(value, str) or (ids_allowed and is_ids):
        return [value]
    if isinstance(value, list) and value and all(
            isinstance(v, str) or (ids_allowed and isinstance(v, list)) for v in value):
        return list(value)
    want = "a string, a list of strings, token ids or a list of token-id lists" if ids_allowed else \
        "a string or a non-empty list of strings"
    raise readers.type_error(name, want, value)


async def _token_ids(state: Any, items: list, name: str, body: dict) -> list[list[int]]:
    """Each input's token ids (text tokenized), truncated as `truncate_prompt_tokens` asks (its last
    tokens kept, as vLLM does) and checked against the context."""
    limits = state.ctx.limits
    if len(items) > limits.max_prompts:
        raise bad_request(f"at most {limits.max_prompts} inputs per request, got {len(items)}", param=name)
    truncate = readers.int_field(body, "truncate_prompt_tokens", None, -1, limits.max_input_tokens)
    add_special = readers.bool_field(body, "add_special_tokens", True)
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{name} holds an empty string: give at least one token", param=name)
            size = len(item.encode("utf-8"))
            if truncate is None:  # (truncated, its size is bounded by the body's)
                tokenizer_pool.check_text_size(size, limits.max_input_tokens, state.pool.max_token_bytes, name)
            ids = await state.pool.run(size, tokenizer_pool.encode, item, add_special)
        else:
            ids = readers.token_ids(item, name, state.ctx.vocab_size)
        if truncate is not None:
            ids = ids[-(limits.max_input_tokens if truncate == -1 else truncate):]
        if len(ids) > limits.max_input_tokens:
            raise bad_request(f"This model's maximum context length is {state.ctx.max_model_len} tokens and an "
                              f"input may have at most {limits.max_input_tokens}, but one has {len(ids)} tokens "
                              "(truncate_prompt_tokens cuts it)", param=name, code="context_length_exceeded")
        out.append(ids)
    return out


async def _embed(state: Any, prompts: list[list[int]], dimensions: int | None = None) -> list[np.ndarray]:
    """The inputs' embeddings, in order: admitted as one request, each input its own engine request."""
    seqs, tokens = len(prompts), sum(map(len, prompts))
    state.admission.check(seqs, tokens)
    state.begin_request(seqs, tokens)
    base = f"embd-{uuid.uuid4().hex}"
    try:
        outs = await asyncio.gather(*(state.engine.encode(f"{base}-{i}", ids, PoolingParams(dimensions))
                                      for i, ids in enumerate(prompts)))
    except ValueError as e:  # what the engine refuses (dimensions the model does not allow)
        raise bad_request(str(e), param="dimensions" if "dimensions" in str(e) else None) from None
    finally:
        state.end_request(seqs, tokens)
    if any(o.embedding is None for o in outs):
        raise APIError(503, "an embedding request was aborted (the server is shutting down)", code="aborted")
    return [o.embedding for o in outs]


def _usage(prompts: list[list[int]]) -> dict[str, int]:
    n = sum(map(len, prompts))
    return {"prompt_tokens": n, "total_tokens": n}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


async def embeddings(key: web.AppKey, request: web.Request) -> web.Response:
    state, body = await _begin(request, key, "/v1/embeddings", fields.EMBEDDINGS)
    if "input" not in body:
        raise bad_request("input is required", param="input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format must be one of {ENCODING_FORMATS}, got {readers.show(fmt)}",
                          param="encoding_format")
    dimensions = readers.int_field(body, "dimensions", None, 1, 2**31 - 1)
    prompts = await _token_ids(state, _texts(body["input"], "input", ids_allowed=True), "input", body)
    vectors = await _embed(state, prompts, dimensions)

    def encoded(v: np.ndarray):
        return v.tolist() if fmt == "float" else base64.b64encode(v.astype("<f4").tobytes()).decode()

    return web.json_response({
        "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": state.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
        "usage": _usage(prompts)})


async def score(key: web.AppKey, request: web.Request) -> web.Response:
    """vLLM's /v1/score for an embedding model: text_1 against text_2 one to one, or one text_1
    against each text_2; the cosine similarity of their embeddings."""
    state, body = await _begin(request, key, "/v1/score", fields.SCORE)
    for name in ("text_1", "text_2"):
        if name not in body:
            raise bad_request(f"{name} is required", param=name)
    first = _texts(body["text_1"], "text_1", ids_allowed=False)
    second = _texts(body["text_2"], "text_2", ids_allowed=False)
    if len(first) not in (1, len(second)):
        raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                          "as text_2", param="text_1")
    prompts = await _token_ids(state, first + second, "text_1", body)
    vectors = await _embed(state, prompts)
    left, right = vectors[:len(first)], vectors[len(first):]
    left = left * len(right) if len(left) == 1 else left
    return web.json_response({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": state.model_name,
        "data": [{"index": i, "object": "score", "score": _cosine(a, b)} for i, (a, b) in enumerate(zip(left, right))],
        "usage": _usage(prompts)})


async def rerank(key: web.AppKey, request: web.Request) -> web.Response:
    """vLLM's /rerank (Jina and Cohere's shape): the documents by their similarity to the query,
    the `top_n` best (0 or none: all)."""
    state, body = await _begin(request, key, request.path, fields.RERANK)
    for name in ("query", "documents"):
        if name not in body:
            raise bad_request(f"{name} is required", param=name)
    query = body["query"]
    if not isinstance(query, str):
        raise readers.type_error("query", "a string", query)
    docs = body["documents"]
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise readers.type_error("documents", "a non-empty list of strings", docs)
    top_n = readers.int_field(body, "top_n", 0, 0, 2**31 - 1) or len(docs)
    prompts = await _token_ids(state, [query, *docs], "documents", body)
    vectors = await _embed(state, prompts)
    scores = [_cosine(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_n]
    return web.json_response({
        "id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name,
        "usage": {"total_tokens": sum(map(len, prompts))},
        "results": [{"index": i, "document": {"text": docs[i]}, "relevance_score": scores[i]} for i in order]})


def add_routes(app: web.Application, key: web.AppKey) -> None:
    """Register the embedding routes, which read the server's state at `key` (each refuses a
    generation model's server)."""
    app.router.add_post("/v1/embeddings", functools.partial(embeddings, key))
    app.router.add_post("/v1/score", functools.partial(score, key))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, functools.partial(rerank, key))

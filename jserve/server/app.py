"""The aiohttp application: OpenAI routes, SSE streaming, auth, limits, health, /metrics, draining.

Requests flow: the error middleware (OpenAI-shaped errors for everything) -> the auth middleware
(Bearer keys, each its own tenant; /health and /metrics stay open) -> a route, which reads the
body under a deadline and parses it strictly (`body`), validates every field (`protocol`,
`fields`), checks admission (`limits`), tokenizes off the event loop when the input is large
(`tokenizer_pool`), checks the prompt lengths and streams `AsyncLLMEngine.generate` for each
prompt (`generate`). Leaving a stream early (client gone, or not reading) aborts the request. A
watchdog task (`watchdog`) turns a dead or hung engine into a clean exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from typing import Any, Callable

from aiohttp import web

from jserve import __version__
from jserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jserve.server import admin, arrivals, embeddings, fields, loras, protocol, readers, tokenizer_pool, watchdog
from jserve.server.body import read_json
from jserve.server.errors import APIError, bad_request, error_body
from jserve.server.generate import DISCONNECTED, run_generation
from jserve.server.http import Timeouts
from jserve.server.limits import Admission, Limits
from jserve.server.messages import parse_messages
from jserve.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from jserve.server.tenancy import TENANT, tenant_of_key
from jserve.structured import reasoning, tool_parsers
from jserve.structured.generic_tools import template_shows_tools
from jserve.structured.grammar import GrammarBusy, GrammarError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
_OPEN_PATHS = ("/health", "/metrics", "/version")


def quantization_summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """What /v1/models and /metrics say of the weights' quantization and its measured quality
    (None: float weights)."""
    if record is None:
        return None
    report = record.get("report") or {}
    kl = report.get("kl") or {}
    return {"label": record["label"], "bits_per_weight": record.get("bits_per_weight"),
            "kl_mean": kl.get("mean"), "kl_p99": kl.get("p99"), "top1_agreement": report.get("top1_agreement"),
            "perplexity": (report.get("ppl") or {}).get("candidate"),
            "reference_perplexity": (report.get("ppl") or {}).get("reference"),
            "evaluated_tokens": report.get("scored_tokens")}


class ServerState:
    """What the routes share: the engine once it is ready, limits, keys, metrics, in-flight count.

    Args:
      model_names: the names clients may pass as `model` (vLLM's --served-model-name); responses
        carry the first.
      api_keys: accepted Bearer keys, each its own prefix-cache tenant; empty: no auth.
      limits: request and admission limits (`Limits`; the model fills in its defaults at attach).
      timeouts: connection timeouts and cap (`Timeouts`).
      scheduling_policy: "fcfs" (a request's `priority` is refused) or "priority".
      step_timeout: seconds one engine step may run before the engine counts as hung (0: never).
      tokenizer_workers: processes that tokenize large inputs (0: all inline).
      on_fatal: called with the problem once a dead engine's requests have been failed (the CLI
        exits non-zero from it).
      tool_call_parser: what reads the model's tool calls for tool_choice "auto"
        (`jserve.structured.tool_parsers`); None: the one the chat template implies, if any.
      log_requests: log each generation request as it arrives and ends (--enable-log-requests).
      reasoning_parser: splits a chat reply's thinking into `reasoning` (`jserve.structured.reasoning`).
    """

    def __init__(self, model_names: str | tuple[str, ...] = "jserve", *, api_keys: tuple[str, ...] = (),
                 limits: Limits | None = None, timeouts: Timeouts | None = None, scheduling_policy: str = "fcfs",
                 step_timeout: float = watchdog.DEFAULT_STEP_TIMEOUT, tokenizer_workers: int = 1,
                 metrics: ServerMetrics | None = None, on_fatal: Callable[[str], Any] | None = None,
                 tool_call_parser: str | None = None, log_requests: bool = False,
                 reasoning_parser: str | None = None):
        if tool_call_parser is not None:
            tool_parsers.get_parser(tool_call_parser)  # ValueError naming an unknown one
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
        self.model_names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
        if not self.model_names:
            raise ValueError("give at least one served model name")
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.limits = limits or Limits()
        self.timeouts = timeouts or Timeouts()
        self.scheduling_policy = scheduling_policy
        self.step_timeout = step_timeout
        self.tokenizer_workers = tokenizer_workers
        self.metrics = metrics or ServerMetrics()
        self.on_fatal = on_fatal
        self.tool_call_parser = tool_call_parser
        if reasoning_parser is not None:
            reasoning.get_parser(reasoning_parser)  # ValueError naming an unknown one
        self.reasoning_parser = reasoning_parser
        self.engine: AsyncLLMEngine | None = None
        self.tokenizer: Any = None
        self.ctx: protocol.Context | None = None
        self.pool: tokenizer_pool.TokenizerPool | None = None
        self.admission: Admission | None = None
        self.shutting_down = False
        self.fatal: str | None = None  # watchdog.DEAD / HUNG once the engine is declared dead
        self.num_in_flight = 0  # engine requests (sequences) started and not yet finished
        self.num_finished = 0  # HTTP requests the engine has finished with (the stats line)
        self.log_requests = log_requests  # --enable-log-requests
        self.created = int(time.time())
        self.quantization: dict[str, Any] | None = None  # quantization_summary, once attached
        self.loras = loras.ServedLoras()  # the LoRA adapters requests may name (`jserve.server.loras`)
        self._idle: asyncio.Event | None = None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def attach(self, engine: AsyncLLMEngine, sampling_defaults: dict[str, Any] | None = None) -> None:
        """Serve with `engine` (its LLMEngine built and warmed up): the server is now ready.
        `sampling_defaults`: the model's, for fields a request leaves out (`--generation-config`)."""
        limits = self.limits.resolve(max_model_len=engine.max_model_len, max_num_seqs=engine.max_num_seqs,
                                     num_kv_tokens=engine.num_kv_tokens)
        self.pool = tokenizer_pool.TokenizerPool(engine.tokenizer, max_jobs=limits.max_tokenize_jobs,
                                                 workers=self.tokenizer_workers)
        self.tokenizer = engine.tokenizer
        self.capacity = engine.max_num_seqs
        self.admission = Admission(engine.max_num_seqs + limits.max_queue, limits.max_queued_tokens)
        parser = self.tool_call_parser or tool_parsers.parser_for_template(engine.tokenizer.chat_template)
        if self.reasoning_parser is not None:
            reasoning.check_tokenizer(self.reasoning_parser,
                                      lambda text: engine.tokenizer.encode(text, add_special_tokens=False))
        if parser is None:
            logger.info("tools: the chat template shows %s, so tools reach the model in jserve's generic JSON "
                        "format", "a tool format jserve does not read (--tool-call-parser names one it does)"
                        if template_shows_tools(engine.tokenizer.chat_template) else "no tools")
        self.ctx = protocol.Context(self.model_names, engine.max_model_len, engine.vocab_size, limits,
                                    allow_priority=self.scheduling_policy == "priority", tool_parser=parser,
                                    sampling_defaults=dict(sampling_defaults or {}),
                                    reasoning_parser=self.reasoning_parser, loras=self.loras)
        self.loras.attach(engine)
        self.quantization = quantization_summary(engine.quantization)
        engine.prepare_constraints()  # llguidance's vocabulary, in the background
        self.metrics.set_quantization(self.quantization)
        self.metrics.attach(self.model_name, engine.max_model_len, engine.cache_config)
        self.engine = engine
        self.metrics.ready.set(1)

    def problem(self) -> str | None:
        """Why the server cannot serve now ("warming_up", "shutting_down", "engine_dead",
        "engine_hung"), or None."""
        if self.fatal is not None:
            return self.fatal
        if self.shutting_down:
            return "shutting_down"
        if self.engine is None:
            return "warming_up"
        if self.engine.is_sleeping:
            return "sleeping"
        return watchdog.engine_problem(self.engine, self.step_timeout)

    @property
    def ready(self) -> bool:
        return self.problem() is None

    def check_ready(self) -> None:
        problem = self.problem()
        if problem == "shutting_down":
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if problem == "warming_up":
            raise APIError(503, "the model is loading and warming up; retry shortly", code="warming_up",
                           headers={"Retry-After": "5"})
        if problem == "sleeping":
            raise APIError(503, "the model is asleep (its memory given back): an admin wakes it with POST /wake_up",
                           code="sleeping", headers={"Retry-After": "10"})
        if problem is not None:  # the details are in the log, not for clients
            raise APIError(503, watchdog.CLIENT_MESSAGE, code="engine_unavailable", headers={"Retry-After": "10"})

    async def wait_idle(self) -> None:
        """Until no engine request is in flight."""
        while self.num_in_flight:
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()

    async def drain(self, grace: float) -> None:
        """Stop taking requests (503), let in-flight ones finish for `grace` seconds, abort the
        rest, and stop the engine thread (not waiting for a hung one)."""
        self.shutting_down = True
        self.metrics.ready.set(0)
        if self.fatal is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wait_idle(), grace)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown, 30.0 if self.fatal is None else 1.0, abort=True)
        if self.pool is not None:
            self.pool.shutdown()

    def begin_request(self, seqs: int, tokens: int) -> None:
        """Count a request's engine sequences in (admission, in-flight gauge)."""
        self.admission.take(seqs, tokens)
        self.num_in_flight += seqs
        self.metrics.in_flight.set(self.num_in_flight)

    def end_request(self, seqs: int, tokens: int) -> None:
        """Count them out again, once the engine is done with them."""
        self.admission.give_back(seqs, tokens)
        self.num_in_flight -= seqs
        self.num_finished += 1
        self.metrics.in_flight.set(self.num_in_flight)
        if self.num_in_flight == 0 and self._idle is not None:
            self._idle.set()


STATE = web.AppKey("state", ServerState)


def build_app(state: ServerState, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              admin_key: str | None = None) -> web.Application:
    """The aiohttp app around `state`. Run it with `state.timeouts.runner_kwargs()` (among them
    `handler_cancellation=True`, so that a client that goes away cancels, so aborts, its request)."""
    app = web.Application(middlewares=[_errors, _auth, arrivals.middleware(STATE)], client_max_size=max_body_bytes)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    embeddings.add_routes(app, STATE)
    admin.register(app, state, admin_key)  # /sleep, /wake_up, /is_sleeping, /update_weights behind the admin key
    loras.register(app, state.loras, admin_key)  # /v1/load_lora_adapter, /v1/unload_lora_adapter (the same)
    app.cleanup_ctx.append(_watchdog)
    return app


async def _watchdog(app: web.Application):
    """The watchdog runs while the app does; on cleanup the tokenizer worker goes too."""
    state = app[STATE]
    task = asyncio.ensure_future(watchdog.watch(state))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if state.pool is not None:
        state.pool.shutdown()


# ------------------------------------------------------------------------------ middlewares

def _route(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        response = await handler(request)
    except APIError as e:
        response = e.response()
        if e.status == 408:  # the rest of a trickled body is not worth reading
            response.force_close()
    except web.HTTPException as e:  # aiohttp's own: 404 route, 405 method, 413 body too large
        if e.status < 400:
            raise
        response = web.json_response(error_body(e.status, e.reason if e.status != 413 else e.text),
                                     status=e.status)
    except asyncio.CancelledError:
        state.metrics.observe_request(_route(request), 499)  # the client went away
        raise
    except Exception as e:  # noqa: BLE001 - a bug of ours: log it, answer 500 in OpenAI's shape
        logger.exception("error serving %s %s", request.method, request.path)
        response = web.json_response(error_body(500, f"internal error: {type(e).__name__}"), status=500)
    state.metrics.observe_request(_route(request), 499 if request.get(DISCONNECTED) else response.status)
    return response


@web.middleware
async def _auth(request: web.Request, handler) -> web.StreamResponse:
    keys = request.app[STATE].api_keys
    request[TENANT] = ""
    if keys and request.path not in _OPEN_PATHS + admin.PATHS:  # admin routes check the admin key
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode("utf-8", "replace")
        # compare against every key (no early exit) so timing says nothing about which matched
        matches = [hmac.compare_digest(given, k) for k in keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        request[TENANT] = tenant_of_key(keys[matches.index(True)])
    return await handler(request)


# ------------------------------------------------------------------------------ simple routes

async def health(request: web.Request) -> web.Response:
    problem = request.app[STATE].problem()
    if problem is None:  # serving; while lazy buckets compile, at less than full speed: said, still 200
        pending = getattr(request.app[STATE].engine, "buckets_pending", 0)
        return web.json_response({"status": "ok", "warming": True, "buckets_pending": pending} if pending
                                 else {"status": "ok"})
    return web.json_response({"status": problem}, status=503)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def tokenizer_info(request: web.Request) -> web.Response:
    """The tokenizer's special tokens and chat template, as vLLM's /tokenizer_info gives them (what
    lm-eval's remote tokenizer reads; encoding goes through /tokenize and /detokenize)."""
    state = request.app[STATE]
    state.check_ready()
    tok = state.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tok.decode([token_id])

    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    return web.json_response({
        "tokenizer_class": type(tok).__name__, "eos_token": text(eos), "eos_token_id": eos,
        "bos_token": text(tok.bos_token_id), "bos_token_id": tok.bos_token_id, "pad_token": None,
        "add_bos_token": tok.add_bos, "chat_template": tok.chat_template, "model_max_length": state.ctx.max_model_len})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None and state.problem() is None:
        with contextlib.suppress(EngineDeadError):
            stats = await state.engine.stats()
            state.metrics.update_engine(stats, state.engine.step_records())
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_ready()
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": state.created, "owned_by": "jserve",
        "max_model_len": state.ctx.max_model_len, "quantization": state.quantization}
        for name in state.model_names] + state.loras.cards(state.model_name, state.created, state.ctx.max_model_len)})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_ready()
    body = await read_json(request, state.timeouts.body)
    fields.check_fields(body, fields.TOKENIZE)
    protocol.check_model(body, state.ctx)
    if "messages" in body:
        add_gen = readers.bool_field(body, "add_generation_prompt", True)
        _, ids = await _render(state, tokenizer_pool.ChatPrompt(parse_messages(body), add_gen))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request(f"prompt must be a string (or give messages), got {readers.show(prompt)}",
                              param="prompt")
        add_special = readers.bool_field(body, "add_special_tokens", True)
        ids = await _encode(state, prompt, add_special)
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": state.ctx.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_ready()
    body = await read_json(request, state.timeouts.body)
    fields.check_fields(body, fields.DETOKENIZE)
    protocol.check_model(body, state.ctx)
    tokens = body.get("tokens")
    if tokens == []:
        return web.json_response({"prompt": ""})
    ids = readers.token_ids(tokens, "tokens", state.tokenizer.vocab_size)
    return web.json_response({"prompt": await state.pool.run(4 * len(ids), tokenizer_pool.decode, ids)})


# ------------------------------------------------------------------------------ tokenization

async def _encode(state: ServerState, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
    """`text`'s ids, refused unread if it cannot fit; large text is encoded off the event loop."""
    size = len(text.encode("utf-8"))
    tokenizer_pool.check_text_size(size, state.ctx.limits.max_input_tokens, state.pool.max_token_bytes, param)
    return await state.pool.run(size, tokenizer_pool.encode, text, add_special_tokens)


async def _render(state: ServerState, chat: tokenizer_pool.ChatPrompt) -> tuple[str, list[int]]:
    if state.tokenizer.chat_template is None:
        raise bad_request(f"the model {state.model_name!r} has no chat template (a base model's has none), so "
                          f"messages cannot be rendered: use /v1/completions with a prompt, or start the server "
                          f"with --chat-template FILE (a jinja template)", code="chat_template_missing")
    size = chat.size()
    tokenizer_pool.check_text_size(size, state.ctx.limits.max_input_tokens, state.pool.max_token_bytes, "messages")
    try:
        return await state.pool.run(size, tokenizer_pool.render_chat, chat)
    except tokenizer_pool.ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None


# ------------------------------------------------------------------------------ generation

async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.check_ready()
    embeddings.require_task(state, "generate", "/v1/completions")
    body = await read_json(request, state.timeouts.body)
    req = protocol.parse_completion(body, state.ctx)
    state.admission.check(req.num_seqs, 0)  # before tokenizing: a full server does no work for it
    for i, (text, ids) in enumerate(req.prompts):
        if ids is None:
            req.prompts[i] = (text, await _encode(state, text, req.add_special_tokens))
    protocol.check_prompts(req, state.ctx)
    await _compile_constraint(state, req)
    return await run_generation(request, state, req)


async def _compile_constraint(state: ServerState, req: protocol.GenerateRequest) -> None:
    """Compile the request's output constraint (cached) in the grammar compiler's threads, off
    the event loop and the engine thread; a 400 naming what is wrong, or that it took too long."""
    spec = req.params.structured_outputs
    if spec is None:
        return
    try:
        await state.engine.compile_constraint(spec)
    except GrammarBusy as e:
        raise APIError(503, str(e), code="grammar_compiler_busy", headers={"Retry-After": "2"}) from None
    except GrammarError as e:
        raise bad_request(str(e), param=req.constraint_param) from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.check_ready()
    embeddings.require_task(state, "generate", "/v1/chat/completions")
    body = await read_json(request, state.timeouts.body)
    req = protocol.parse_chat(body, state.ctx)
    state.admission.check(req.num_seqs, 0)
    req.prompts = [await _render(state, req.chat_prompt())]
    req.start_reasoning()
    protocol.check_prompts(req, state.ctx)
    await _compile_constraint(state, req)
    return await run_generation(request, state, req)

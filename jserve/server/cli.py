"""`jserve serve`: load a model, warm every bucket, serve the OpenAI API until SIGTERM / SIGINT.

The port opens at once (GET /health answers 503 while the model loads and warms up); on SIGTERM
the server answers 503, lets in-flight requests finish for `--grace-period` seconds, aborts the
rest and exits 0. If the engine dies or a step hangs past `--step-timeout`, in-flight requests
end with an error and the process exits 1, for its supervisor to restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from jserve.model.hub import parse_hub_id
from jserve.model.model_args import add_model_args, model_source
from jserve.model.named import DEFAULT_MODEL, NAMED_MODELS, named_model
from jserve.server import admin, logs, loras
from jserve.server.http import Timeouts
from jserve.server.limits import Limits
from jserve.server.watchdog import DEFAULT_STEP_TIMEOUT
from jserve.structured.reasoning import REASONING_PARSERS
from jserve.structured.tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAMES = NAMED_MODELS[DEFAULT_MODEL].names
CHAT_TEMPLATE_HELP = ("the chat template (jinja2) to use instead of the model's own, which a base model lacks: "
                      "a file, or the template itself (text with {, } or a newline), as vLLM reads it")

_d = Limits()
_LIMIT_HELP = {
    "max_queue": f"sequences (n times prompts) allowed to wait beyond --max-num-seqs (default {_d.max_queue})",
    "max_queued_tokens": "prompt + max_tokens tokens over all admitted sequences (default: 8x the KV pool's tokens, "
                         "at least max-num-seqs x max-model-len)",
    "max_input_tokens": "prompt tokens per prompt (default: max-model-len - 1)",
    "max_total_tokens": "prompt + max_tokens per sequence (default: max-model-len)",
    "max_n": f"sequences per request, n times the prompts (default {_d.max_n})",
    "max_prompts": f"prompts per /v1/completions request (default {_d.max_prompts})",
    "max_stop": f"stop strings per request (default {_d.max_stop})",
    "max_stop_chars": f"characters per stop string (default {_d.max_stop_chars})",
    "max_stop_token_ids": f"stop_token_ids per request (default {_d.max_stop_token_ids})",
    "max_logprobs": f"logprobs / top_logprobs (default {_d.max_logprobs})",
    "max_cache_salt_chars": f"characters of cache_salt (default {_d.max_cache_salt_chars})",
    "max_tokenize_jobs": f"large inputs queued for the tokenizer process (default {_d.max_tokenize_jobs})",
}
del _d


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to `jserve`'s subparsers (its func: `serve_command`)."""
    from jserve.engine.config import SERVE_DEFAULTS, add_engine_args, parse_bytes
    from jserve.runtime.distributed import add_multihost_args
    from jserve.vllm_args import add_vllm_args

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_model_args(p)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients may pass as `model`, the first in responses (default: the model "
                   "folder's name; a named model's own, for the default model smollm2-135m-instruct and "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--chat-template", default=None, metavar="FILE", help=CHAT_TEMPLATE_HELP)
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="start from a compile artifact made by `jserve warmup --out DIR` (a mismatch "
                   "is named in the log, then the steps compile as usual)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--admin-key", default=None, help="Bearer key of the management routes (/sleep, /wake_up, "
                   "/is_sleeping, /update_weights; else $JSERVE_ADMIN_KEY; none: no such routes)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders or Hub ids) requests name in `model`, added at start-up: "
                   "name=path, or vLLM's JSON {\"name\", \"path\", \"base_model_name\"} (needs --enable-lora)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="an admin (--admin-key) loads and unloads LoRA adapters while serving: POST "
                   "/v1/load_lora_adapter and /v1/unload_lora_adapter (or $VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    p.add_argument("--api-key", action="append", default=[], help="accepted Bearer key (repeatable); "
                   "default: the comma-separated keys in $JSERVE_API_KEY (kept out of the process list); "
                   "none: no auth")
    p.add_argument("--max-body-bytes", type=parse_bytes, default="4MiB", help="larger bodies get 413")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: a request's `priority` is refused (400); priority: lower values run first")
    p.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT,
                   help="seconds one engine step may run before the engine counts as hung and the server exits 1 "
                        "(0: never; default %(default)s)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls, for tool_choice 'auto' (default: what the chat template "
                        "implies; without one, 'auto' is refused and 'required' / named tools still work)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="how the model writes its thinking (<think> ... </think>): chat replies carry it in "
                        "message.reasoning / delta.reasoning, apart from the content (default: none, it stays "
                        "in the content)")
    p.add_argument("--structured-outputs-close-at-limit", action="store_true",
                   help="constrained outputs close (a JSON document completes) within max_tokens where they can, "
                        "unless a request sets structured_outputs.close_at_limit false")
    p.add_argument("--tokenizer-workers", type=int, default=1,
                   help="processes that tokenize large inputs off the event loop (0: tokenize inline)")
    _add_log_args(p)
    _add_limit_args(p)
    add_engine_args(p)  # --seed among them
    add_vllm_args(p)
    p.set_defaults(**SERVE_DEFAULTS)
    add_multihost_args(p)
    p.set_defaults(func=serve_command)
    return p


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """The admission and per-request limits, and the connections' timeouts."""
    g = p.add_argument_group("limits (429 past the admission ones, 400 past the per-request ones)")
    for field in dataclasses.fields(Limits):
        g.add_argument("--" + field.name.replace("_", "-"), type=int, default=None, help=_LIMIT_HELP[field.name])
    g = p.add_argument_group("connections")
    defaults = Timeouts()
    g.add_argument("--keepalive-timeout", type=float, default=defaults.keepalive,
                   help="seconds a connection may stay idle, or take to send a request's headers "
                        "(default %(default)s)")
    g.add_argument("--body-timeout", type=float, default=defaults.body,
                   help="seconds a request body may take to arrive, then 408 (default %(default)s)")
    g.add_argument("--write-timeout", type=float, default=defaults.write,
                   help="seconds a stream may wait on a client that stopped reading, then it is "
                        "aborted (default %(default)s)")
    g.add_argument("--max-connections", type=int, default=defaults.max_connections,
                   help="open connections; past them a new one gets 503 (default %(default)s)")


def _add_log_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-level", default="info", choices=logs.LEVELS, help="the lowest level logged")
    g.add_argument("--log-format", default="text", choices=logs.FORMATS,
                   help="text: timestamped lines; json: one JSON object a line")
    g.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between stats lines while requests run")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request as it arrives (id, route, model, prompt tokens, sampling) and finishes")


def serve_command(args: argparse.Namespace) -> int:
    from jserve.model.checkpoint import check_model
    from jserve.runtime import distributed
    from jserve.text.chat_template import load_chat_template

    limits(args)  # bad values fail before the model loads
    _lora_modules(args)  # as do bad --lora-modules (their files are read once the model is)
    load_chat_template(args.chat_template)  # as does a bad template
    source = model_source(args)  # a named model's missing package, a Hub model missing or gated: named now
    check_model(source.model, keep_quantized=args.quantization == "gguf", revision=source.revision,
                download_dir=source.download_dir, gguf_file=source.gguf_file)
    if not distributed.from_args(args):  # a follower process of a multi-host run: no HTTP
        distributed.follow(_load(args))
        return 0
    code = asyncio.run(serve(args))
    if code:  # the engine died: a hung engine thread would keep a normal exit waiting
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0


def limits(args: argparse.Namespace) -> Limits:
    """The `Limits` the flags give (unset ones keep their defaults); ValueError for a bad one."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)
             if getattr(args, f.name, None) is not None}
    for name, value in given.items():
        lowest = 0 if name in ("max_queue", "max_logprobs") else 1
        if value < lowest:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {lowest}, got {value}")
    return Limits(**given)


def _lora_modules(args: argparse.Namespace) -> list:
    """--lora-modules as `LoRARequest`s; ValueError for a bad one, or LoRA flags without --enable-lora."""
    modules = getattr(args, "lora_modules", None)
    needs = "--lora-modules" if modules else ("--allow-runtime-lora-updating" if loras.runtime_updating(
        getattr(args, "allow_runtime_lora_updating", False)) else None)
    if needs and not getattr(args, "enable_lora", False):
        raise ValueError(f"{needs} needs --enable-lora")
    return loras.parse_modules(modules, served_model_names(args))  # without an admin key: build_app


def timeouts(args: argparse.Namespace) -> Timeouts:
    for name in ("keepalive_timeout", "body_timeout", "write_timeout", "max_connections"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return Timeouts(keepalive=args.keepalive_timeout, body=args.body_timeout, write=args.write_timeout,
                    max_connections=args.max_connections)


def served_model_names(args: argparse.Namespace) -> tuple[str, ...]:
    """--served-model-name, else a named model's names (the default model's without --model), a
    Hub model's id (as vLLM names it), else the model folder's or file's name."""
    if args.served_model_name:
        return tuple(args.served_model_name)
    named = named_model(args.model)
    if named is not None:
        return named.names
    if not Path(args.model).exists() and parse_hub_id(args.model, getattr(args, "gguf_file", None)) is not None:
        return (str(args.model).split(":", 1)[0],)
    return (Path(args.model).stem,)


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key values, else the comma-separated keys in $JSERVE_API_KEY (not visible in `ps`)."""
    keys = tuple(args.api_key) or tuple(k.strip() for k in os.environ.get("JSERVE_API_KEY", "").split(","))
    return tuple(k for k in keys if k)


def _load(args: argparse.Namespace) -> Any:
    from jserve.engine import compile_cache
    from jserve.engine.config import engine_kwargs
    from jserve.llm import LLM
    from jserve.text.chat_template import load_chat_template

    settings = engine_kwargs(args)
    source = model_source(args)
    cache = compile_cache.resolve(getattr(args, "compile_cache", None), source.model, source.dtype, settings)
    # The tokenizer pool pickles this tokenizer, so its worker renders with the same template.
    return LLM(**source.llm_kwargs(), warmup=True, compilation_cache=cache,
               chat_template=load_chat_template(getattr(args, "chat_template", None)), **settings)


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now (JAX, Flax, the loaded engine) into the garbage
    collector's permanent generation; returns how many.

    Why: a loaded SmolLM2 engine leaves hundreds of thousands of tracked objects, and a full
    collection walks all of them, for hundreds of milliseconds, with the GIL held, so every stream
    stalls that long whenever enough survivors pile up to trigger one (docs/performance.md).
    Frozen, they are never walked again; what the server allocates later is collected as usual.
    vLLM freezes its startup heap the same way. Only for a long-lived process: cyclic garbage
    among frozen objects is never reclaimed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _listen(app: Any, timeouts: Timeouts, args: argparse.Namespace) -> Any:
    """The app's runner, listening on --host:--port; a port in use is a one-line ValueError."""
    from aiohttp import web

    from jserve.server.http import CappedSite

    runner = web.AppRunner(app, **timeouts.runner_kwargs())
    await runner.setup()
    try:
        await CappedSite(runner, args.host, args.port, max_connections=timeouts.max_connections).start()
    except OSError as e:
        await runner.cleanup()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {args.port} on {args.host} is in use (another server?): stop it or pass "
                             "--port") from None
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    logger.info("listening on http://%s:%d (warming up)", args.host, args.port)
    return runner


def _load_in_background(args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """The model loading on a daemon thread (not to_thread: a signal during loading must not wait
    for the load to end); the future holds the LLM, or the load's error."""
    loaded: asyncio.Future = loop.create_future()

    def load() -> None:
        try:
            result = _load(args)
            try:  # each adapter read and checked: a bad one stops the start
                loras.add_modules(result.engine, _lora_modules(args))
            except BaseException:
                result.close()  # no background compilation left running as the process exits
                raise
            loop.call_soon_threadsafe(lambda: loaded.done() or loaded.set_result(result))
        except BaseException as e:  # noqa: BLE001 - reported on the loop, re-raised by serve()
            loop.call_soon_threadsafe(lambda err=e: loaded.done() or loaded.set_exception(err))

    threading.Thread(target=load, name="jserve-load", daemon=True).start()
    return loaded


def _sampling_defaults(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    """`--generation-config`'s defaults, logged (as vLLM warns) when they override the API's."""
    from jserve.model.sampling_defaults import resolve

    recorded = (getattr(llm, "generation_config", None) or {}).get("sampling_defaults", {})
    defaults = resolve(getattr(args, "generation_config", None), recorded)
    if defaults:
        logger.warning("sampling defaults from the model's generation config: %s (a request's own values win; "
                       "--generation-config vllm serves the API's defaults instead)", defaults)
    return defaults


async def serve(args: argparse.Namespace) -> int:
    from jserve.engine.async_engine import AsyncLLMEngine
    from jserve.server.app import ServerState, build_app
    from jserve.server.watchdog import HUNG

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def on_fatal(problem: str) -> None:
        logger.error("exiting with status 1 (%s) for the supervisor to restart the server", problem)
        stop.set()

    names = served_model_names(args)
    state = ServerState(names, api_keys=api_keys(args), limits=limits(args), timeouts=timeouts(args),
                        scheduling_policy=args.scheduling_policy, step_timeout=args.step_timeout,
                        tokenizer_workers=args.tokenizer_workers, on_fatal=on_fatal,
                        tool_call_parser=args.tool_call_parser, log_requests=args.enable_log_requests,
                        reasoning_parser=args.reasoning_parser)
    state.loras.allow_updating = loras.runtime_updating(getattr(args, "allow_runtime_lora_updating", False))
    app = build_app(state, max_body_bytes=args.max_body_bytes, admin_key=admin.admin_key(args.admin_key))
    runner = await _listen(app, state.timeouts, args)
    loaded = _load_in_background(args, loop)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
    if loaded.done():
        llm = loaded.result()  # a load error propagates: exit non-zero
        llm.engine.grammars.close_at_limit = args.structured_outputs_close_at_limit
        engine = AsyncLLMEngine(llm.engine)
        # The lazy buckets' thread compiles nothing through the setup below (a second or two: the
        # tokenizer worker's start) that would still run beside the first requests after ready.
        with engine.lazy_buckets_held():
            frozen = freeze_startup_heap()
            state.attach(engine, sampling_defaults=_sampling_defaults(args, llm))
        logger.info("ready: serving %s on http://%s:%d (async scheduling %s; decode steps a call: %d; %d startup "
                    "objects frozen out of the garbage collector)", ", ".join(names), args.host, args.port,
                    "on" if getattr(llm.engine, "async_scheduling", False) else "off",
                    llm.engine.config.num_scheduler_steps, frozen)
        stats = None if args.disable_log_stats else asyncio.ensure_future(logs.StatsLine(
            state.engine.stats, lambda: state.num_finished, args.log_stats_interval).run())
        await stopping
        if stats is not None:
            stats.cancel()
    if state.fatal is None:
        logger.info("shutting down (grace period %.0f s)", args.grace_period)
    await state.drain(args.grace_period)
    if loaded.done() and loaded.exception() is None and state.fatal != HUNG:
        # The engine thread has stopped (no step in flight): the followers, then the lazy
        # buckets' thread, after the shape it compiles. An engine loaded during the drain was
        # never attached, but its runner is stopped all the same.
        (state.engine or AsyncLLMEngine(loaded.result().engine, start=False)).close()
    await runner.cleanup()
    return 1 if state.fatal is not None else 0

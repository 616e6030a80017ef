"""`jserve serve`: load a model, warm every bucket, serve the OpenAI API until SIGTERM / SIGINT.

The port opens at once (GET /health answers 503 while the model loads and warms up); on SIGTERM
the server answers 503, lets in-flight requests finish for `--grace-period` seconds, aborts the
rest and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to `jserve`'s subparsers (its func: `serve_command`)."""
    from jserve.cli import add_engine_args, parse_bytes

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--model", default=None, help="checkpoint folder, HF folder, .gguf or name "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` "
                   "(default: the model folder's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[], help="accepted Bearer key (repeatable); "
                   "default: the comma-separated keys in $JSERVE_API_KEY (kept out of the process list); "
                   "none: no auth")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait beyond --max-num-seqs before answering 429")
    p.add_argument("--max-body-bytes", type=parse_bytes, default="4MiB", help="larger bodies get 413")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="weight and KV dtype (default: the checkpoint's; float32 when converting)")
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=serve_command)
    return p


def serve_command(args: argparse.Namespace) -> int:
    from jserve import distributed

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not distributed.from_args(args):  # a follower process of a multi-host run: no HTTP
        distributed.follow(_load(args))
        return 0
    asyncio.run(serve(args))
    return 0


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key values, else the comma-separated keys in $JSERVE_API_KEY (not visible in `ps`)."""
    keys = tuple(args.api_key) or tuple(k.strip() for k in os.environ.get("JSERVE_API_KEY", "").split(","))
    return tuple(k for k in keys if k)


def _load(args: argparse.Namespace) -> Any:
    from jserve.cli import engine_kwargs
    from jserve.llm import LLM

    return LLM(args.model, dtype=args.dtype, seed=args.seed, warmup=True, **engine_kwargs(args))


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now (JAX, Flax, the loaded engine) into the garbage
    collector's permanent generation; returns how many.

    Why: a loaded SmolLM2 engine leaves ~670k tracked objects, and a full collection walks all of
    them: 320-370 ms (*measured*, 2-core development machine), with the GIL held, so every stream
    stalls that long whenever enough survivors pile up to trigger one. Frozen, they are never
    walked again (0.0 ms); what the server allocates later is collected as usual. vLLM freezes its
    startup heap the same way. Only for a long-lived process: cyclic garbage among frozen objects
    is never reclaimed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from jserve.async_engine import AsyncLLMEngine
    from jserve.server.app import ServerState, build_app

    name = args.served_model_name or (Path(args.model).stem if args.model else "SmolLM2-135M-Instruct")
    state = ServerState(name, api_keys=api_keys(args), max_queue=args.max_queue)
    runner = web.AppRunner(build_app(state, max_body_bytes=args.max_body_bytes), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    logger.warning("listening on http://%s:%d (warming up)", args.host, args.port)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A daemon thread, not to_thread: a signal during loading must not wait for the load to end.
    loaded: asyncio.Future = loop.create_future()

    def load() -> None:
        try:
            result = _load(args)
            loop.call_soon_threadsafe(lambda: loaded.done() or loaded.set_result(result))
        except BaseException as e:  # noqa: BLE001 - reported on the loop, re-raised by serve()
            loop.call_soon_threadsafe(lambda err=e: loaded.done() or loaded.set_exception(err))

    threading.Thread(target=load, name="jserve-load", daemon=True).start()
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
    if loaded.done():
        llm = loaded.result()  # a load error propagates: exit non-zero
        frozen = freeze_startup_heap()
        state.attach(AsyncLLMEngine(llm.engine))
        logger.warning("ready: serving %s on http://%s:%d (%d startup objects frozen out of the garbage "
                       "collector)", name, args.host, args.port, frozen)
        await stopping
    logger.warning("shutting down (grace period %.0f s)", args.grace_period)
    await state.drain(args.grace_period)
    if loaded.done() and loaded.exception() is None:
        loaded.result().engine.runner.stop_followers()  # the engine thread has stopped: no step in flight
    await runner.cleanup()

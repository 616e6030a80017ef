"""A dead engine is not a zombie: notice it, fail what is in flight cleanly, have the process exit.

The engine is dead when its thread raised (`AsyncLLMEngine.errored`) or when one loop iteration
(one step, or a request's prompt-scoring pass) has run longer than the step timeout (hung). Then
`/health` answers 503 (`engine_dead` / `engine_hung`), every in-flight request ends with a
generic 503 error (the cause goes to the log only), and `on_fatal` is called so that
`jserve serve` exits non-zero and a supervisor (systemd's `Restart=on-failure`, Kubernetes)
starts a fresh process. A hung step cannot be interrupted: its pages are freed by that exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jserve.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)

DEAD, HUNG = "engine_dead", "engine_hung"
DEFAULT_STEP_TIMEOUT = 120.0  # seconds; a warmed-up step takes milliseconds to a few seconds
CLIENT_MESSAGE = "the engine stopped working; the server is restarting, retry shortly"


def engine_problem(engine: "AsyncLLMEngine | None", step_timeout: float) -> str | None:
    """DEAD, HUNG or None (fine, or not attached yet)."""
    if engine is None:
        return None
    if engine.errored:
        return DEAD
    if step_timeout and engine.iteration_seconds() > step_timeout:
        return HUNG
    return None


async def watch(state, interval: float = 0.5) -> None:
    """Poll the engine of `state` (a `ServerState`) until it dies, then fail it (see `fail`)."""
    while True:
        problem = None if state.shutting_down else engine_problem(state.engine, state.step_timeout)
        if problem is not None:
            await fail(state, problem)
            return
        await asyncio.sleep(interval)


async def fail(state, problem: str, settle: float = 5.0) -> None:
    """Declare the engine of `state` dead: stop taking requests, end every stream with an error,
    give handlers `settle` seconds to answer, log what is left, then call `state.on_fatal`."""
    engine = state.engine
    if state.fatal is not None:
        return
    state.fatal = problem
    state.metrics.ready.set(0)
    if problem == HUNG:
        logger.error("an engine step has run for %.0f s, past the %.0f s step timeout: failing every request",
                     engine.iteration_seconds(), state.step_timeout)
        engine.fail(f"a step ran past the {state.step_timeout:g} s step timeout")
    else:
        logger.error("the engine loop died (%r): failing every request", engine.error)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(state.wait_idle(), settle)
    if problem == DEAD and await asyncio.to_thread(engine.shutdown, 5.0):  # joined: the engine is ours to read
        stats = await engine.stats()
        logger.error("engine failed; requests left in flight: %d, pages in use: %d", state.num_in_flight,
                     stats.get("pages_in_use", -1))
    else:
        logger.error("engine hung; requests left in flight: %d (its pages are freed when the process exits)",
                     state.num_in_flight)
    if state.on_fatal is not None:
        state.on_fatal(problem)

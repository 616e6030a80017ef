"""AsyncLLMEngine: the LLMEngine's step loop on its own thread, one async stream per request.

Threading model. One daemon thread owns the `LLMEngine`: it alone calls add_request / step /
abort_request / stats. Other threads (the asyncio server loop) hand it commands through a
deque guarded by a `threading.Condition`; the thread drains the commands, runs one step if any
request is unfinished, and sleeps on the condition when there is nothing to do (no spinning).
Outputs go back, one `call_soon_threadsafe` per event loop per step, to each request's
`asyncio.Queue`; a consumer that falls behind gets the steps it missed coalesced into one output.
Leaving a `generate` stream early (break + aclose, task cancelled, client gone) aborts the request
before the next step. An exception in a step kills the loop: every live stream raises
`EngineDeadError` (the cause attached) and later calls raise it at once. A step that never
returns cannot be interrupted, but `iteration_seconds()` shows it and `fail()` ends every
stream from the asyncio side.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

from jserve.core.request import RequestOutput, SamplingParams
from jserve.engine.arrivals import Arrivals
from jserve.engine.async_loras import AsyncLoraControl
from jserve.engine.async_weights import AsyncWeightControl
from jserve.engine.engine_facts import EngineFacts
from jserve.engine.engine_warming import EngineWarming
from jserve.engine.handover import Command, latest, post
from jserve.engine.request_ledger import RequestLedger, requests_of
from jserve.engine.stream_output import RequestTimings, Tracker

__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestTimings"]

if TYPE_CHECKING:
    from jserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running: it crashed (see `__cause__`) or was shut down."""


@dataclasses.dataclass(eq=False)
class _Live:
    """Engine-thread record of a running request: where its outputs go."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    requests: list  # the scheduler's Request objects (one per sample), read for the timings
    seen_first_output: bool = False


class AsyncLLMEngine(AsyncWeightControl, AsyncLoraControl, EngineFacts, EngineWarming):
    """Runs an `LLMEngine` on a daemon thread and streams each request's outputs to asyncio.

    Args:
      engine: the engine to drive (or any object with its add_request / abort_request / step /
        has_unfinished_requests / stats / num_steps); nothing else may call it while the thread runs.
      start: start the thread now (else call `start()`).
      max_timings: how many finished requests' `RequestTimings` to keep for `request_timings`.
      gather_seconds: the longest the first step after an idle spell waits for requests the
        server is still reading (`expect`; `jserve.engine.arrivals`).
    """

    def __init__(self, engine: "LLMEngine", *, start: bool = True, max_timings: int = 4096,
                 gather_seconds: float = 0.01):
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: collections.deque[Command] = collections.deque()
        self._closing = False  # shutdown() called: no new requests
        self._stopped = False  # the loop ended (shutdown or crash): no commands at all
        self._error: BaseException | None = None
        self._live: dict[str, _Live] = {}  # engine thread only
        self._ledger = RequestLedger(max_timings)  # timings and finished totals for the metrics
        self.num_loop_iterations = 0  # wake-ups of the engine thread (idle proof for tests)
        self._iteration_start: float | None = None  # monotonic start of the engine thread's work now
        self._streams: dict[asyncio.Queue, asyncio.AbstractEventLoop] = {}  # open generate() streams
        self._thread: threading.Thread | None = None
        self._waiting, self._held = [], []  # engine thread only: calls waiting for a drain, requests held
        self._arrivals = Arrivals(self._cond)  # requests the server is reading, not yet added
        self.gather_seconds = gather_seconds
        if start:
            self.start()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread was already started")
        self._thread = threading.Thread(target=self._run, name="jserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    @property
    def errored(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the loop, or None."""
        return self._error

    def iteration_seconds(self) -> float:
        """How long the engine thread has been on its current iteration (taking commands and
        running one step); 0.0 while it sleeps. Any thread may call it."""
        start = self._iteration_start
        return 0.0 if start is None or self._stopped else max(0.0, time.monotonic() - start)

    def fail(self, reason: str) -> None:
        """Declare the loop dead from outside (for a step that never returns): every open stream
        raises EngineDeadError now, later calls at once; if the step ever returns, the thread
        exits. Pages held by the hung step's requests are not freed. Any thread may call it."""
        with self._cond:
            if self._error is None:
                self._error = EngineDeadError(reason)
            self._stopped = self._closing = True
            streams = list(self._streams.items())
            self._cond.notify()
        error = self._dead_error()
        for queue, loop in streams:
            post(loop, [(queue, error)])

    def prepare_constraints(self) -> None:
        """Start building the grammar compiler's vocabulary in the background."""
        if hasattr(self.engine, "grammars"):  # an embedding model's engine has none
            self.engine.grammars.prepare()

    async def compile_constraint(self, spec: Any) -> Any:
        """Compile a structured-outputs spec (cached) in the grammar compiler's threads, off the
        event loop and the engine thread; GrammarError if it cannot be, GrammarBusy if too many wait."""
        return await asyncio.to_thread(self.engine.grammars.compile, spec)

    def close(self) -> None:
        """After `shutdown` (no step in flight): stop a multi-host run's followers and the
        runner's background compilation thread."""
        self.engine.runner.stop_followers()
        self.engine.runner.close()

    # ------------------------------------------------------------------------------ asyncio API

    def expect(self):
        """A context manager around reading a request that may be added (the server's route): the
        first step after an idle spell waits for it, up to `gather_seconds`, so that requests that
        come together start together."""
        return self._arrivals.expect()

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       prompt: str | None = None, priority: int = 0, cache_salt: str | None = None,
                       delta: bool = True, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs; the last has `finished=True`.

        With `delta=True` each output's completions hold only what is new since the previous
        yield (text, token_ids, logprobs; completions with nothing new are left out; prompt
        logprobs come once, first). With `delta=False` each holds everything so far. Text that
        could still turn out to be the start of a stop string is held back until it cannot.
        A structured-outputs constraint is compiled first, off the engine thread (a GrammarError,
        a ValueError, if it cannot be). Raises ValueError for a request the engine rejects,
        EngineDeadError if the loop is not running or dies. Closing the generator early aborts
        the request. `lora_request`: the LoRA adapter it runs with (`LLMEngine.add_request`).
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        try:
            ids = list(prompt_token_ids)
        except TypeError:
            raise ValueError(f"prompt_token_ids must be a sequence of token ids, got "
                             f"{type(prompt_token_ids).__name__}") from None
        grammar = None  # compiled in the compiler's threads and handed over: never on the engine thread
        if params.structured_outputs is not None:
            grammar = await self.compile_constraint(params.structured_outputs)
        tracker = Tracker(params, delta)
        kwargs = dict(prompt=prompt, priority=priority, cache_salt=cache_salt, arrival_time=time.monotonic(),
                      **({"grammar": grammar} if grammar else {}),
                      **({"lora_request": lora_request} if lora_request is not None else {}))
        async with contextlib.aclosing(self._outputs(request_id, (ids, params), kwargs)) as outputs:
            async for item in outputs:
                out = tracker.next(item)
                if out is not None:
                    yield out

    async def encode(self, request_id: str, prompt_token_ids: Sequence[int], params: Any, *,
                     prompt: str | None = None, priority: int = 0) -> Any:
        """An embedding model's request (`EmbedEngine`, `PoolingParams`): its one output, a
        `PoolingOutput`. Raises as `generate` does; cancelled, it aborts the request."""
        kwargs = dict(prompt=prompt, priority=priority, arrival_time=time.monotonic())
        async with contextlib.aclosing(self._outputs(request_id, (list(prompt_token_ids), params), kwargs)) as outs:
            return [out async for out in outs][-1]  # one output, finished

    @property
    def task(self) -> str:
        """What the engine serves: "generate", or "embed" (an embedding model's `EmbedEngine`)."""
        return getattr(self.engine, "task", "generate")

    async def _outputs(self, request_id: str, args: tuple, kwargs: dict) -> AsyncIterator[Any]:
        """Add a request and yield its outputs (`latest`), the last finished; leaving early aborts it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            self._streams[queue] = loop
        try:
            self._submit(Command("add", request_id, args, kwargs, queue=queue, loop=loop))
        except BaseException:
            with self._cond:
                self._streams.pop(queue, None)
            raise
        done = False  # finished, or never added: nothing to abort
        try:
            while not done:
                item = await latest(queue)
                done = isinstance(item, BaseException) or item.finished
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            with self._cond:
                self._streams.pop(queue, None)
            if not done:
                try:  # no await here: this runs during cancellation and generator finalization
                    self._submit(Command("abort", request_id, queue=queue), control=True)
                except EngineDeadError:
                    pass

    async def abort(self, request_id: str) -> bool:
        """Abort a request (its stream ends with finish_reason "abort"); True if it was running.
        On return its pages are free."""
        future = asyncio.get_running_loop().create_future()
        try:
            self._submit(Command("abort", request_id, loop=future.get_loop(), future=future), control=True)
        except EngineDeadError:
            return False
        return await future

    async def stats(self) -> dict[str, Any]:
        """`LLMEngine.stats()` (pages, steps, num_waiting / num_running, ...) plus this loop's
        counters, taken on the engine thread between steps."""
        if self._thread is None:
            return self._stats()  # not started: nobody else touches the engine
        future = asyncio.get_running_loop().create_future()
        try:
            self._submit(Command("stats", loop=future.get_loop(), future=future), control=True)
        except EngineDeadError:
            if self._thread is not None:
                self._thread.join(1.0)  # it is exiting; after that the engine is ours to read
                if self._thread.is_alive():  # hung in a step (see fail): the engine is not ours
                    raise
            return self._stats()
        return await future

    def request_timings(self, request_id: str) -> RequestTimings | None:
        """Timestamps of a request once it has produced an output (final after it finished;
        kept for the last `max_timings` requests); None if unknown. Thread-safe; for a finished
        request they are recorded before its final output is delivered."""
        return self._ledger.timings(request_id)

    def shutdown(self, timeout: float | None = None, *, abort: bool = True) -> bool:
        """Stop taking requests, end the loop and join the thread.

        Args:
          timeout: seconds to wait for the thread (None: as long as it takes).
          abort: abort in-flight requests (their streams end with "abort"); False finishes them
            first. A later call with abort=True cuts a slow drain short.
        Returns:
          True if the thread has ended. Blocking: from a coroutine use `asyncio.to_thread`.
        """
        with self._cond:
            if self._thread is not None and not self._stopped:
                self._closing = True
                self._commands.append(Command("stop", abort_all=abort))
                self._cond.notify()
        if self._thread is None:
            self._closing = self._stopped = True
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------------------ handover

    def _submit(self, command: Command, control: bool = False) -> None:
        with self._cond:
            if self._stopped or (self._closing and not control):
                raise self._dead_error()
            self._commands.append(command)
            if command.kind == "add":
                self._arrivals.on_add()
            self._cond.notify()

    def _dead_error(self) -> EngineDeadError:
        if self._error is not None:
            err = EngineDeadError(f"the engine loop died: {type(self._error).__name__}: {self._error}")
            err.__cause__ = self._error
            return err
        return EngineDeadError("the engine is shut down")

    # ------------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        busy, draining = False, False
        try:
            while True:
                with self._cond:
                    if not self._commands and not busy:
                        self._iteration_start = None
                    while not self._commands and not busy and not self._stopped:
                        self._cond.wait()
                    if self._stopped:  # fail() was called while a step hung
                        return
                    if not busy:  # from idle: requests still being read join this first step
                        self._arrivals.gather(self.gather_seconds)
                    commands = list(self._commands)
                    self._commands.clear()
                self._iteration_start = time.monotonic()
                self.num_loop_iterations += 1
                stop_now = False
                for command in commands:
                    if command.kind == "stop":
                        stop_now = stop_now or command.abort_all
                        draining = True
                    else:
                        self._apply(command)
                self._run_waiting()  # requests aborted meanwhile may have ended a drain
                if stop_now:
                    for rid in list(self._live):
                        self._abort(rid, None)
                    return
                busy = engine.has_unfinished_requests()
                if busy:
                    num_steps = engine.num_steps
                    self._dispatch(engine.step())
                    busy = engine.has_unfinished_requests()
                    self._run_waiting()
                    if busy and engine.num_steps == num_steps:
                        with self._cond:  # nothing ran (cannot happen today): do not spin hot
                            self._cond.wait(0.001)
                if draining and not busy:
                    return
        except BaseException as exc:  # noqa: BLE001 - every consumer must hear of it
            logger.exception("engine loop died")
            self._error = exc
        finally:
            self._close_loop()

    def _apply(self, command: Command) -> None:
        if self._take_call(command):  # update_weights, sleep, wake_up (AsyncWeightControl)
            return
        if command.kind == "add":
            rid = command.request_id
            try:
                self.engine.add_request(rid, *command.args, **command.kwargs)
            except Exception as exc:  # the request's own fault (ValueError) or its scoring pass
                post(command.loop, [(command.queue, exc)])
                return
            samples = command.args[1].num_samples
            self._live[rid] = _Live(command.queue, command.loop, requests_of(self.engine, rid, samples))
        elif command.kind == "abort":
            aborted = self._abort(command.request_id, command.queue)
            if command.future is not None:
                post(command.loop, [(command.future, aborted)])
        elif command.kind == "stats":
            post(command.loop, [(command.future, self._stats())])

    def _abort(self, request_id: str, only_queue: asyncio.Queue | None) -> bool:
        live = self._live.get(request_id)
        if live is None or (only_queue is not None and live.queue is not only_queue):
            return False  # finished, unknown, or the id now names a newer request
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._dispatch([out])
        else:
            self._live.pop(request_id, None)
        return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            self._ledger.count(out, first=not live.seen_first_output)
            if out.finished:
                del self._live[out.request_id]
            if out.finished or not live.seen_first_output:
                live.seen_first_output = True
                self._ledger.record(out.request_id, live.requests, out)
            by_loop.setdefault(live.loop, []).append((live.queue, out))
        for loop, batch in by_loop.items():
            if not post(loop, batch):  # the consumers' loop is closed: nobody will read these
                for _, out in batch:
                    if not out.finished:
                        self._abort(out.request_id, None)

    def _stats(self) -> dict[str, Any]:
        stats = dict(self.engine.stats())
        scheduler = getattr(self.engine, "scheduler", None)
        for name in ("num_waiting", "num_running"):
            if name not in stats and scheduler is not None:
                stats[name] = getattr(scheduler, name)
        stats.update(num_streams=len(self._live), num_loop_iterations=self.num_loop_iterations,
                     is_running=self.is_running, errored=self.errored, **self._ledger.totals())
        if self.lora_stats() is not None:
            stats["lora"] = self.lora_stats()
        return stats

    def _close_loop(self) -> None:
        """Last words of the engine thread: refuse new commands, then answer the queued ones."""
        with self._cond:
            self._stopped = self._closing = True
            leftover = self._leftover_calls() + list(self._commands)
            self._commands.clear()
        if self._error is not None:
            for rid, live in list(self._live.items()):
                post(live.loop, [(live.queue, self._dead_error())])
                try:  # best effort: give the pages back
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001
                    pass
            self._live.clear()
        for command in leftover:
            if command.kind == "add":
                post(command.loop, [(command.queue, self._dead_error())])
            elif command.future is not None:
                try:
                    if command.kind == "abort":
                        result = self._abort(command.request_id, None) if self._error is None else False
                    elif command.kind == "call":
                        result = self._dead_error()
                    else:
                        result = self._stats()
                except Exception as exc:  # noqa: BLE001
                    result = exc
                post(command.loop, [(command.future, result)])

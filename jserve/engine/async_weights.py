"""`AsyncLLMEngine`'s weight updates, sleep and wake: each runs on the engine thread between steps.

A call with the "drain" policy waits until no request is in flight: the thread keeps stepping the
running ones and holds requests that arrive meanwhile, then runs the call and admits them. The
"abort" policy's aborted requests end their streams with finish_reason "abort". See
`jserve.engine.sleep` for the policies.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from jserve.engine.handover import Command, post


class AsyncWeightControl:
    """Mixed into `AsyncLLMEngine` (which provides engine, _submit, _apply, _abort, _dispatch)."""

    _waiting: list  # calls that wait for the requests in flight (drain)
    _held: list  # requests that arrived while a call waits

    async def update_weights(self, params: Any, *, policy: str | None = None, donate: bool = False) -> dict:
        """`LLMEngine.update_weights` between steps; returns its timings."""
        policy_ = policy or self.engine.config.weight_update_policy

        def run(engine):  # after a drain nothing is in flight: "abort" then ends nothing
            self._dispatch(engine.update_weights(params, policy="continue" if policy_ == "continue" else "abort",
                                                 donate=donate))
            return dict(engine.last_weight_update)
        return await self.between_steps(run, drain=policy_ == "drain", policy=policy_)

    async def sleep(self, level: int = 1, *, policy: str | None = None) -> None:
        """`LLMEngine.sleep` between steps ("continue" drains)."""
        policy_ = policy or self.engine.config.weight_update_policy
        await self.between_steps(lambda engine: self._dispatch(engine.sleep(level, policy="abort")),
                                 drain=policy_ != "abort", policy=policy_)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        await self.between_steps(lambda engine: engine.wake_up(tags))

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (a plain read: any thread)."""
        return bool(getattr(self.engine, "sleep_level", 0))

    def sleep_state(self) -> dict:
        """What /is_sleeping reports (`jserve.engine.sleep.state`; plain reads: any thread)."""
        from jserve.engine.sleep import state

        return state(self.engine)

    @property
    def served_dtype(self) -> str:
        """The served weights' float dtype, what new weights are read in (also while asleep)."""
        return str(self.engine.runner.params["final_norm"].dtype)

    async def between_steps(self, fn: Callable[[Any], Any], *, drain: bool = False, policy: str = "abort") -> Any:
        """`fn(engine)` on the engine thread between steps (after the requests in flight finish
        when `drain`); its result, or its exception raised here."""
        from jserve.engine.weights import POLICIES

        if policy not in POLICIES:
            raise ValueError(f"weight update policy must be one of {POLICIES}, got {policy!r}")
        future = asyncio.get_running_loop().create_future()
        self._submit(Command("call", args=(fn, drain), loop=future.get_loop(), future=future), control=True)
        return await future

    # ------------------------------------------------------------------------------ engine thread

    def _take_call(self, command: Command) -> bool:
        """Run or queue a "call"; hold an "add" while a call waits. True if the command was taken."""
        if command.kind == "call":
            if command.args[1] and self.engine.has_unfinished_requests():
                self._waiting.append(command)
            else:
                self._run_call(command)
            return True
        if command.kind == "add" and self._waiting:
            self._held.append(command)
            return True
        return False

    def _run_waiting(self) -> None:
        """Once nothing is in flight: the calls that waited, then the requests held meanwhile."""
        if not self._waiting or self.engine.has_unfinished_requests():
            return
        waiting, self._waiting = self._waiting, []
        for command in waiting:
            self._run_call(command)
        held, self._held = self._held, []
        for command in held:
            self._apply(command)

    def _run_call(self, command: Command) -> None:
        try:
            result = command.args[0](self.engine)
        except Exception as exc:  # noqa: BLE001 - the caller's to handle (a ValueError naming the problem)
            result = exc
        post(command.loop, [(command.future, result)])

    def _leftover_calls(self) -> list[Command]:
        """At the loop's end: the commands still waiting (answered as the loop's leftovers)."""
        left = self._waiting + self._held
        self._waiting, self._held = [], []
        return left

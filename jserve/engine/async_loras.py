"""`AsyncLLMEngine`'s LoRA adapters: what a server reads and changes of the engine's `LoraManager`
(`jserve.engine.lora`), changes run on the engine thread between steps."""

from __future__ import annotations

from typing import Any

from jserve.core.lora_slots import LoRARequest


class AsyncLoraControl:
    """Mixed into `AsyncLLMEngine` (which provides engine and between_steps)."""

    @property
    def _loras(self) -> Any:
        """The engine's `LoraManager`; None without LoRA (an embedding engine has none at all)."""
        return getattr(self.engine, "lora", None)

    @property
    def lora_enabled(self) -> bool:
        return self._loras is not None

    def lora_adapters(self) -> list[LoRARequest]:
        """The adapters the engine knows (none without LoRA)."""
        return [] if self._loras is None else self._loras.known()

    def only_added_loras(self) -> None:
        """Requests may name only adapters added (`add_lora`), never bring one in themselves: a
        server's routes own the set, and a request parsed before an unload must not undo it."""
        if self._loras is not None:
            self._loras.add_on_request = False

    def read_lora(self, request: LoRARequest) -> dict:
        """The adapter read and checked, for `add_lora` (any thread: it touches no engine state)."""
        return self._loras.read(request)

    async def add_lora(self, request: LoRARequest, weights: dict | None = None) -> bool:
        """`LoraManager.add` between steps."""
        return await self.between_steps(lambda engine: engine.lora.add(request, weights=weights))

    async def remove_lora(self, name: str) -> None:
        """`LoraManager.remove` between steps (ValueError while a request names it)."""
        await self.between_steps(lambda engine: engine.lora.remove(name))

    def lora_stats(self) -> dict[str, Any] | None:
        """`LoraManager.stats` and the adapters waiting requests name (vLLM's lora_requests_info)."""
        lora = self._loras
        if lora is None:
            return None
        waiting = sorted({r.lora_name for r in self.engine.scheduler.waiting if r.lora_name})
        return dict(lora.stats(), waiting=waiting)

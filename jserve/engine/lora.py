"""The engine's LoRA adapters: which are known, read into host memory, and written into the
model's slots as the scheduler assigns them (`jserve.core.lora_slots`, `jserve.model.lora`).

An adapter is known by name once added (`add`, or the first request naming a `LoRARequest`);
adding reads and checks it against the model (`jserve.model.lora_adapters.load_adapter`), so a bad
adapter is refused then, not mid-serving. Read adapters stay in host memory up to
`max_cpu_loras` (least recently used dropped, read again from their path when next needed).
Before each step runs, the slots the scheduler assigned are written (`write_slots`).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from jserve.core.lora_slots import LoRARequest, LoraSlots
from jserve.model import lora as lora_model


class LoraManager:
    """Known adapters, their host copies and the slot assignments, for one engine."""

    def __init__(self, runner: Any, model_config: Any, max_cpu_loras: int | None,
                 in_use: Callable[[str], int]):
        """`model_config`: the checkpoint's config (adapters are read against it); `in_use(name)`:
        the unfinished requests that name an adapter (an adapter with any is not removed)."""
        self.runner = runner
        self.spec: lora_model.LoraSpec = runner.lora.spec
        self.model_config = model_config
        self.slots = LoraSlots(self.spec.max_loras)
        self.max_cpu_loras = max(max_cpu_loras or self.spec.max_loras, self.spec.max_loras)
        self.in_use = in_use
        self._known: dict[str, LoRARequest] = {}
        self._host: collections.OrderedDict[str, dict] = collections.OrderedDict()  # name -> slot arrays
        self.requests_total: collections.Counter[str] = collections.Counter()  # requests per adapter
        # A request may name an adapter not added yet (the offline API); the server turns this off,
        # so that a request parsed before its adapter was unloaded cannot bring it back.
        self.add_on_request = True

    def known(self) -> list[LoRARequest]:
        """The adapters added, in the order they were."""
        return list(self._known.values())

    def get(self, name: str) -> LoRARequest | None:
        return self._known.get(name)

    def add(self, request: LoRARequest, weights: dict | None = None) -> bool:
        """Know the adapter (reading and checking it now, unless `weights` are what `read` gave);
        False if it was known already with the same path and id. ValueError naming the problem:
        another adapter under its name, or one that does not fit the model."""
        old = self._known.get(request.lora_name)
        if old is not None:
            if (old.lora_path, old.lora_int_id) != (request.lora_path, request.lora_int_id):
                raise ValueError(f"LoRA adapter {request.lora_name!r} is already loaded from {old.lora_path!r} "
                                 f"(id {old.lora_int_id}): unload it first")
            return False
        clash = next((r for r in self._known.values() if r.lora_int_id == request.lora_int_id), None)
        if clash is not None:
            raise ValueError(f"lora_int_id {request.lora_int_id} is taken by adapter {clash.lora_name!r}")
        self._cache(request.lora_name, self._read(request) if weights is None else weights)
        self._known[request.lora_name] = request
        return True

    def remove(self, name: str) -> None:
        """Forget the adapter; ValueError if unknown or while a request names it."""
        if name not in self._known:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        busy = self.in_use(name)
        if busy or not self.slots.evict(name):
            raise ValueError(f"LoRA adapter {name!r} has {busy or 'running'} requests in flight: unload it "
                             f"when they finish")
        del self._known[name]
        self._host.pop(name, None)

    def resolve(self, request: LoRARequest | None) -> str | None:
        """The adapter name a new request runs with (added first if new); None: the base model."""
        if request is None:
            return None
        if not self.add_on_request and request.lora_name not in self._known:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is not loaded (it was unloaded)")
        self.add(request)
        self.requests_total[request.lora_name] += 1
        return request.lora_name

    def write_slots(self) -> None:
        """Write the adapters the scheduler put into slots since the last step."""
        for slot, name in self.slots.take_writes():
            weights = self._host.get(name)
            if weights is None:
                weights = self._read(self._known[name])
            self._cache(name, weights)
            self.runner.write_lora_slot(slot, weights)

    def read(self, request: LoRARequest) -> dict:
        """The adapter's slot arrays for `add`, read and checked; touches no engine state, so any
        thread may call it (the server reads off the engine thread)."""
        return self._read(request)

    def _read(self, request: LoRARequest) -> dict:
        """The adapter's slot arrays (`lora.slot_arrays`), read from its path and checked."""
        from jserve.model.lora_adapters import load_adapter

        adapter = load_adapter(request.lora_path, self.model_config, name=request.lora_name,
                               max_rank=self.spec.max_rank)
        try:
            return lora_model.slot_arrays(adapter.weights, self.model_config, self.spec)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {e}") from None

    def _cache(self, name: str, weights: dict) -> None:
        self._host[name] = weights
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        """For metrics: adapters known, resident (in a slot), running (pinned), slot loads, requests."""
        return {"loaded": len(self._known), "resident": self.slots.resident, "running": self.slots.running,
                "max_loras": self.spec.max_loras, "num_loads": self.slots.num_loads,
                "requests_total": dict(self.requests_total)}

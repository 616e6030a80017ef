"""Which LoRA adapter each of the model's slots holds (`jserve.model.lora`), for the scheduler.

A running request pins its adapter's slot; an adapter nobody runs stays resident until its slot
is needed (least recently released first), so requests for it later cost no load. A request
whose adapter has no slot, with every slot pinned, waits. The slots assigned since the last
`take_writes` are what the engine writes before the step runs. Pure Python.
"""

from __future__ import annotations

import collections
import dataclasses


class LoraSlots:
    """Slots 1 .. `max_loras` (0 is the base model) and the adapters in them, by name."""

    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self._slot_of: dict[str, int] = {}  # resident adapters
        self._pins: collections.Counter[str] = collections.Counter()  # running requests per adapter
        self._idle: collections.OrderedDict[str, None] = collections.OrderedDict()  # unpinned, oldest first
        self._writes: list[tuple[int, str]] = []
        self.num_loads = 0  # adapters written into a slot (the first time or after an eviction)

    @property
    def resident(self) -> dict[str, int]:
        """Adapter name -> its slot."""
        return dict(self._slot_of)

    @property
    def running(self) -> dict[str, int]:
        """Adapter name -> running requests that use it (pinned adapters only)."""
        return {name: n for name, n in self._pins.items() if n}

    def acquire(self, name: str) -> int | None:
        """The slot holding `name` for one more running request, loading it into a free slot or
        the least recently used idle one; None when every slot is pinned."""
        slot = self._slot_of.get(name)
        if slot is None:
            used = set(self._slot_of.values())
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if free:
                slot = free[0]
            elif self._idle:
                evicted, _ = self._idle.popitem(last=False)
                slot = self._slot_of.pop(evicted)
            else:
                return None
            self._slot_of[name] = slot
            self._writes.append((slot, name))
            self.num_loads += 1
        self._idle.pop(name, None)
        self._pins[name] += 1
        return slot

    def release(self, name: str) -> None:
        """One running request of `name` no longer needs its slot."""
        if self._pins[name] <= 0:
            raise ValueError(f"LoRA adapter {name!r} has no running request to release")
        self._pins[name] -= 1
        if not self._pins[name]:
            del self._pins[name]
            self._idle[name] = None

    def evict(self, name: str) -> bool:
        """Forget `name`'s slot (its adapter is being unloaded); False while a request runs with it."""
        if self._pins[name]:
            return False
        self._pins.pop(name, None)
        self._idle.pop(name, None)
        self._slot_of.pop(name, None)
        self._writes = [(s, n) for s, n in self._writes if n != name]
        return True

    def take_writes(self) -> list[tuple[int, str]]:
        """(slot, adapter name) assigned since the last call: to write before the next step runs."""
        writes, self._writes = self._writes, []
        return writes


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter a request runs with, by vLLM's names: `lora_name` (what requests call it),
    `lora_int_id` (a positive id), `lora_path` (a PEFT folder or a Hub id), and optionally the
    base model it was trained on (`/v1/models` lists it as the adapter's parent)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is empty")

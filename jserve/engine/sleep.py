"""Sleep and wake (vLLM's names), and what happens to requests in flight when weights change.

`sleep(engine, level)`: level 1 moves the weights to host memory (pinned host where the backend
has it) and frees the KV pages; level 2 frees the weights too (the next `update_weights`, or
`LLM.wake_up`'s reload, brings them back). `wake_up` puts them back in the shardings the steps
compiled for (`jserve.runtime.param_swap.Residency`): no step recompiles. The prefix cache is
dropped either way (the pages' contents are gone).

In-flight policy (`--weight-update-policy`): "drain" waits for the requests in flight to finish
(the `AsyncLLMEngine` holds new ones meanwhile; a bare `LLMEngine` with requests in flight
refuses), "abort" ends them (finish_reason "abort"), "continue" lets them finish on the new
weights: their earlier tokens came from the old ones (off-policy for a trainer's rollouts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from jserve.core.request import RequestOutput
from jserve.engine.weights import POLICIES
from jserve.runtime.param_swap import Residency

if TYPE_CHECKING:
    from jserve.engine.llm_engine import LLMEngine

TAGS = ("weights", "kv_cache")


def settle_in_flight(engine: "LLMEngine", policy: str, what: str) -> list[RequestOutput]:
    """Apply `policy` to the requests in flight before `what`; the aborted requests' outputs."""
    if policy not in POLICIES:
        raise ValueError(f"weight update policy must be one of {POLICIES}, got {policy!r}")
    request_ids = list(engine._groups)
    if not request_ids or policy == "continue":
        return []
    if policy == "drain":
        raise ValueError(f"{what}: {len(request_ids)} requests are in flight; policy 'drain' waits for them "
                         f"(AsyncLLMEngine does), or use 'abort' or 'continue'")
    return [out for rid in request_ids if (out := engine.abort_request(rid)) is not None]


def residencies(engine: "LLMEngine") -> list[Residency]:
    return [Residency.of(r) for r in (engine.runner, *engine.draft_runners())]


def sleep(engine: "LLMEngine", level: int, policy: str) -> list[RequestOutput]:
    """Free the pages and offload (level 1) or drop (level 2) the weights; "continue" drains
    (a request cannot go on without its pages). Returns the aborted requests' outputs."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (weights to host memory) or 2 (weights dropped), got {level!r}")
    aborted = settle_in_flight(engine, "drain" if policy == "continue" else policy, "sleep")
    engine.reset_prefix_cache()
    for residency in residencies(engine):
        residency.free_kv()
        residency.offload_params() if level == 1 else residency.drop_params()
    engine.sleep_level = level
    return aborted


def wake_up(engine: "LLMEngine", tags: Iterable[str] | None = None) -> None:
    """Bring back the weights and/or the KV pages (`tags`: "weights", "kv_cache"; None: both).
    ValueError if level 2 dropped the weights and none were given since (`update_weights`)."""
    tags = set(TAGS if tags is None else tags)
    unknown = sorted(tags - set(TAGS))
    if unknown:
        raise ValueError(f"wake_up tags must be among {TAGS}, got {unknown}")
    found = residencies(engine)
    if "weights" in tags:
        dropped = [r for r in found if r.params_state == "dropped"]
        if dropped:
            raise ValueError("sleep level 2 dropped the weights: give new ones (update_weights) before waking "
                             "(LLM.wake_up reloads the checkpoint)")
        for residency in found:
            residency.restore_params()
    if "kv_cache" in tags:
        for residency in found:
            residency.restore_kv()
    if all(r.serving for r in found):
        engine.sleep_level = 0


def state(engine: "LLMEngine") -> dict[str, Any]:
    """What /is_sleeping reports: the level, where the weights are, whether the pages exist."""
    main = Residency.of(engine.runner) if engine.sleep_level else None
    return {"is_sleeping": bool(engine.sleep_level), "level": engine.sleep_level,
            "weights": main.params_state if main else "device", "kv_cache": not (main and main.kv_free)}

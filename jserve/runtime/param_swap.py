"""A runner's weights and KV pages swapped or moved between steps without recompiling.

The compiled steps take `Runner.params` and `Runner.kv` as arguments, so arrays of the same tree,
shapes, dtypes and shardings run the same executables. `Residency` is the one place that swaps
them (`Runner.replace_params`), moves the weights to host memory and back, drops them, and frees
and re-creates the KV pages (`LLM.sleep` / `wake_up`). See docs/architecture.md ("Weights in
place, sleep and wake").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def abstract(tree: Any) -> Any:
    """The tree's `jax.ShapeDtypeStruct`s, each with its array's sharding and weak type."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None),
                                                       weak_type=getattr(x, "weak_type", False)), tree)


def check_like(spec: Any, new: Any, what: str = "params") -> None:
    """ValueError naming the first leaf of `new` whose place in the tree, shape, dtype or sharding
    differs from `spec`'s (what recompiles a step or breaks it)."""
    want, want_def = jax.tree_util.tree_flatten_with_path(spec)
    got, got_def = jax.tree_util.tree_flatten_with_path(new)
    if want_def != got_def:
        names = {jax.tree_util.keystr(p) for p, _ in want}
        given = {jax.tree_util.keystr(p) for p, _ in got}
        missing, extra = sorted(names - given), sorted(given - names)
        raise ValueError(f"new {what} differ from the served ones in structure: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}" if missing or extra else f"new {what}: another tree structure "
                         f"({got_def} for {want_def})")
    for (path, w), (_, g) in zip(want, got):
        name = jax.tree_util.keystr(path)
        if not isinstance(g, jax.Array):
            raise ValueError(f"new {what}{name}: a {type(g).__name__}, expected a jax.Array on the serving devices")
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            raise ValueError(f"new {what}{name}: {g.dtype}{list(g.shape)}, expected {w.dtype}{list(w.shape)}")
        if w.sharding is not None and g.sharding != w.sharding:
            raise ValueError(f"new {what}{name}: sharded as {g.sharding}, expected {w.sharding}")
        if getattr(g, "weak_type", False) != w.weak_type:
            raise ValueError(f"new {what}{name}: weak_type {g.weak_type}, expected {w.weak_type}")


def delete(tree: Any) -> None:
    """Free the device buffers of every array in `tree` now."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def device_bytes() -> int:
    """Bytes of the backend's live arrays in device memory (host-memory arrays not counted)."""
    total = 0
    for x in jax.live_arrays():
        if x.is_deleted() or getattr(x.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
            continue
        total += sum(s.data.nbytes for s in x.addressable_shards)
    return total


def _host_copy(x: jax.Array) -> Any:
    """`x` in pinned host memory where its devices have it, else a numpy copy."""
    kinds = {m.kind for d in x.sharding.device_set for m in d.addressable_memories()}
    if "pinned_host" in kinds:
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    return np.asarray(x)


class Residency:
    """Where a runner's weights and pages are: on the device (serving), weights on host (sleep
    level 1) or dropped (level 2), pages freed. Keeps the abstract trees the steps compiled for,
    against which every swap is checked and from which pages are re-created."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.params_spec = abstract(runner.params)
        self.kv_spec = abstract(runner.kv)
        self.host_params: Any = None  # the weights while asleep at level 1
        self.params_state = "device"  # "device" | "host" | "dropped"
        self.kv_free = False

    @classmethod
    def of(cls, runner: Any) -> "Residency":
        if getattr(runner, "_residency", None) is None:
            runner._residency = cls(runner)
        return runner._residency

    def replace_params(self, new: Any) -> None:
        """Swap in `new` (checked against the served params first); the old buffers are freed."""
        check_like(self.params_spec, new)
        old, self.runner.params = self.runner.params, new
        if self.params_state == "device":
            delete([leaf for leaf in jax.tree.leaves(old) if not any(leaf is n for n in jax.tree.leaves(new))])
        self.params_state, self.host_params = "device", None

    def offload_params(self) -> None:
        """The weights to host memory (level 1); their device buffers are freed."""
        if self.params_state != "device":
            return
        params = self.runner.params
        self.host_params = jax.tree.map(_host_copy, params)
        jax.block_until_ready([x for x in jax.tree.leaves(self.host_params) if isinstance(x, jax.Array)])
        delete(params)
        self.params_state = "host"

    def drop_params(self) -> None:
        """Free the weights (level 2): `replace_params` or a reload brings them back."""
        if self.params_state == "device":
            delete(self.runner.params)
        self.params_state, self.host_params = "dropped", None

    def restore_params(self) -> None:
        """Level 1's host copy back into the served shardings."""
        if self.params_state == "host":
            params = jax.tree.map(lambda h, s: jax.device_put(h, s.sharding), self.host_params, self.params_spec)
            self.runner.params = jax.block_until_ready(params)
            self.params_state, self.host_params = "device", None

    def free_kv(self) -> None:
        """Free the KV pages (their contents are lost: the engine drops its prefix cache)."""
        if not self.kv_free:
            delete(self.runner.kv)
            self.kv_free = True

    def restore_kv(self) -> None:
        """Zeroed pages of the served shapes, dtypes and shardings."""
        if self.kv_free:
            self.runner.kv = jax.block_until_ready(jax.tree.map(
                lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), self.kv_spec))
            self.kv_free = False

    @property
    def serving(self) -> bool:
        return self.params_state == "device" and not self.kv_free

"""The host KV tier's copies: device pages out to host slots and back (`jserve.core.kv_tier`
keeps the accounting).

The host tier is a preallocated numpy pool, per KV leaf `[slots, kv_heads, layers, page_size,
...]` (a slot holds one page of every layer, contiguous), in host memory or, with a directory (the
disk tier), memory-mapped from an unnamed file there: the kernel's page cache then holds the slots
used recently and writes the rest back to disk, so the pool may be larger than the host's memory.
A copy out is a jitted gather of a fixed batch of pages from `Runner.kv` into a new device array
(the staging buffer), whose transfer to the host starts at once (`copy_to_host_async`); `poll`
writes the copies that completed into their slots without waiting for the others, so a step never
waits for one. A reload stages the slots' pages in numpy and scatters them into the donated pages
(a jitted scatter of a fixed batch) before the step that reads them. Both shapes compile at
warm-up. Page p of data-parallel group g, layer i, is row `g * shard + i * pages_per_group + p` of
a leaf's page axis (a shard being the group's part of it, layers folded in on the XLA backend).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import tempfile
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_BATCH = 16  # pages per copy call


@dataclasses.dataclass
class _Copy:
    entries: list[tuple[int, int, int]]  # (group, device page, host slot) out, or (group, host slot, page) back
    staged: Any  # out: the gathered pages; back: the scatter's marker
    started: float
    bytes: int


class KVTransfer:
    """Copies between `runner.kv` and a host pool of `slots_per_group` pages per dp group."""

    def __init__(self, runner: Any, offload_bytes: int, directory: str | None = None):
        if getattr(runner, "hybrid", False):
            raise ValueError("the host KV tier (--kv-offload-bytes) does not take hybrid pages yet (two pools of "
                             "different sizes): build the runner without local_pages (--no-hybrid-pages)")
        self.runner = runner
        leaves = jax.tree.leaves(runner.kv)
        self.dp, self.group_pages = runner.dp, runner.pages_per_group
        self.shard = leaves[0].shape[1] // self.dp  # a group's rows of each leaf's page axis
        self.layers = self.shard // self.group_pages  # 1, or every layer (folded)
        self.page_bytes = sum(x.dtype.itemsize * x.size // x.shape[1] * self.layers for x in leaves)
        self.slots_per_group = offload_bytes // self.page_bytes // self.dp
        if self.slots_per_group < 1:
            raise ValueError(f"--kv-offload-bytes {offload_bytes} holds no KV page: a page of every layer is "
                             f"{self.page_bytes} bytes (per dp group: {self.dp})")
        self.batch = max(1, min(MAX_BATCH, self.group_pages // 8))
        self.staging_pages = 2 * self.batch  # per group, the pages copied out at once
        shapes = [((self.slots_per_group * self.dp, x.shape[0], self.layers, *x.shape[2:]), x.dtype) for x in leaves]
        if directory is None:
            self.host = [np.zeros(shape, dtype) for shape, dtype in shapes]
        else:
            self.host = [self._mapped(directory, shape, dtype) for shape, dtype in shapes]
        self._gather = jax.jit(_gather)
        kw = {}
        if runner.mesh is not None:
            replicated = jax.sharding.NamedSharding(runner.mesh, jax.sharding.PartitionSpec())
            kw["out_shardings"] = (jax.tree.map(lambda x: x.sharding, runner.kv), replicated)
        self._scatter = jax.jit(_scatter, donate_argnums=0, **kw)
        self._out: collections.deque[_Copy] = collections.deque()
        self._back: collections.deque[_Copy] = collections.deque()
        self.totals = collections.Counter()  # bytes and seconds both ways

    def _mapped(self, directory: str, shape: tuple, dtype) -> np.ndarray:
        """A zeroed [shape] array memory-mapped from an unnamed file in `directory` (sparse until
        written; the mapping holds the file, whose space is freed when the array goes)."""
        try:
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory, prefix="jserve-kv-") as f:
                return np.memmap(f, dtype=dtype, mode="w+", shape=shape)
        except OSError as e:
            raise ValueError(f"kv_offload_dir {directory!r}: cannot create the KV tier's file there ({e})") from e

    def _rows(self, groups: Sequence[int], pages: Sequence[int]) -> np.ndarray:
        """The page-axis rows of (group, page) pairs padded to the batch with group 0's null
        page: [batch * layers], page-major."""
        pad = self.batch - len(pages)
        g = np.asarray(list(groups) + [0] * pad, np.int32)[:, None]
        p = np.asarray(list(pages) + [0] * pad, np.int32)[:, None]
        return (g * self.shard + np.arange(self.layers, dtype=np.int32)[None] * self.group_pages + p).reshape(-1)

    def _dispatch(self, key: str, fn, *args):
        out, _ = self.runner.compiles.dispatched((key, self.batch), lambda: [fn], lambda: fn(*args))
        return out

    def offload(self, entries: Sequence[tuple[int, int, int]]) -> None:
        """Start copying (group, device page, host slot) out; `poll` says when each completed."""
        for i in range(0, len(entries), self.batch):
            chunk = list(entries[i:i + self.batch])
            t0 = time.perf_counter()
            staged = self._dispatch("kv_offload", self._gather, self.runner.kv,
                                    self._rows([e[0] for e in chunk], [e[1] for e in chunk]))
            for leaf in jax.tree.leaves(staged):
                leaf.copy_to_host_async()
            self._out.append(_Copy(chunk, staged, t0, len(chunk) * self.page_bytes))

    def reload(self, entries: Sequence[tuple[int, int, int]]) -> None:
        """Copy (group, host slot, device page) back into the pages, before the next step runs."""
        for i in range(0, len(entries), self.batch):
            chunk = list(entries[i:i + self.batch])
            t0 = time.perf_counter()
            slots = [g * self.slots_per_group + s for g, s, _ in chunk] + [0] * (self.batch - len(chunk))
            data = [np.ascontiguousarray(np.moveaxis(h[slots], 0, 1)).reshape(h.shape[1], -1, *h.shape[3:])
                    for h in self.host]
            rows = self._rows([e[0] for e in chunk], [e[2] for e in chunk])
            self.runner.kv, marker = self._dispatch("kv_reload", self._scatter, self.runner.kv, data, rows)
            self.totals["reload_host_seconds"] += time.perf_counter() - t0
            self._back.append(_Copy(chunk, marker, t0, len(chunk) * self.page_bytes))

    def poll(self, wait: bool = False) -> list[tuple[int, int, int]]:
        """The copies out that completed (all of them with `wait`), in the order they started,
        written into their host slots now."""
        done = []
        while self._out and (wait or all(x.is_ready() for x in jax.tree.leaves(self._out[0].staged))):
            copy = self._out.popleft()
            pages = [np.asarray(x) for x in jax.tree.leaves(copy.staged)]
            slots = [g * self.slots_per_group + s for g, _, s in copy.entries]
            for host, x in zip(self.host, pages):
                x = x.reshape(x.shape[0], self.batch, self.layers, *x.shape[2:])
                host[slots] = np.moveaxis(x[:, :len(slots)], 1, 0)
            self._count("offload", copy)
            done.extend(copy.entries)
        while self._back and (wait or self._back[0].staged.is_ready()):
            self._count("reload", self._back.popleft())
        return done

    def _count(self, way: str, copy: _Copy) -> None:
        """A completed copy's bytes and time: from its start until `poll` saw it done (an upper
        bound, as polls come once a step)."""
        self.totals[f"{way}_bytes"] += copy.bytes
        self.totals[f"{way}_seconds"] += time.perf_counter() - copy.started

    @property
    def in_flight(self) -> int:
        return len(self._out)

    def warmup(self) -> None:
        """Compile both copies on the null page (its contents are never read)."""
        self.offload([(0, 0, 0)])
        self._out.clear()
        self.reload([(0, 0, 0)])
        jax.block_until_ready(self.runner.kv)
        self._back.clear()


def _gather(kv, rows):
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=1), kv)


def _scatter(kv, data, rows):
    leaves, treedef = jax.tree.flatten(kv)
    new = [x.at[:, rows].set(d.astype(x.dtype)) for x, d in zip(leaves, data)]
    # A small output of the same program: ready once the scatter ran (the pages themselves are donated on).
    return jax.tree.unflatten(treedef, new), functools.reduce(jnp.add, [jnp.sum(d[:1, :1].astype(jnp.float32))
                                                                       for d in data])

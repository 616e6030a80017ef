"""Attention over the paged KV cache: the engine's backend for `LlamaModel`.

A step feeds `tokens` new tokens for each of `batch` rows; their K/V go to the slots in
`PagedMeta.slots` (padding points into the null page 0), then the queries attend over the row's
pages with the Pallas kernels (`pallas_kernels.paged_attention`) on the backend's kernel; the
cache's layout is the backend's choice (`PagedAttention.kv_layout`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jserve.runtime.kv_cache import KV_LAYOUTS, write_kv

# Imported here, not on first use: importing Pallas registers JAX config options, which change the
# tracing context, so a step first traced before the import would be compiled a second time later.
from pallas_kernels.paged_attention import paged_attention, paged_prefill_attention, ragged_paged_attention


class PagedMeta(NamedTuple):
    """Per-step arrays (all int32) that tell the attention where each row's tokens live."""

    slots: jax.Array  # [batch * tokens]: page * page_size + offset of each new token
    q_start: jax.Array  # [batch]: position of the row's first new token (= tokens already cached)
    q_lens: jax.Array  # [batch]: real new tokens of the row (0 for a padded row)
    page_indices: jax.Array  # [batch, max_pages]: the row's pages; padding -> page 0
    # Hybrid pages (`jserve.core.hybrid_pages`): the sliding layers' slots and pages (None: none).
    local_slots: jax.Array | None = None
    local_page_indices: jax.Array | None = None


class RaggedMeta(NamedTuple):
    """A mixed step's arrays (all int32, `jserve.runtime.step_rows.pack_ragged`): per data-parallel
    group g, its rows' new tokens flattened in token block g of `tokens [groups, num_tokens]`;
    every per-row array is the groups' blocks concatenated (split by `dp` on a mesh). The kernel is
    `pallas_kernels.paged_attention.ragged_paged_attention`: decode rows and prefill chunks of any
    lengths in one call."""

    slots: jax.Array  # [groups * num_tokens]: each token's K/V slot; padding -> the null page
    kv_lens: jax.Array  # [groups * rows]: a row's length, its new tokens included (0: padding)
    page_indices: jax.Array  # [groups * rows, max_pages]
    cu_q_lens: jax.Array  # [groups * (rows + 1)]: a group's rows' bounds in its token block
    num_rows: jax.Array  # [groups]: live rows per group
    local_slots: jax.Array | None = None  # hybrid pages: as `PagedMeta`'s
    local_page_indices: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """Callable attention over paged K/V (see `jserve.model.llama.Attention`).

    `kv_layout` "per_layer": the cache is one `(k_pages, v_pages)` pair per layer, each
    `[num_kv_heads, num_pages, page_size, head_dim]`, indexed by a static layer number.
    "folded": one pair for all layers, `[num_kv_heads, num_layers * num_pages, page_size,
    head_dim]`, layer i's pages at offset `i * num_pages` (per data-parallel group's block): a
    traced layer index (a scanned stack) addresses its pages by adding the offset to the page
    table and slots, so no layer's pages are ever sliced out or copied, and every kernel reads
    them as it reads one layer's.

    A quantized cache's entries are `(k_pages, v_pages, k_scales, v_scales)` (int8 or
    float8_e4m3fn codes; float32 scales [num_kv_heads, pages, page_size], folded alike, with the
    pages' partition spec less its head_dim entry): new K/V are quantized as they are written
    and every kernel reads the codes with their scales.

    Hybrid pages (`local_pages`, `jserve.core.hybrid_pages`): the sliding layers' K/V live in
    pages of their own, `local_pages` per layer (per dp group; `pages_per_group` the full
    layers'), written and read through the meta's `local_slots` and `local_page_indices`; a
    folded cache stacks each layer's block of its kind's size, in layer order (`layer_kinds`: each
    layer's sliding flag).
    """

    kernel: str = "cpu"  # the paged-attention kernel (`pallas_kernels.paged_attention.BACKENDS`)
    sliding_window: int | None = None
    mesh: Any = None  # a ('dp', 'tp') jax.sharding.Mesh: run per device on its heads and pages
    kv_layout: str = "per_layer"
    num_layers: int = 1  # for the folded layout
    batch_invariant: bool = False  # the kernel's batch-invariant mode (`ops.paged_attention`'s `_attend`)
    local_pages: int | None = None  # hybrid pages: each sliding layer's pages per dp group
    pages_per_group: int = 0  # with local_pages: each full layer's pages per dp group
    layer_kinds: tuple[bool, ...] = ()  # with local_pages: whether each layer slides

    def __post_init__(self):
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")

    def __call__(self, layer, q, k, v, cache, meta: PagedMeta, spec=None):
        """`spec` (`jserve.model.llama.AttentionSpec`): the layer's scale, window and soft cap,
        static; None: head_dim ** -0.5, this attention's `sliding_window`, no cap."""
        entry = cache if self.kv_layout == "folded" else cache[layer]  # (k, v[, k_scales, v_scales])
        local = functools.partial(self._local, layer, spec)
        if self.mesh is None:
            out, *entry = local(q, k, v, meta, *entry)
        else:
            # Each device holds its tp share of heads and its dp group's pages and rows: the
            # kernel runs on those alone (page ids and slots in `meta` are group-local).
            from jax.sharding import PartitionSpec as P

            from jserve.runtime.sharding import KV_PAGES_SPEC

            heads, rows = P("dp", None, "tp", None), P("dp")
            specs = (P(*KV_PAGES_SPEC),) * 2 + (P(*KV_PAGES_SPEC[:3]),) * (len(entry) - 2)
            hybrid = (P("dp"), P("dp", None)) if meta.local_slots is not None else (None, None)
            if isinstance(meta, RaggedMeta):
                meta_spec = RaggedMeta(rows, rows, P("dp", None), rows, rows, *hybrid)
            else:
                meta_spec = PagedMeta(P("dp"), rows, rows, P("dp", None), *hybrid)
            out, *entry = jax.shard_map(
                local, mesh=self.mesh, in_specs=(heads, heads, heads, meta_spec, *specs),
                out_specs=(heads, *specs), check_vma=False)(q, k, v, meta, *entry)
        entry = tuple(entry)
        if self.kv_layout == "folded":
            return out, entry
        return out, cache[:layer] + (entry,) + cache[layer + 1:]

    def _local(self, layer, spec, q, k, v, meta: PagedMeta | RaggedMeta, k_pages, v_pages, *scales):
        B, T, H, D = q.shape
        if self.local_pages is not None:
            if spec is None:
                raise ValueError("hybrid pages need each layer's AttentionSpec (its window picks its pages)")
            if spec.sliding_window is not None:  # static: the layer's kind
                meta = meta._replace(slots=meta.local_slots, page_indices=meta.local_page_indices)
        if self.kv_layout == "folded":  # this layer's block of pages (and of their scales)
            offset = layer * (k_pages.shape[1] // self.num_layers) if self.local_pages is None else self._offset(layer)
            meta = meta._replace(slots=meta.slots + offset * k_pages.shape[2],
                                 page_indices=meta.page_indices + offset)
        K = k.shape[2]
        entry = write_kv(k_pages, v_pages, k.reshape(B * T, K, D), v.reshape(B * T, K, D), meta.slots, *scales)
        k_pages, v_pages, *scales = entry
        if spec is None:
            kw = dict(backend=self.kernel, sm_scale=D ** -0.5, sliding_window=self.sliding_window)
        else:
            kw = dict(backend=self.kernel, sm_scale=spec.sm_scale, sliding_window=spec.sliding_window,
                      soft_cap=spec.soft_cap)
        if scales:
            kw.update(k_scales=scales[0], v_scales=scales[1])
        if self.batch_invariant:
            kw.update(batch_invariant=True)
        if isinstance(meta, RaggedMeta):  # one group's block of tokens (per device on a mesh)
            if B != 1:
                raise ValueError(f"a mixed step runs one data-parallel group's tokens per device, got {B} groups "
                                 "in one call: this attention has no mesh (build the backend with the runner's "
                                 "mesh, or give it by name)")
            out = ragged_paged_attention(q[0], k_pages, v_pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens,
                                         meta.num_rows, **kw)[None]
        elif T == 1:  # decode: the query sits at the last cached position
            lengths = (meta.q_start + meta.q_lens) * (meta.q_lens > 0)
            out = paged_attention(q[:, 0], k_pages, v_pages, lengths, meta.page_indices, **kw)[:, None]
        else:
            out = paged_prefill_attention(q, k_pages, v_pages, meta.q_start, meta.q_lens,
                                          meta.page_indices, **kw)
        return (out, *entry)

    def _offset(self, layer):
        """Hybrid pages, folded: where layer `layer`'s block starts (an int, or traced)."""
        sizes = [self.local_pages if sliding else self.pages_per_group for sliding in self.layer_kinds]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return starts[layer] if isinstance(layer, int) else jnp.asarray(starts, jnp.int32)[layer]


def local_pages_per_group(config, local_pages: int | None, dp: int) -> int | None:
    """The sliding layers' pages per dp group for hybrid pages (None: none), checked."""
    if local_pages is None:
        return None
    if not config.mixed_layers or local_pages % dp or local_pages < 2 * dp:
        raise ValueError(f"local_pages={local_pages}: hybrid pages need a model with sliding and full layers "
                         f"(mixed_layers={config.mixed_layers}) and at least 2 pages per dp group, a multiple of "
                         f"dp ({dp})")
    return local_pages // dp


def with_local_pages(ops, config, pages_per_group: int, local_pages: int):
    """`ops` whose paged attention reads the sliding layers' own pages (hybrid pages)."""
    kinds = tuple(config.layer_is_sliding(i) for i in range(config.num_layers))
    return ops.with_attention(dataclasses.replace(ops.attention, local_pages=local_pages,
                                                  pages_per_group=pages_per_group, layer_kinds=kinds))

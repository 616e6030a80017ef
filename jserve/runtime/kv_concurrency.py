"""How many sequences of a context fit in a pool of KV pages under each page-keeping rule, for
`jserve plan`: every page kept; sliding layers keeping only a window's pages (what the page table
does where every layer shares the window; for Gemma's interleaved layers, the bound of one pool
shared by both kinds, and what the engine's hybrid pages, two pools split by `split_pages`, hold);
prefixes kept hittable with the window rule and with a host KV tier behind the pool."""

from __future__ import annotations

import dataclasses

from jserve.core.hybrid_pages import split_pages
from jserve.model.config import ModelConfig


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Concurrency:
    """Per-sequence page counts and the pool's pages (the null page excluded)."""

    context: int
    page_size: int
    pages: int  # the device pool's usable pages
    host_pages: int  # the host tier's pages (0: none)
    full_pages: int  # a sequence of `context` tokens, every page kept
    num_layers: int
    sliding_layers: int
    window: int | None
    window_pages: int  # a sliding layer's pages: its window and one prefill chunk (vLLM's bound)
    hit_pages: int  # the pages of a cached prefix of `context` tokens a hit needs

    @property
    def every_page(self) -> int:
        """Running sequences when every layer keeps every page."""
        return self.pages // self.full_pages

    @property
    def window_rule(self) -> int:
        """Running sequences when sliding layers keep only `window_pages` (counted in layer-pages:
        a full layer's page is `1 / num_layers` of a page that holds every layer)."""
        full_layers = self.num_layers - self.sliding_layers
        per_sequence = full_layers * self.full_pages + self.sliding_layers * self.window_pages
        return self.pages * self.num_layers // per_sequence

    def hybrid(self, max_num_batched_tokens: int) -> tuple[int, int, int] | None:
        """`(sequences, full_pages, sliding_pages)` with the engine's hybrid pages: the pool split
        between a full and a sliding pool (`jserve.core.hybrid_pages.split_pages`, the pools' pages
        with their null page); None where the engine keeps one pool."""
        if self.window is None or not 0 < self.sliding_layers < self.num_layers:
            return None
        split = split_pages(self.pages + 1, num_layers=self.num_layers, sliding_layers=self.sliding_layers,
                            page_size=self.page_size, context=self.context, window=self.window,
                            max_chunk=max_num_batched_tokens)
        if split is None:
            return None
        full, local = split
        return min((full - 1) // self.full_pages, (local - 1) // self.window_pages), full, local

    @property
    def shared_window(self) -> bool:
        return self.window is not None and self.sliding_layers == self.num_layers

    def prefixes_kept(self, *, host: bool = False, window_rule: bool = True) -> int:
        """Cached prefixes of `context` tokens the pool (and the host tier) can keep hittable, at most."""
        per_prefix = self.hit_pages if window_rule else self.full_pages
        return (self.pages + (self.host_pages if host else 0)) // per_prefix


def concurrency(config: ModelConfig, *, context: int, page_size: int, num_pages: int,
                max_num_batched_tokens: int, host_bytes: int = 0, host_page_bytes: int = 1) -> Concurrency:
    """`num_pages` as `plan_memory` counts them (the null page included); `host_bytes` the host
    tier's bytes for this pool, `host_page_bytes` what one page takes there."""
    full = _cdiv(context, page_size)
    window = config.sliding_window
    sliding = sum(config.layer_is_sliding(i) for i in range(config.num_layers)) if window else 0
    win = full
    if window:
        win = min(full, _cdiv(window - 1 + max_num_batched_tokens, page_size) + 1)  # PageTable.window_pages
    # A hit of L tokens needs the pages of keys L - window + 1 .. L - 1 (PageTable's window rule).
    shared = config.shared_window
    hit = min(full, max(1, _cdiv(shared - 1, page_size))) if shared else full
    return Concurrency(context=context, page_size=page_size, pages=max(num_pages - 1, 0),
                       host_pages=host_bytes // host_page_bytes, full_pages=full, num_layers=config.num_layers,
                       sliding_layers=sliding, window=window, window_pages=win, hit_pages=hit)

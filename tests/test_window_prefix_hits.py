"""Prefix hits past a sliding window every layer shares (`PageTable(sliding_window=)` with prefix
caching): a hit needs only the pages inside the last window of the cached prefix (vLLM's rule), so
evicted early pages do not prevent it; the pages before the window are the null page."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arch_helpers import IdTokenizer, finish, load_arch
from jserve.core.page_pool import NULL_PAGE
from jserve.core.page_table import PageTable
from jserve.core.request import SamplingParams
from jserve.engine.build import build_engine
from jserve.engine.config import EngineConfig


def _compute(pt: PageTable, rid, tokens) -> int:
    hit = pt.allocate_prompt(rid, tokens)
    assert hit is not None
    pt.mark_computed(rid, len(tokens) - hit)
    pt.check_invariants()
    return hit


def _cached(pt: PageTable, page: int) -> bool:
    return page != NULL_PAGE and pt.pool.page_hash(page) is not None


def test_a_hit_survives_the_eviction_of_its_early_pages():
    """Window 6, pages of 2: a query at 12 reads keys 7..12, so a 12-token hit needs pages 3 to 5
    (keys 6..11). Computed a token at a time, the first request gave pages 0..3 back in order,
    so they are evicted first."""
    pt = PageTable(16, 2, enable_prefix_caching=True, sliding_window=6)
    prompt = list(range(13))
    assert pt.allocate_prompt("a", prompt, num_new_tokens=1) == 0
    for _ in prompt[1:]:
        pt.mark_computed("a", 1)
        assert pt.allocate_slots("a", 1)
    pt.mark_computed("a", 1)
    pages = [pt.pool.cached_page(h) for h in pt._seqs["a"].page_hashes]
    pt.free("a")
    assert pt.pool.evict(3) == 3 and not any(_cached(pt, p) for p in pages[:3])
    assert pt.lookup_prefix(prompt) == 12  # from the first page on, nothing is cached
    released = pt.num_window_released_pages
    assert pt.allocate_prompt("b", prompt) == 12
    assert pt.page_ids("b")[:6] == [NULL_PAGE] * 3 + pages[3:6]
    pt.mark_computed("b", 1)  # the query at 12 done, page 3 is behind the window too
    pt.check_invariants()
    assert pt.page_ids("b")[:6] == [NULL_PAGE] * 4 + pages[4:6]
    assert pt.num_prefix_hit_tokens == 12 and pt.num_window_released_pages == released + 1
    pt.free("b")
    pt.check_invariants()
    assert pt.pool.num_used_pages == 0
    assert pt.pool.evict(1) == 1 and not _cached(pt, pages[3])  # page 3 gone: no 3 pages in a row
    assert pt.lookup_prefix(prompt) == 0


def test_a_prefix_shorter_than_the_window_needs_every_page():
    """Window 8, pages of 2: a hit of at most 6 tokens is read whole by its next query."""
    pt = PageTable(16, 2, enable_prefix_caching=True, sliding_window=8)
    _compute(pt, "a", list(range(7)))
    pages = [pt.pool.cached_page(h) for h in pt._seqs["a"].page_hashes]
    pt.free("a")
    assert pt.lookup_prefix(list(range(9))) == 6
    for page in pages[1:]:  # page 0 becomes the least recently used
        pt.pool.share(page)
        pt.pool.release([page])
    assert pt.pool.evict(1) == 1 and not _cached(pt, pages[0])
    assert pt.lookup_prefix(list(range(9))) == 0


def _reference_hit(cached: list[bool], window: int, page_size: int) -> int:
    """The longest L (whole pages) whose first query, at L, finds every key it reads cached: keys
    L - window + 1 .. L - 1, and at least the last page."""
    for num_pages in range(len(cached), 0, -1):
        first_key = max(0, min(num_pages * page_size - window + 1, (num_pages - 1) * page_size))
        if all(cached[first_key // page_size:num_pages]):
            return num_pages * page_size
    return 0


@settings(max_examples=80, deadline=None)
@given(window=st.integers(1, 12), page_size=st.integers(1, 4), prompt_len=st.integers(1, 30),
       data=st.data())
def test_the_hit_is_the_longest_whose_window_is_cached(window, page_size, prompt_len, data):
    pt = PageTable(48, page_size, enable_prefix_caching=True, sliding_window=window)
    prompt = list(range(prompt_len))
    _compute(pt, "a", prompt)
    pages = [pt.pool.cached_page(h) for h in pt._seqs["a"].page_hashes]
    pt.free("a")
    # Any LRU order (a share and release makes a page the most recent), then evict the oldest.
    for i in data.draw(st.permutations(range(len(pages)))):
        pt.pool.share(pages[i])
        pt.pool.release([pages[i]])
    pt.pool.evict(data.draw(st.integers(0, len(pages))))
    cached = [_cached(pt, p) for p in pages][:(prompt_len - 1) // page_size]
    hit = pt.lookup_prefix(prompt)
    assert hit == _reference_hit(cached, window, page_size)
    contiguous = next((i for i, c in enumerate(cached) if not c), len(cached))
    assert hit >= contiguous * page_size  # never shorter than the hit from the first page
    assert _compute(pt, "b", prompt) == hit
    ids = pt.page_ids("b")
    for i in range(hit // page_size):
        assert ids[i] == (pages[i] if i >= pt._seqs["b"].num_released else NULL_PAGE)
    pt.append_tokens("b", [prompt_len])
    assert pt.allocate_slots("b", 1)
    pt.mark_computed("b", 1)
    pt.check_invariants()
    pt.free("b")
    pt.check_invariants()
    assert pt.pool.num_used_pages == 0


def _run(engine, rid, prompt) -> list[int]:
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return list(finish(engine, engine.page_table.check_invariants)[rid].outputs[0].token_ids)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_engine_hit_past_the_window_gives_the_uncached_tokens(backend):
    """The tiny Mistral (window 8, pages of 4): a 26-token prompt's second run, after its first
    four pages were evicted, hits 24 tokens (pages 4 and 5 hold keys 17..23) and samples what an
    engine without a prefix cache samples."""
    config, params = load_arch("mistral")
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, config.vocab_size, 26)]
    settings_ = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, page_size=4, num_pages=16,
                     backend=backend, warmup=False)
    plain = build_engine(config, params, IdTokenizer(), [], EngineConfig(**settings_))
    expected = _run(plain, "x", prompt)
    engine = build_engine(config, params, IdTokenizer(), [], EngineConfig(**settings_, enable_prefix_caching=True))
    assert _run(engine, "a", prompt) == expected
    assert engine.page_table.pool.evict(4) == 4  # pages 0..3: given back first behind the window
    assert engine.page_table.lookup_prefix(prompt) == 24
    assert _run(engine, "b", prompt) == expected
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 24 and stats["pages_in_use"] == 0
    assert finish(engine) == {}


def test_engine_preempted_requests_recompute_through_hits_past_the_window():
    """Four prompts of 26 tokens sharing their first 24, chunks of 8, in 8 usable pages of 4: they
    preempt each other, and admissions hit past pages already evicted; each request's tokens
    stay an uncached engine's."""
    config, params = load_arch("mistral")
    rng = np.random.default_rng(2)
    common = [int(t) for t in rng.integers(3, config.vocab_size, 24)]
    prompts = [common + [int(t) for t in rng.integers(3, config.vocab_size, 2)] for _ in range(4)]
    settings_ = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, page_size=4, num_pages=9,
                     backend="cpu", warmup=False)
    plain = build_engine(config, params, IdTokenizer(), [], EngineConfig(**settings_))
    expected = [_run(plain, f"x{i}", p) for i, p in enumerate(prompts)]
    engine = build_engine(config, params, IdTokenizer(), [], EngineConfig(**settings_, enable_prefix_caching=True))
    pt, past_evicted = engine.page_table, []
    admit = pt.allocate_prompt

    def allocate_prompt(request_id, token_ids, **kw):  # counts hits whose early pages were evicted
        hit = admit(request_id, token_ids, **kw)
        seq = pt._seqs.get(request_id)
        if hit and any(pt.pool.cached_page(h) is None for h in seq.page_hashes[:seq.num_released]):
            past_evicted.append(hit)
        return hit

    pt.allocate_prompt = allocate_prompt
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outs = finish(engine, pt.check_invariants)
    assert [list(outs[str(i)].outputs[0].token_ids) for i in range(4)] == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] >= 3 * 24
    # A re-admitted request (prompt + output: more than 26 tokens) hit past its evicted pages.
    assert any(hit > 24 for hit in past_evicted), past_evicted
    assert stats["pages_in_use"] == 0

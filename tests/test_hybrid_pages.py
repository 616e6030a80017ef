"""Hybrid pages (`jserve.core.hybrid_pages`): Gemma's sliding layers keep their K/V in pages of
their own, given back behind the window, while the full layers keep every page. The engine's
tokens stay transformers' (the tiny Gemma 2 and Gemma 3 goldens: window 8, pages of 4) through
chunked prefill, preemption and prefix caching, on the native (per-layer pages) and the XLA
(folded pages, scanned stack) backends; a long sequence holds about a window of sliding pages;
the two tables' accounting loses no page."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arch_helpers import IdTokenizer, finish, load_arch
from conftest import DATA
from jserve.core.hybrid_pages import HybridPageTable, split_pages
from jserve.core.page_pool import NULL_PAGE
from jserve.core.request import SamplingParams
from jserve.engine.build import build_engine
from jserve.engine.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _engine(arch, backend="cpu", **kw):
    config, params = load_arch(arch)
    settings = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=4, page_size=4, num_pages=12,
                    backend=backend, warmup=False, enable_prefix_caching=False)
    return build_engine(config, params, IdTokenizer(), [], EngineConfig(**{**settings, **kw}))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("backend, prefix_caching", [("cpu", False), ("reference", True), ("cpu", True)])
def test_greedy_with_chunks_and_preemption_matches_transformers(arch, backend, prefix_caching):
    """Six requests for the reference prompt (10 tokens and 8 greedy ones: the last query reads
    keys 10..17, so the sliding layers give pages 0 and 1 back), up to four at a time in chunks of
    4 over a pool a third of them fit: some are preempted and recomputed (with prefix caching,
    from the prompt's cached pages)."""
    engine = _engine(arch, backend, enable_prefix_caching=prefix_caching)
    table = engine.page_table
    assert engine.runner.hybrid and isinstance(table, HybridPageTable)
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    prompt = [int(t) for t in ref["input_ids"][0, :10]]
    for i in range(6):
        engine.add_request(str(i), prompt, GREEDY)
    outs = finish(engine, table.check_invariants)
    for i in range(6):
        assert list(outs[str(i)].outputs[0].token_ids) == ref["greedy_ids"][0].tolist(), i
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["pages_in_use"] == 0
    assert stats["pages_released_behind_window"] >= 6 * 2  # the sliding layers' pages 0 and 1, each
    assert table.local.pool.num_used_pages == 0
    if prefix_caching:
        assert stats["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_prompt_logprobs_past_the_window_match_transformers(arch):
    """The 24-token reference input in chunks of 4 (the window spans three pages): every
    position's top logprob is transformers', the sliding layers having given pages back."""
    import jax
    import jax.numpy as jnp

    engine = _engine(arch, "reference")
    ref = np.load(DATA / "arch" / arch / "reference.npz")
    ids = [int(t) for t in ref["input_ids"][0]]
    engine.add_request("a", ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    got = finish(engine)["a"].prompt_logprobs
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(ref["logits"][0]), axis=-1))
    diffs = [abs(entry[ids[q + 1]].logprob - want[q][ids[q + 1]]) for q, entry in enumerate(got[1:])]
    assert max(diffs) < 1e-4
    assert engine.page_table.num_window_released_pages >= 3


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_long_sequence_holds_a_window_of_sliding_pages(backend):
    """A 40-token prompt and 16 greedy tokens, alone: the sliding pool never holds more than
    `window_pages` (cdiv(8 - 1 + 4, 4) + 1 = 4) pages while the full pool holds every page; the
    tokens are the one-pool engine's (tests/test_gemma.py checks that one against transformers),
    as they are with multi-step decode."""
    config, _ = load_arch("gemma3")
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, config.vocab_size, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = _engine("gemma3", backend, num_pages=32, hybrid_pages=False)
    assert not one.runner.hybrid
    one.add_request("a", prompt, params)
    want = list(finish(one)["a"].outputs[0].token_ids)
    for steps in (1, 4):
        engine = _engine("gemma3", backend, num_pages=32, num_scheduler_steps=steps)
        table = engine.page_table
        bound = table.local.window_pages(4)
        assert bound == 4
        engine.add_request("a", prompt, params)
        most = [0, 0]

        def check():
            table.check_invariants()
            if "a" in table:
                most[0] = max(most[0], table.local.pool.num_used_pages)
                most[1] = max(most[1], table.pool.num_used_pages)
                assert table.local_page_ids("a")[:5] == [NULL_PAGE] * 5 or table.num_computed_tokens("a") < 28

        got = list(finish(engine, check)["a"].outputs[0].token_ids)
        assert got == want, steps
        assert most[0] <= bound + (steps - 1 + 3) // 4  # a multi-step decode's lookahead page
        assert most[1] >= 13  # the full layers kept every page (49 tokens or more)


def test_prefix_hit_past_the_window_with_the_sliding_pages_evicted():
    """The sliding table keeps only a window of the first request's pages hittable once their
    early pages are evicted: the second request's hit is the longest prefix both tables allow,
    and its tokens are those of a run without prefix caching."""
    config, _ = load_arch("gemma2")
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, config.vocab_size, 30)]
    runs = {}
    for caching in (False, True):
        engine = _engine("gemma2", "cpu", enable_prefix_caching=caching, num_pages=40, max_num_seqs=1)
        outs = {}
        for rid in ("a", "b"):
            engine.add_request(rid, prompt, GREEDY)
            outs.update(finish(engine, engine.page_table.check_invariants))
            if caching and rid == "a":
                table = engine.page_table
                assert table.local.pool.evict(2) == 2  # the sliding layers' two earliest pages
                assert table.lookup_prefix(prompt) == 28  # the full table's 7 pages; the window's are cached
        runs[caching] = [list(outs[r].outputs[0].token_ids) for r in ("a", "b")]
    assert runs[True] == runs[False]
    assert runs[True][0] == runs[True][1]


def test_split_pages_holds_as_many_long_sequences_in_no_more_memory():
    """Gemma 3 270M's shape (18 layers, 15 sliding, window 512), pages of 16, chunks of 2048:
    the two pools take no more layer-pages than one pool, hold the same number of 8k-token
    sequences, and more than one pool does."""
    num_pages = 10_000
    glob, local = split_pages(num_pages, num_layers=18, sliding_layers=15, page_size=16, context=8192,
                              window=512, max_chunk=2048)
    assert 3 * glob + 15 * local <= 18 * num_pages
    full, win = 512, (511 + 2048 + 15) // 16 + 1
    assert (glob - 1) // full == (local - 1) // win > (num_pages - 1) // full
    assert split_pages(num_pages, num_layers=18, sliding_layers=15, page_size=16, context=512, window=512,
                       max_chunk=2048) is None  # a window as long as the context: nothing to give back
    assert split_pages(num_pages, num_layers=18, sliding_layers=0, page_size=16, context=8192, window=512,
                       max_chunk=2048) is None


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "step", "free", "evict"]), st.integers(0, 5),
                              st.integers(1, 30)), max_size=60),
       caching=st.booleans())
def test_two_tables_lose_no_page(ops, caching):
    """Random admissions (prompts sharing prefixes), chunks, decodes and frees: after each, both
    tables' invariants hold (every page free, cached or owned as often as its refcount says, the
    sliding pages behind the window given back); at the end every page is back."""
    table = HybridPageTable(24, 10, 2, sliding_window=5, enable_prefix_caching=caching)
    base = list(range(40))
    for op, rid, n in ops:
        if op == "admit" and rid not in table:
            prompt = base[:n] if rid % 2 else base[:n // 2] + [99 + rid] * (n - n // 2)
            hit = table.lookup_prefix(prompt)
            assert table.allocate_prompt(rid, prompt, num_new_tokens=min(n - hit, 4)) in (None, hit)
        elif op == "step" and rid in table:
            pending = table.num_allocated_tokens(rid) - table.num_computed_tokens(rid)
            table.mark_computed(rid, pending)
            if table.num_computed_tokens(rid) == table.num_tokens(rid):
                table.append_tokens(rid, [n])
            k = min(table.num_tokens(rid) - table.num_allocated_tokens(rid), 3)
            before = (table.pool.num_available_pages, table.local.pool.num_available_pages)
            if not table.allocate_slots(rid, k, num_lookahead=n % 3):
                assert (table.pool.num_available_pages, table.local.pool.num_available_pages) == before
        elif op == "free" and rid in table:
            table.free(rid)
        elif op == "evict":
            table.local.pool.evict(n % 3)
        table.check_invariants()
    for rid in range(6):
        if rid in table:
            table.free(rid)
    table.check_invariants()
    for pool in (table.pool, table.local.pool):
        assert pool.num_used_pages == 0 and pool.num_free_pages + pool.num_cached_pages == pool.num_pages - 1

"""Pages behind a sliding window that every layer shares (Mistral's, Phi-3's) are given back as a
request computes past them (`jserve.core.page_table`): the engine's greedy tokens stay
transformers' (the tiny Mistral: window 8, pages of 4) through chunked prefill, preemption and
prefix caching, on the native and the XLA backends."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from arch_helpers import IdTokenizer, finish, load_arch
from conftest import DATA
from jserve.core.request import SamplingParams
from jserve.engine.build import build_engine
from jserve.engine.config import EngineConfig
from jserve.model.config import ModelConfig
from jserve.server.metrics import ServerMetrics


def test_only_a_window_every_layer_shares_gives_pages_back():
    configs = {a: ModelConfig.from_hf_config(json.loads((DATA / "arch" / a / "config.json").read_text()))
               for a in ("mistral", "gemma2", "gemma3", "llama3")}
    assert configs["mistral"].shared_window == 8
    # Gemma's full layers read every page its sliding ones have passed; Llama has no window.
    assert configs["gemma2"].shared_window is configs["gemma3"].shared_window is configs["llama3"].shared_window is None


@pytest.mark.parametrize("backend, prefix_caching", [("cpu", False), ("reference", True)])
def test_greedy_decode_gives_pages_back_and_matches_transformers(backend, prefix_caching):
    """Six requests for the reference prompt (10 tokens, 8 greedy ones: 18 tokens, 5 pages, of
    which the last query reads keys 10..17, pages 2 to 4), up to four at a time, prefilled in
    chunks of 4 over 7 pages: some are preempted and recomputed, and each gives back the pages
    its window has passed."""
    config, params = load_arch("mistral")
    ref = np.load(DATA / "arch" / "mistral" / "reference.npz")
    engine = build_engine(config, params, IdTokenizer(), [], EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=4, page_size=4, num_pages=8,
        backend=backend, warmup=False, enable_prefix_caching=prefix_caching))
    assert engine.page_table.sliding_window == 8
    prompt = [int(t) for t in ref["input_ids"][0, :10]]
    for i in range(6):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        engine.page_table.check_invariants()  # given back: exactly the pages no later query reads
    for i in range(6):
        assert list(outs[str(i)].outputs[0].token_ids) == ref["greedy_ids"][0].tolist(), i
    stats = engine.stats()
    assert stats["pages_released_behind_window"] >= 6 * 2  # each finished with pages 0 and 1 given back
    assert stats["num_preemptions"] > 0 and stats["pages_in_use"] == 0
    metrics = ServerMetrics(CollectorRegistry())
    metrics.update_engine(stats)
    line = f"jserve_kv_pages_released_behind_window {float(stats['pages_released_behind_window'])}"
    assert line in metrics.render().decode().splitlines()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_request_longer_than_the_pool_runs_behind_the_window(prefix_caching):
    """7 usable pages of 4 (28 tokens) and chunks of 8: a request holds at most
    cdiv(8 - 1 + 8, 4) + 1 = 5 pages, so a 40-token prompt is admitted and its greedy tokens are a
    large pool's; a pool under 5 pages still refuses it."""
    config, params = load_arch("mistral")
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, config.vocab_size, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for num_pages in (32, 8):
        engine = build_engine(config, params, IdTokenizer(), [], EngineConfig(
            max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8, page_size=4, num_pages=num_pages,
            backend="cpu", warmup=False, enable_prefix_caching=prefix_caching))
        assert engine.scheduler.max_len == 64
        for i in range(2):
            engine.add_request(f"{num_pages}-{i}", prompt, greedy)
        done = finish(engine, engine.page_table.check_invariants)
        outs.append([list(done[f"{num_pages}-{i}"].outputs[0].token_ids) for i in range(2)])
        assert engine.stats()["pages_in_use"] == 0
    assert outs[0] == outs[1] and len(outs[0][0]) == 8
    small = build_engine(config, params, IdTokenizer(), [], EngineConfig(
        max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8, page_size=4, num_pages=5, backend="cpu",
        warmup=False))
    assert small.scheduler.max_len == 17
    with pytest.raises(ValueError, match="leaves no room for output"):
        small.add_request("x", prompt, greedy)

"""The host KV tier end to end (`--kv-offload-bytes`): a multi-turn chat workload whose shared
prefixes overflow the device pool gives the same greedy tokens with the tier on and off, its hits
served from the host tier and counted, nothing compiled after warm-up, every page given back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jserve.core.kv_tier import TieredPageTable
from jserve.core.request import SamplingParams
from jserve.engine import EngineConfig
from test_engine import make_engine, run, tiny  # noqa: F401 (a fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def chat_turns(num_chats=4, turns=3, seed=0):
    """Per turn, each chat's prompt: a shared system prompt, then its history (earlier turns'
    user messages and answers) and a new user message. The answers are filled in as they come."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 256, 24).tolist()
    users = [[rng.integers(3, 256, 8).tolist() for _ in range(turns)] for _ in range(num_chats)]
    return system, users


def run_chats(engine, system, users):
    """Turn by turn (each turn's chats batched), the history growing by each answer."""
    history = [list(system) for _ in users]
    answers = []
    for turn in range(len(users[0])):
        prompts = [h + u[turn] for h, u in zip(history, users)]
        outs = run(engine, prompts, [GREEDY] * len(prompts))
        history = [p + o for p, o in zip(prompts, outs)]
        answers.append(outs)
    return answers


# Per-layer pages, folded pages, int8 codes with their scales.
@pytest.mark.parametrize("backend,kv_dtype", [("cpu", "auto"), ("xla-reference", "auto"), ("cpu", "int8")])
def test_host_tier_same_tokens_and_hits(tiny, backend, kv_dtype):  # noqa: F811
    system, users = chat_turns()
    # 24 pages of 4 tokens: about a quarter of the four chats' last turn (about 70 tokens each).
    kw = dict(num_pages=24, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96,
              backend=backend, kv_cache_dtype=kv_dtype)
    off = make_engine(tiny, **kw)
    expected = run_chats(off, system, users)
    on = make_engine(tiny, kv_offload_bytes=1 << 20, warmup=kv_dtype == "auto" and backend == "cpu", **kw)
    assert all(isinstance(t, TieredPageTable) for t in on.page_tables)
    assert run_chats(on, system, users) == expected
    stats = on.stats()
    assert stats["kv_offload_host_hit_tokens"] > 0 and stats["kv_offload_pages_reloaded"] > 0
    assert stats["kv_offload_host_hit_tokens"] == 4 * stats["kv_offload_pages_reloaded"]
    assert stats["kv_offload_pages_offloaded"] >= stats["kv_offload_host_pages"] > 0
    assert stats["kv_offload_bytes_reloaded"] > 0 and stats["kv_offload_bytes_per_second"] > 0
    # The tier saved prefill: fewer tokens computed than without it.
    assert stats["computed_tokens"] < off.stats()["computed_tokens"]
    assert stats["kv_offload_pages_in_flight"] == 0 and stats["pages_in_use"] == 0  # every page given back
    if kv_dtype == "auto" and backend == "cpu":
        assert stats["compilations_after_warmup"] == 0
    on.page_table.check_invariants()


@pytest.mark.parametrize("extra", [dict(async_scheduling=True), dict(num_scheduler_steps=4),
                                   dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})])
def test_host_tier_with_other_step_functions(tiny, extra):  # noqa: F811
    """Reloads before a launched step (async scheduling), a multi-step decode, a verify step."""
    system, users = chat_turns()
    kw = dict(num_pages=24, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, backend="cpu")
    expected = run_chats(make_engine(tiny, **kw), system, users)
    on = make_engine(tiny, kv_offload_bytes=1 << 20, **kw, **extra)
    assert run_chats(on, system, users) == expected
    assert on.stats()["kv_offload_host_hit_tokens"] > 0 and on.stats()["pages_in_use"] == 0


def test_disk_tier_same_tokens_from_a_mapped_file(tiny, tmp_path):  # noqa: F811
    """--kv-offload-dir: the pool memory-mapped from a file in the folder, the same tokens and hits."""
    system, users = chat_turns()
    kw = dict(num_pages=24, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, backend="cpu")
    expected = run_chats(make_engine(tiny, **kw), system, users)
    folder = tmp_path / "tier"  # created by the engine
    on = make_engine(tiny, kv_offload_bytes=1 << 20, kv_offload_dir=str(folder), **kw)
    pool = on.runner.kv_transfer.host
    assert pool and all(isinstance(h, np.memmap) for h in pool)
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else str(folder)
    assert str(folder) in maps  # mapped from a file there (unnamed: nothing is left behind)
    assert run_chats(on, system, users) == expected
    stats = on.stats()
    assert stats["kv_offload_host_hit_tokens"] > 0 and stats["kv_offload_pages_reloaded"] > 0
    assert stats["pages_in_use"] == 0


def test_host_tier_per_dp_group(tiny):  # noqa: F811
    """On a dp=2 mesh each group has its own host tier (pages at group-local ids, slots apart)."""
    system, users = chat_turns(num_chats=4, turns=3, seed=1)
    kw = dict(num_pages=40, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96,
              backend="xla-reference", mesh="dp=2")
    expected = run_chats(make_engine(tiny, **kw), system, users)
    on = make_engine(tiny, kv_offload_bytes=1 << 20, **kw)
    assert run_chats(on, system, users) == expected
    hits = [t.num_host_hit_tokens for t in on.page_tables]
    assert len(hits) == 2 and sum(hits) > 0 and on.stats()["pages_in_use"] == 0


def test_host_tier_refusals(tiny, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offload_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no KV page"):
        make_engine(tiny, kv_offload_bytes=16)
    with pytest.raises(ValueError, match="kv_offload_bytes must be a positive integer"):
        EngineConfig(kv_offload_bytes=0)
    with pytest.raises(ValueError, match="kv_offload_dir '/x' is where"):
        EngineConfig(kv_offload_dir="/x")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="kv_offload_dir .*a_file.*cannot create"):
        make_engine(tiny, kv_offload_bytes=1 << 20, kv_offload_dir=str(tmp_path / "a_file" / "tier"))

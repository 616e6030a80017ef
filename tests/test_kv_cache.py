"""KV pages: budget sizing, slot writes, and in-place updates of donated buffers (checked on HLO)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.model.config import ModelConfig
from jserve.runtime.kv_cache import init_kv_pages, plan_memory, slot_mapping, write_kv

LLAMA31_8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False)
TINY = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16)


def test_llama31_8b_needs_128_kib_per_token_in_bf16():
    assert LLAMA31_8B.kv_bytes_per_token(2) == 128 * 1024
    assert LLAMA31_8B.num_params() == 8_030_261_248  # Meta's published count
    plan = plan_memory(LLAMA31_8B, weight_dtype_bytes=2, device_bytes=80 * 2**30, memory_fraction=0.9,
                       context=8192)
    assert plan.kv_bytes_per_page == 2 * 2**20
    expected = (int(80 * 2**30 * 0.9) - plan.weight_bytes - plan.activation_bytes) // (2 * 2**20)
    assert plan.num_pages == expected
    assert plan.max_sequences == (expected - 1) // 512


def test_explicit_budget_and_errors():
    plan = plan_memory(TINY, weight_dtype_bytes=4, kv_budget_bytes=2**20, page_size=16, kv_dtype="float32")
    assert plan.num_pages == 2**20 // (TINY.kv_bytes_per_token(4) * 16)
    with pytest.raises(ValueError, match="no room"):
        plan_memory(LLAMA31_8B, weight_dtype_bytes=2, device_bytes=8 * 2**30)
    with pytest.raises(ValueError, match="float7"):
        plan_memory(TINY, weight_dtype_bytes=4, kv_budget_bytes=2**20, kv_dtype="float7")
    with pytest.raises(ValueError, match="num_pages"):
        init_kv_pages(TINY, 1, 16)


def test_write_places_tokens_in_their_slots():
    k_pages, v_pages = init_kv_pages(TINY, 6, 4, jnp.float32)[0]
    page_ids = [5, 2, 3]  # a sequence's pages, out of order
    slots = slot_mapping(page_ids, 2, 7, 4)  # tokens 2..8
    k = jnp.arange(7 * 2 * 16, dtype=jnp.float32).reshape(7, 2, 16)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, -k, jnp.asarray(slots))
    for t in range(7):
        pos = 2 + t
        page, off = page_ids[pos // 4], pos % 4
        np.testing.assert_array_equal(k_pages[:, page, off], k[t])
        np.testing.assert_array_equal(v_pages[:, page, off], -k[t])
    assert float(jnp.abs(k_pages[:, [0, 1, 4]]).sum()) == 0.0


def test_donated_write_has_no_cache_sized_copy():
    num_pages, page = 256, 16
    k_pages, v_pages = init_kv_pages(TINY, num_pages, page, jnp.float32)[0]
    fn = jax.jit(write_kv, donate_argnums=(0, 1))
    k = jnp.ones((8, 2, 16), jnp.float32)
    slots = jnp.arange(8, dtype=jnp.int32) + 16
    compiled = fn.lower(k_pages, v_pages, k, k, slots).compile()
    hlo = compiled.as_text()
    cache_shape = "f32[2,4096,16]"  # the flattened pages
    copies = [line for line in hlo.splitlines() if re.search(r"= f32\[2,(256,16|4096),16\]\S* copy\(", line)]
    assert not copies, copies
    assert cache_shape in hlo or "f32[2,256,16,16]" in hlo
    out_k, _ = compiled(k_pages, v_pages, k, k, slots)
    assert k_pages.is_deleted()  # the buffer was donated
    np.testing.assert_array_equal(out_k[:, 1, :8], jnp.ones((2, 8, 16)))


def test_plan_cli_prints_128_kib_for_llama31_8b(tmp_path, capsys):
    import json

    from jserve import cli

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}))
    assert cli.main(["plan", "--model", str(tmp_path), "--device-memory", "80GiB", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"KV per token \(bfloat16\)\s+128 KiB", out), out
    assert re.search(r"weights \(bfloat16\)\s+14.96 GiB", out), out
    assert cli.main(["plan", "--model", str(tmp_path), "--device-memory", "16GiB"]) == 2
    assert "no room for KV pages" in capsys.readouterr().err
    # Over a mesh: per device. tp=4 splits the 8 KV heads 2 per device; tp=16 replicates them.
    assert cli.main(["plan", "--model", str(tmp_path), "--device-memory", "16GiB", "--mesh", "tp=4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"KV per token \(bfloat16\) per device\s+32 KiB", out), out
    weights = float(re.search(r"weights \(bfloat16\) per device\s+([\d.]+) GiB", out).group(1))
    assert 3.73 <= weights < 3.8  # a quarter of 14.96 GiB: the embedding and head split too
    assert cli.main(["plan", "--model", str(tmp_path), "--device-memory", "16GiB", "--mesh", "dp=2,tp=16"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"KV per token \(bfloat16\) per device\s+16 KiB", out), out
    assert "x2 replicas" in out
    assert cli.main(["plan", "--model", str(tmp_path), "--mesh", "pp=2", "--device-memory", "16GiB"]) == 2
    assert "unknown mesh axis 'pp'" in capsys.readouterr().err

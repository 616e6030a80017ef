"""quant_import: GGUF blocks, AWQ and GPTQ tensors repacked into QuantizedWeight without a float
copy. GGUF is checked bit for bit against the gguf package's own dequantization; AWQ and GPTQ
against integer matrices packed here by a reference packer written from the documented layouts
(AutoAWQ's WQLinear_GEMM.from_linear, AutoGPTQ's QuantLinear.pack) and (q - z) * s in float32."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from jserve.model import quant
from jserve.model.quant import QuantizedWeight
from jserve.model.quant_hf import from_awq, from_gptq, quantization_spec_from_hf
from jserve.model.quant_import import from_gguf, permute_output_channels, stack_layers

T = gguf.GGMLQuantizationType
BLOCK = {T.Q8_0: (32, 34), T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q4_K: (256, 144), T.Q6_K: (256, 210)}
# Byte offsets of each type's float16 fields (d, and m / dmin where it has one).
F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q6_K: (208,)}
EXPECT = {T.Q8_0: ("int8", 32, np.float16, False), T.Q4_0: ("int4", 32, np.float16, False),
          T.Q4_1: ("int4", 32, np.float16, True), T.Q4_K: ("int4", 32, np.float32, True),
          T.Q6_K: ("int8", 16, np.float32, False)}


def bits_of(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_bit_exact(w: QuantizedWeight, ref: np.ndarray) -> None:
    got = quant.dequantize(w)
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(bits_of(got), bits_of(ref))


def random_blocks(qtype, rows: int, k: int, rng) -> np.ndarray:
    """Random bytes [rows, bytes per row] with finite (and some negative / tiny) float16 fields."""
    block, size = BLOCK[qtype]
    data = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        f = rng.standard_normal((rows, k // block, 1)).astype(np.float16) * np.float16(0.05)
        f[0, 0] = np.float16(6.0e-8)  # a subnormal
        data[..., at:at + 2] = f.view(np.uint8)
    return data.reshape(rows, k // block * size)


def check_gguf(qtype, data: np.ndarray, k: int, n: int) -> QuantizedWeight:
    w = from_gguf(qtype, data, (k, n))
    scheme, group, sdtype, asym = EXPECT[qtype]
    assert (w.scheme, w.group_size, w.scales.dtype, w.offsets is not None) == (scheme, group, sdtype, asym)
    assert w.shape == (k, n) and w.scales.shape == (k // group, n)
    if asym:
        assert w.offsets.dtype == sdtype
    assert_bit_exact(w, gguf.quants.dequantize(data, qtype).T)
    return w


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1])
def test_gguf_quantized_by_gguf_bit_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    k, n = 96, 40
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    w[3] = 0.0  # all-zero blocks (d = 0)
    w[5, :32] = np.linspace(-1, 1, 32)  # the extreme codes
    check_gguf(qtype, gguf.quants.quantize(w, qtype), k, n)


@pytest.mark.parametrize("qtype", list(BLOCK))
def test_gguf_random_blocks_bit_exact(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    block = BLOCK[qtype][0]
    k, n = 2 * block, 24
    check_gguf(qtype, random_blocks(qtype, n, k, rng), k, n)


def test_gguf_codes_and_scales_are_the_blocks_own():
    # One Q6_K block with known fields: code 0 everywhere except element 200 (h=1, r=72), scale
    # d * sc per 16 elements: the repacked codes and scales are those numbers, not a rounding.
    block = np.zeros(210, np.uint8)
    block[0:128] = 0x00  # low nibbles 0 -> q = 0 - 32 where qh is 0
    block[128:192] = 0xAA  # every 2-bit pair = 2 -> q = 32 - 32 = 0
    block[64 + 72 % 64] = 0x0F << 4  # element 200: r // 64 = 1 -> high nibble of ql[72]
    block[128 + 32 + 72 % 32] = np.uint8(0xAA & ~(3 << 4) | (3 << 4))  # r // 32 = 2 -> pair 3
    block[192:208] = np.arange(-8, 8, dtype=np.int8).view(np.uint8)
    block[208:210] = np.array([0.5], np.float16).view(np.uint8)
    w = from_gguf(T.Q6_K, block[None], (256, 1))
    codes = quant.codes(w)[:, 0]
    assert codes[200] == (15 | 3 << 4) - 32 and np.all(np.delete(codes, 200) == 0)
    np.testing.assert_array_equal(w.scales[:, 0], 0.5 * np.arange(-8, 8, dtype=np.float32))


def test_gguf_outer_axes_lead():
    rng = np.random.default_rng(7)
    e, n, k = 3, 8, 64
    data = random_blocks(T.Q4_1, e * n, k, rng).reshape(e, n, -1)
    w = from_gguf(T.Q4_1, data, (k, n, e))  # ne order: K, N, experts
    assert w.shape == (e, k, n)
    ref = gguf.quants.dequantize(data, T.Q4_1)  # [e, n, k]
    assert_bit_exact(w, np.swapaxes(ref, -1, -2))


def test_gguf_unsupported_types_and_bad_shapes():
    for t in (T.F32, T.F16, T.BF16, T.Q5_K, T.Q2_K, T.Q5_0):
        with pytest.raises(ValueError, match=f"{t.name}.*supported: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K"):
            from_gguf(t, np.zeros((4, 64), np.uint8), (64, 4))
    data = random_blocks(T.Q8_0, 32, 64, np.random.default_rng(0))  # [N=32, 2 blocks of 34]
    from_gguf(T.Q8_0, data, (64, 32))
    with pytest.raises(ValueError, match="ne order"):
        from_gguf(T.Q8_0, data, (32, 64))  # numpy order instead of GGUF's
    with pytest.raises(ValueError, match="not a multiple.*ne order"):
        from_gguf(T.Q8_0, data, (48, 32))
    with pytest.raises(ValueError, match="ne order"):
        from_gguf(T.Q8_0, data[:-1], (64, 32))
    with pytest.raises(ValueError, match="2 dimensions"):
        from_gguf(T.Q8_0, data.reshape(-1), (2048,))


@pytest.mark.slow  # GGUFReader parses the whole file's metadata (~2.5 s of CPU; > 5 s on a loaded machine)
def test_gguf_real_model_tensors_bit_exact():
    from jserve.model.checkpoint import default_gguf_path
    from jserve.model.sources import unpermute_rotary

    reader = gguf.GGUFReader(str(default_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    names = ["token_embd.weight"] + [f"blk.{i}.{p}.weight" for i in (0, 29) for p in
                                     ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    for name in names:
        t = tensors[name]
        assert t.tensor_type == (T.Q8_0 if name == "token_embd.weight" else T.Q4_1)
        k, n = (int(d) for d in t.shape)
        w = check_gguf(t.tensor_type, t.data, k, n)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            h = heads if "attn_q" in name else kv_heads
            perm = unpermute_rotary(np.arange(n), h)
            ref = unpermute_rotary(gguf.quants.dequantize(t.data, t.tensor_type), h).T
            assert_bit_exact(permute_output_channels(w, perm), ref)


def test_permute_output_channels():
    rng = np.random.default_rng(1)
    w = quant.quantize(rng.standard_normal((64, 12)), "int4", 32, symmetric=False)
    perm = rng.permutation(12)
    p = permute_output_channels(w, perm)
    assert (p.scheme, p.group_size) == (w.scheme, w.group_size)
    assert_bit_exact(p, quant.dequantize(w)[:, perm])
    for bad in (perm[:-1], np.zeros(12, int), perm.astype(float)):
        with pytest.raises(ValueError, match="permutation"):
            permute_output_channels(w, bad)


def test_stack_layers():
    rng = np.random.default_rng(2)
    ws = [quant.quantize(rng.standard_normal((64, 8)), "int4", 32, symmetric=False) for _ in range(3)]
    s = stack_layers(ws)
    assert s.values.shape == (3, 32, 8) and s.scales.shape == (3, 2, 8) and s.offsets.shape == (3, 2, 8)
    assert_bit_exact(s, np.stack([quant.dequantize(w) for w in ws]))
    sym = quant.quantize(rng.standard_normal((64, 8)), "int4", 32, symmetric=True)
    g64 = quant.quantize(rng.standard_normal((64, 8)), "int4", 64, symmetric=False)
    i8 = quant.quantize(rng.standard_normal((64, 8)), "int8", 32)
    f32 = QuantizedWeight(ws[0].values, ws[0].scales.astype(np.float32), ws[0].offsets.astype(np.float32),
                          "int4", 32)
    wide = quant.quantize(rng.standard_normal((64, 16)), "int4", 32, symmetric=False)
    for other in (sym, g64, i8, f32, wide):
        with pytest.raises(ValueError, match="layer 1 does not match"):
            stack_layers([ws[0], other])
    with pytest.raises(ValueError, match="at least one"):
        stack_layers([])


# ---------------------------------------------------------------- reference packers (documented layouts)

REF_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def ref_pack_awq(ints: np.ndarray) -> np.ndarray:
    """AutoAWQ's gemm packing: word j of a row holds columns 8j + REF_AWQ_ORDER[i] at bits 4i."""
    rows, cols = ints.shape
    out = np.zeros((rows, cols // 8), np.uint32)
    for col in range(cols // 8):
        for i in range(8):
            out[:, col] |= ints[:, col * 8 + REF_AWQ_ORDER[i]].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def ref_pack_gptq_rows(ints: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qweight packing: 32 / bits consecutive rows per word, the first least significant."""
    per = 32 // bits
    out = np.zeros((ints.shape[0] // per, ints.shape[1]), np.uint32)
    for row in range(out.shape[0]):
        for j in range(per):
            out[row] |= (ints[row * per + j].astype(np.uint32) & np.uint32((1 << bits) - 1)) << np.uint32(bits * j)
    return out.view(np.int32)


def ref_pack_gptq_cols(ints: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qzeros packing: 32 / bits consecutive columns per word (masked, as uint32 wraps -1)."""
    return np.ascontiguousarray(ref_pack_gptq_rows(np.ascontiguousarray(ints.T), bits).T)


def reference(q, z, s, group):
    return ((q - np.repeat(z, group, axis=0)).astype(np.float32)
            * np.repeat(s.astype(np.float32), group, axis=0))


def test_awq_matches_reference_packing():
    rng = np.random.default_rng(3)
    k, n, g = 256, 64, 128
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // g, n))
    s = (rng.random((k // g, n)) * 0.02).astype(np.float16)
    w = from_awq(ref_pack_awq(q), ref_pack_awq(z), s, g)
    assert (w.scheme, w.group_size, w.symmetric, w.shape) == ("int4", g, False, (k, n))
    assert w.scales.dtype == np.float32 and w.offsets.dtype == np.float32
    np.testing.assert_array_equal(quant.codes(w), q)
    assert_bit_exact(w, reference(q, z, s, g))
    # Every zero point 8: signed codes, no offsets, float16 scales kept.
    w8 = from_awq(ref_pack_awq(q), ref_pack_awq(np.full_like(z, 8)), s, g)
    assert w8.symmetric and w8.scales.dtype == np.float16
    assert_bit_exact(w8, reference(q, np.full_like(z, 8), s, g))


def test_awq_errors():
    q = ref_pack_awq(np.zeros((64, 16), int))
    z = ref_pack_awq(np.zeros((2, 16), int))
    s = np.ones((2, 16), np.float16)
    with pytest.raises(ValueError, match="4-bit"):
        from_awq(q, z, s, 32, bits=8)
    with pytest.raises(ValueError, match="qzeros has shape"):
        from_awq(q, z[:1], s, 32)
    with pytest.raises(ValueError, match="scales has shape"):
        from_awq(q, z, s[:, :8], 32)
    with pytest.raises(ValueError, match="does not divide"):
        from_awq(q, z, s, 48)
    with pytest.raises(ValueError, match="int32"):
        from_awq(q.astype(np.int64), z, s, 32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_matches_reference_packing(bits, fmt, sym):
    rng = np.random.default_rng(bits * 10 + sym + len(fmt))
    k, n, g = 256, 32, 64
    top = 1 << bits
    q = rng.integers(0, top, (k, n))
    z = np.full((k // g, n), top // 2) if sym else rng.integers(0, top, (k // g, n))
    if not sym and fmt == "gptq":
        z[0, :4] = 0  # v1 stores 0 - 1, which unpacks as 15 (255) and decodes as 16 (256)
    stored = z - 1 if fmt == "gptq" else z
    s = (rng.random((k // g, n)) * 0.02 + 1e-4).astype(np.float16)
    g_idx = np.arange(k, dtype=np.int32) // g
    w = from_gptq(ref_pack_gptq_rows(q, bits), ref_pack_gptq_cols(stored, bits), s, g_idx, bits, g, sym, fmt)
    # AutoGPTQ's kernels decode v1 as ((word >> shift) & mask) + 1: a zero point of 0 comes back as 2 ** bits.
    z_eff = np.where(z == 0, top, z) if fmt == "gptq" else z
    assert (w.scheme, w.group_size, w.symmetric, w.shape) == ("int4" if bits == 4 else "int8", g, sym, (k, n))
    assert w.scales.dtype == (np.float16 if sym else np.float32)
    assert_bit_exact(w, reference(q, z_eff, s, g))
    if sym:
        np.testing.assert_array_equal(quant.codes(w), q - top // 2)


def test_gptq_per_channel_bfloat16_and_float32_scales():
    import ml_dtypes

    rng = np.random.default_rng(5)
    k, n = 64, 16
    q = rng.integers(0, 16, (k, n))
    z = np.full((1, n), 8)
    s = (rng.random((1, n)) * 0.1).astype(ml_dtypes.bfloat16)
    w = from_gptq(ref_pack_gptq_rows(q, 4), ref_pack_gptq_cols(z - 1, 4), s, None, 4, -1, True, "gptq")
    assert w.group_size == k and w.scales.dtype == np.float32
    assert_bit_exact(w, reference(q, z, s, k))
    # Float32 scales, asymmetric: q * s + (-(z * s)) rounds twice, so allow an ulp.
    z = rng.integers(0, 16, (1, n))
    s32 = (rng.random((1, n)) * 0.1).astype(np.float32)
    w = from_gptq(ref_pack_gptq_rows(q, 4), ref_pack_gptq_cols(z, 4), s32, None, 4, -1, False, "gptq_v2")
    np.testing.assert_allclose(quant.dequantize(w), reference(q, z, s32, k), rtol=0, atol=1e-6)


def test_gptq_errors():
    rng = np.random.default_rng(6)
    k, n, g = 128, 16, 32
    qw = ref_pack_gptq_rows(rng.integers(0, 16, (k, n)), 4)
    qz = ref_pack_gptq_cols(np.full((k // g, n), 7), 4)  # sym v1: 8 stored as 7
    s = np.ones((k // g, n), np.float16)
    trivial = np.arange(k) // g
    from_gptq(qw, qz, s, trivial, 4, g, True, "gptq")  # the valid baseline
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(qw, qz, s, rng.permutation(trivial), 4, g, True, "gptq")
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(qw, qz, s, trivial[:-1], 4, g, True, "gptq")
    with pytest.raises(ValueError, match="sym=True.*checkpoint_format"):
        from_gptq(qw, qz, s, trivial, 4, g, True, "gptq_v2")  # zeros of 7: the v1 file read as v2
    for bits in (2, 3):
        with pytest.raises(ValueError, match=f"bits={bits}"):
            from_gptq(qw, qz, s, trivial, bits, g, True, "gptq")
    with pytest.raises(ValueError, match="marlin"):
        from_gptq(qw, qz, s, trivial, 4, g, True, "marlin")
    with pytest.raises(ValueError, match="qzeros has shape"):
        from_gptq(qw, qz, s, trivial, 4, 64, True, "gptq")


# ------------------------------------------------------------------------------------ the config

AWQ_CFG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
           "modules_to_not_convert": ["visual"]}
GPTQ_CFG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
            "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": "gptq",
            "use_exllama": True, "exllama_config": {"version": 1}}


def test_spec_valid(tmp_path):
    assert quantization_spec_from_hf({"quantization_config": AWQ_CFG}) == {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": ["visual"]}
    # AutoAWQ's own key names, and its upper-case version.
    assert quantization_spec_from_hf({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
                                      "version": "GEMM"})["group_size"] == 64
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config": GPTQ_CFG}))
    spec = quantization_spec_from_hf(path)
    assert spec == {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
                    "static_groups": False, "checkpoint_format": "gptq", "lm_head": False,
                    "modules_to_not_convert": []}
    v2 = quantization_spec_from_hf({"quantization_config": {**GPTQ_CFG, "bits": 8, "checkpoint_format": "gptq_v2"}})
    assert (v2["bits"], v2["checkpoint_format"]) == (8, "gptq_v2")
    # Act-order is fine where g_idx stays k // G: per channel, or with static groups.
    assert quantization_spec_from_hf({**GPTQ_CFG, "desc_act": True, "group_size": -1})["desc_act"]
    assert quantization_spec_from_hf({**GPTQ_CFG, "desc_act": True, "static_groups": True})["static_groups"]


@pytest.mark.parametrize("cfg, match", [
    ({**AWQ_CFG, "version": "gemv"}, "version='gemv'"),
    ({**AWQ_CFG, "version": "exllama"}, "version='exllama'"),
    ({**AWQ_CFG, "version": "marlin"}, "version='marlin'"),
    ({**AWQ_CFG, "bits": 3}, "bits=3"),
    ({**AWQ_CFG, "zero_point": False}, "zero_point"),
    ({**AWQ_CFG, "backend": "llm-awq"}, "backend='llm-awq'"),
    ({**AWQ_CFG, "group_size": 0}, "group_size=0"),
    ({**GPTQ_CFG, "bits": 3}, "bits=3"),
    ({**GPTQ_CFG, "bits": 2}, "bits=2"),
    ({**GPTQ_CFG, "bits": "4"}, "bits must be an integer"),
    ({k: v for k, v in GPTQ_CFG.items() if k != "group_size"}, "group_size must be an integer"),
    ({**GPTQ_CFG, "desc_act": True}, "desc_act"),
    ({**GPTQ_CFG, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**GPTQ_CFG, "is_marlin_format": True}, "is_marlin_format"),
    ({**GPTQ_CFG, "pack_dtype": "int16"}, "pack_dtype='int16'"),
    ({**GPTQ_CFG, "dynamic": {"-:.*mlp.*": {}}}, "dynamic"),
    ({**GPTQ_CFG, "sym": "yes"}, "sym must be true or false"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "fp8"}, "'fp8'"),
])
def test_spec_rejects(cfg, match):
    with pytest.raises(ValueError, match=match):
        quantization_spec_from_hf({"quantization_config": cfg})


def test_spec_needs_a_quantization_config():
    with pytest.raises(ValueError, match="no quantization_config"):
        quantization_spec_from_hf({"architectures": ["LlamaForCausalLM"]})

"""Weight quantization: the format against its numpy reference, the XLA quantized linear, a
quantized model through the paged runner, quantized checkpoints and the quality gate."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arch_helpers import load_arch
from jserve.engine import quality_gate
from jserve.engine.config import EngineConfig
from jserve.model import quant
from jserve.model.checkpoint import convert, load_checkpoint
from jserve.model.quant_record import quality_report_path, write_quality_report
from test_backends import WANTS_LOGPROBS, StepRow, _model_logprobs
from test_checkpoint import tiny_hf_folder  # noqa: F401 (fixture)

FORMATS = [("int8", 0, True), ("int8", 32, True), ("int4", 32, True), ("int4", 32, False),
           ("int4", 64, False), ("int4", 128, True), ("fp8", 0, True)]


def _weight(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape).astype(np.float32) * 0.05
    w[..., 3, :] *= 20  # an outlier row: per-group scales must absorb it
    return w


@pytest.mark.parametrize("scheme,group,symmetric", FORMATS)
def test_round_trip_error_is_within_half_a_step(scheme, group, symmetric):
    w = _weight((2, 256, 40))
    q = quant.quantize(w, scheme, group, symmetric)
    assert q.shape == w.shape and q.scheme == scheme and q.symmetric == symmetric
    d = quant.dequantize(q)
    G = group or 256
    steps = np.repeat(q.scales.astype(np.float32), G, axis=-2)  # the step of each element's group
    err = np.abs(d - w)
    if scheme == "fp8":  # 3 mantissa bits: half an ulp of the scaled value, relative
        assert np.all(err <= np.abs(w) * 2.0 ** -4 + steps * 2.0 ** -9)
    else:
        assert np.all(err <= steps * 0.5 * (1 + 1e-3) + 1e-7), err.max()
    # the scales are exactly what the codes were computed with: quantizing again changes nothing
    again = quant.quantize(d, scheme, group, symmetric)
    np.testing.assert_array_equal(quant.dequantize(again), d)


def test_int4_nibbles_round_trip_signed_and_unsigned():
    rng = np.random.default_rng(1)
    for signed, lo, hi in ((True, -8, 8), (False, 0, 16)):
        q = rng.integers(lo, hi, size=(3, 64, 24)).astype(np.int8)
        packed = quant.pack_int4(q)
        assert packed.dtype == np.uint8 and packed.shape == (3, 32, 24)
        np.testing.assert_array_equal(quant.unpack_int4(packed, signed), q)
        np.testing.assert_array_equal(np.asarray(quant.unpack_int4(jnp.asarray(packed), signed, jnp)), q)
    assert quant.pack_int4(np.array([[1], [-2]], np.int8))[0, 0] == 0x1 | (0xE << 4)  # low nibble = row 0


@pytest.mark.parametrize("scheme,group,symmetric", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_quantized_linear_matches_x_times_the_dequantized_weight(scheme, group, symmetric, dtype):
    w = quant.quantize(_weight((256, 72)), scheme, group, symmetric)
    x = np.random.default_rng(2).normal(size=(5, 256)).astype(np.float32)
    x_in = jnp.asarray(x, dtype)
    got = np.asarray(jax.jit(quant.xla_quantized_linear)(x_in, w).astype(jnp.float32))
    want = np.asarray(x_in.astype(jnp.float32)) @ quant.dequantize(w)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    assert jax.jit(quant.xla_quantized_linear)(x_in, w).dtype == x_in.dtype


def test_quantized_embedding_rows_and_head():
    E = _weight((50, 64)).T.copy()  # the transpose [hidden, vocab] is what is quantized
    q = quant.quantize(E, "int8")
    tokens = jnp.asarray([[3, 49], [0, 3]])
    rows = np.asarray(quant.embed_rows(q, tokens, jnp.float32))
    np.testing.assert_array_equal(rows, quant.dequantize(q).T[np.asarray(tokens)])
    x = np.random.default_rng(3).normal(size=(4, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(quant.xla_quantized_linear(jnp.asarray(x), q, jnp.float32)),
                               x @ quant.dequantize(q), rtol=1e-5, atol=1e-5)


def test_quant_spec_parsing_and_errors():
    assert quant.QuantSpec.parse("int4").label() == "int4 g32 asym"
    assert quant.QuantSpec.parse("int4", 128).group_size == 128
    assert quant.QuantSpec.parse("int8").label() == "int8 per-channel sym"
    assert quant.QuantSpec.parse("fp8").embed_scheme == "fp8"
    with pytest.raises(ValueError, match="group size of"):
        quant.QuantSpec.parse("int4", 48)
    with pytest.raises(ValueError, match="one of"):
        quant.QuantSpec.parse("int3")
    with pytest.raises(ValueError, match="does not divide"):
        quant.quantize(_weight((100, 8)), "int4", 32)
    with pytest.raises(ValueError, match="quantization_group_size"):
        EngineConfig(quantization="fp8", quantization_group_size=32)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="quality_gate"):
        EngineConfig(quality_gate="maybe")


def _dequantized(params):
    return {k: jnp.asarray((quant.dequantize(v).T if k == "embed" else quant.dequantize(v))
                           if quant.is_quantized(v) else v) for k, v in params.items()}


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("options", [{}, {"scan": False}], ids=["scanned", "unrolled"])
def test_quantized_model_on_the_xla_backend_matches_the_model_on_dequantized_weights(scheme, options):
    """The paged runner over quantized params (prefill chunks, then decode) gives the logprobs
    of the model's own layers over the dequantized weights: the quantized linears, embedding
    and head are the weights they stand for, whatever the stack."""
    from jserve.runtime import backends
    from jserve.runtime.runner import Runner

    config, params = load_arch("smollm2")
    qparams = quant.quantize_params(config, {k: np.asarray(v) for k, v in params.items()},
                                    quant.QuantSpec.parse(scheme))
    assert quant.is_quantized(qparams["embed"]) and qparams["embed"].shape == params["embed"].shape[::-1]
    runner = Runner(config, qparams, num_pages=24, page_size=4, max_model_len=32,
                    backend=backends.create("reference", **options), max_num_batched_tokens=8,
                    batch_buckets=(1, 2), token_buckets=(8,))
    assert runner.param_bytes == quant.param_bytes(qparams) < quant.param_bytes(params)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, config.vocab_size, 14)]
    pages = [7, 3, 12, 5]
    steps = [runner.execute([StepRow(0, ids[:8], pages[:2], WANTS_LOGPROBS)]),
             runner.execute([StepRow(8, ids[8:11], pages[:3], WANTS_LOGPROBS)])]
    for n in range(11, 14):
        steps.append(runner.execute([StepRow(n, [ids[n]], pages[:n // 4 + 1], WANTS_LOGPROBS)]))
    want = _model_logprobs(config, _dequantized(qparams), ids)
    for pos, out in zip([7, 10, 11, 12, 13], steps):
        top = np.sort(want[pos])[::-1][:5]
        np.testing.assert_allclose(out.top_logprobs[0][:5], top, atol=2e-4, err_msg=f"position {pos}")


def _report(kl_mean, top1):
    """The fields of `jserve.eval.EvalReport`'s JSON that the gate reads."""
    return {"kl": {"mean": kl_mean, "median": kl_mean / 2, "p99": kl_mean * 10, "p999": kl_mean * 20,
                   "max": kl_mean * 50},
            "top1_agreement": top1, "ppl": {"candidate": 10.5, "reference": 10.0},
            "scored_tokens": 1000, "text": {"source": "test", "tokens": 2000, "sha256": "0" * 64}}


def test_quality_gate_thresholds_and_modes():
    record = {"label": "int8 per-channel sym", "scheme": "int8", "report": None}
    with pytest.raises(quality_gate.QualityGateError, match="no quality report"):
        quality_gate.check(record)
    assert not quality_gate.check(record, gate="warn").passed  # served, with a warning
    assert quality_gate.check(None) is None  # a float model
    with pytest.raises(quality_gate.QualityGateError, match="without a reference"):
        quality_gate.check(dict(record, report=dict(_report(0.001, 0.99), kl=None)))
    good = dict(record, report=_report(0.001, 0.99))
    assert quality_gate.check(good).passed
    bad = dict(record, report=_report(0.5, 0.99))
    with pytest.raises(quality_gate.QualityGateError, match=r"mean KL 0\.50000 > 0\.01"):
        quality_gate.check(bad)
    assert quality_gate.check(bad, max_kl=1.0).passed
    with pytest.raises(quality_gate.QualityGateError, match="top-1 agreement 0.9000 < 0.95"):
        quality_gate.check(dict(record, report=_report(0.001, 0.9)))
    assert quality_gate.check(dict(record, report=_report(0.001, 0.9)), min_top1=0.85).passed
    int4 = {"label": "int4 g32 asym", "scheme": "int4", "report": _report(0.08, 0.9)}
    assert quality_gate.check(int4).passed  # int4's own, looser thresholds
    with pytest.raises(quality_gate.QualityGateError, match="beyond the gate"):  # RTN int4 on SmolLM2-135M
        quality_gate.check(dict(int4, report=_report(0.26, 0.75)))


def test_quantized_checkpoint_round_trip_and_gate(tiny_hf_folder, tmp_path):  # noqa: F811
    """`convert --quantize` writes codes, scales and offsets as they were made; `LLM` refuses the
    checkpoint until a passing report is stored, then serves it; the same for quantization at load
    with a report under the float checkpoint's quality/."""
    from jserve import LLM, SamplingParams

    convert(tiny_hf_folder, tmp_path / "f32", progress=False)
    _, fparams, _ = load_checkpoint(tmp_path / "f32", host=True)
    spec = quant.QuantSpec.parse("int4", 64)
    convert(tmp_path / "f32", tmp_path / "q4", progress=False, quantize=spec)
    config, params, generation = load_checkpoint(tmp_path / "q4")
    record = generation["quantization"]
    assert record["label"] == "int4 g64 asym" and record["report"] is None
    assert record["weights"]["wq"] == {"scheme": "int4", "group_size": 64, "symmetric": False}
    want = quant.quantize_params(config, fparams, spec)
    for name in quant.LAYER_MATMULS + ("lm_head",):
        assert quant.is_quantized(params[name])
        for got, ref in zip(jax.tree.leaves(params[name]), jax.tree.leaves(want[name])):
            np.testing.assert_array_equal(np.asarray(got), ref)
    settings = dict(backend="reference", max_num_seqs=2, max_model_len=64, warmup=False)
    with pytest.raises(quality_gate.QualityGateError, match="no quality report"):
        LLM(str(tmp_path / "q4"), **settings)
    write_quality_report(tmp_path / "q4", _report(0.02, 0.9))
    llm = LLM(str(tmp_path / "q4"), **settings)
    assert llm.quantization["report"]["kl"]["mean"] == 0.02
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(tmp_path / "q4"), quantization="int8", **settings)
    # at load: the float checkpoint's quality/ report for that spec
    with pytest.raises(quality_gate.QualityGateError, match="jserve eval"):
        LLM(str(tmp_path / "f32"), quantization="int8", **settings)
    path = quality_report_path(tmp_path / "f32", quant.QuantSpec.parse("int8").label())
    path.parent.mkdir()
    path.write_text(json.dumps(_report(0.5, 0.99)))
    with pytest.raises(quality_gate.QualityGateError, match="beyond the gate"):
        LLM(str(tmp_path / "f32"), quantization="int8", **settings)
    path.write_text(json.dumps(_report(0.001, 0.99)))
    llm = LLM(str(tmp_path / "f32"), quantization="int8", **settings)
    assert llm.quantization["label"] == "int8 per-channel sym"
    assert quant.is_quantized(llm.runner.params["layers"]["wq"])
    with pytest.raises(ValueError, match="device mesh"):
        LLM(str(tmp_path / "f32"), quantization="int8", mesh="tp=2", **settings)
    shutil.rmtree(tmp_path / "q4")


@pytest.mark.parametrize("platform,kernel", [("tpu", "tpu"), ("cuda", "gpu")])
@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_quantized_steps_lower_for_tpu_and_gpu(platform, kernel, scheme):
    """The XLA backend's decode and prefill steps over quantized weights (and an int8 KV cache on
    the TPU kernel) lower for the accelerator with its real attention kernel, on this CPU."""
    import dataclasses

    from jserve.model.llama import param_shapes
    from jserve.runtime import backends
    from jserve.runtime.runner import Runner

    config, _ = load_arch("smollm2")  # with the Mosaic GPU kernel's head_dim
    config = dataclasses.replace(config, head_dim=64, num_heads=2, num_kv_heads=1, hidden_size=128)
    params = {k: np.ones(s, np.float32) if "norm" in k else _weight(s, i)
              for i, (k, s) in enumerate(param_shapes(config).items())}
    qparams = quant.quantize_params(config, params, quant.QuantSpec.parse(scheme))
    if kernel == "gpu":  # the Mosaic GPU kernel takes bfloat16 queries and pages
        qparams = {k: v if quant.is_quantized(v) else jnp.asarray(v, jnp.bfloat16) for k, v in qparams.items()}
    kv_dtype = jnp.int8 if kernel == "tpu" else jnp.bfloat16
    runner = Runner(config, qparams, num_pages=24, page_size=16, max_model_len=64,
                    backend=backends.create(kernel), kv_dtype=kv_dtype, max_num_batched_tokens=16,
                    batch_buckets=(4,), token_buckets=(16,))
    for B, T in ((4, 1), (1, 16)):
        args = (runner.params, runner.kv, *runner.pack([None] * B, B, T))
        text = runner.step_fn(B, T).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert ("tpu_custom_call" if platform == "tpu" else "mosaic_gpu") in text  # the real kernel
        codes = {"int8": "xi8", "int4": "xui8", "fp8": "xf8E4M3FN"}[scheme]
        assert codes in text  # the weights enter the step as codes, not as floats


def _awq_folder(src, out, group=32):
    """`src`'s HF folder with every layer linear as an AutoAWQ gemm tensor triple (random codes,
    zero points and scales, packed by the reference packer of tests/test_quant_import.py), and
    the dequantized weights each stands for."""
    from safetensors.numpy import load_file, save_file

    from test_quant_import import ref_pack_awq, reference

    rng = np.random.default_rng(5)
    shutil.copytree(src, out)
    tensors, want = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not (name.endswith("proj.weight") and ".layers." in name):
            tensors[name] = w
            continue
        N, K = w.shape  # HF linears are [out, in]
        q = rng.integers(0, 16, (K, N))
        z = rng.integers(0, 16, (K // group, N))
        s = (rng.random((K // group, N)) * 0.02 + 0.001).astype(np.float16)
        module = name[:-len(".weight")]
        tensors |= {module + ".qweight": ref_pack_awq(q), module + ".qzeros": ref_pack_awq(z), module + ".scales": s}
        want[name] = reference(q, z, s, group)
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}
    (out / "config.json").write_text(json.dumps(cfg))
    return want


def test_awq_folder_converts_to_int4_and_serves_after_the_gate(tiny_hf_folder, tmp_path):  # noqa: F811
    """An AWQ safetensors folder loads as jserve int4 without a float copy, each linear equal to
    (q - z) * s; the checkpoint has no float source, so the gate waits for a report against one."""
    from jserve import LLM, SamplingParams
    from jserve.model.sources import _map_hf_name

    want = _awq_folder(tiny_hf_folder, tmp_path / "awq")
    convert(tmp_path / "awq", tmp_path / "ckpt", progress=False)
    config, params, generation = load_checkpoint(tmp_path / "ckpt", host=True)
    record = generation["quantization"]
    assert record["label"].startswith("awq int4 g32") and record["source"] is None
    for hf_name, w in want.items():
        name, layer, _ = _map_hf_name(hf_name)
        got = quant.dequantize(jax.tree.map(lambda a: a[layer], params[name]))
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)  # (q - z) * s up to the offset's rounding
    settings = dict(max_num_seqs=2, max_model_len=64, warmup=False)
    with pytest.raises(quality_gate.QualityGateError, match="--reference"):
        LLM(str(tmp_path / "ckpt"), **settings)
    llm = LLM(str(tmp_path / "ckpt"), quality_gate="warn", **settings)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())
    cfg["quantization_config"]["version"] = "gemv"
    (tmp_path / "awq" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gemv"):
        convert(tmp_path / "awq", tmp_path / "ckpt2", progress=False)

"""PEFT LoRA adapters read into jserve's layout (`jserve.model.lora_adapters`): each module's
delta against PEFT's formula computed here from the safetensors, every refusal, and the adapters
that Hugging Face PEFT made for the tiny arch checkpoints (tests/data/lora)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import DATA
from jserve.model.config import ModelConfig
from jserve.model.hub import HubError
from jserve.model.lora_adapters import LORA_TARGETS, LoraError, load_adapter, target_shapes

LLAMA = ModelConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=4)
PHI3 = ModelConfig(architecture="phi3", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=4)
MOE = ModelConfig(architecture="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=8)
# HF module -> (in, out) for LLAMA / PHI3 (hidden 16, q 16, kv 8, intermediate 24)
HF_SHAPES = {"self_attn.q_proj": (16, 16), "self_attn.k_proj": (16, 8), "self_attn.v_proj": (16, 8),
             "self_attn.o_proj": (16, 16), "mlp.gate_proj": (16, 24), "mlp.up_proj": (16, 24),
             "mlp.down_proj": (24, 16), "self_attn.qkv_proj": (16, 32), "mlp.gate_up_proj": (16, 48)}
OURS = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
        "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up", "mlp.down_proj": "w_down"}
ALL = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
       "mlp.up_proj", "mlp.down_proj"]


def key(layer: int, module: str, ab: str) -> str:
    return f"base_model.model.model.layers.{layer}.{module}.lora_{ab}.weight"


def write_adapter(folder, modules, *, r=8, alpha=16, layers=(0, 1), ranks=None, seed=0, **config):
    """A PEFT-style adapter folder: random lora_A [r, in] / lora_B [out, r] for each module and layer
    (`ranks`: module path -> its own rank), and adapter_config.json with `config` over the defaults."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in layers:
        for module in modules:
            n_in, n_out = HF_SHAPES[module]
            rank = (ranks or {}).get(f"model.layers.{layer}.{module}", r)
            tensors[key(layer, module, "A")] = rng.normal(0, 0.3, (rank, n_in)).astype(np.float32)
            tensors[key(layer, module, "B")] = rng.normal(0, 0.3, (n_out, rank)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=sorted({m.split(".")[-1] for m in modules}),
               bias="none", modules_to_save=None, use_rslora=False, use_dora=False, rank_pattern={},
               alpha_pattern={}, layers_to_transform=None, lora_dropout=0.0)
    cfg.update(config)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return tensors


def peft_delta(tensors, layer: int, module: str, x: np.ndarray, scaling: float) -> np.ndarray:
    """PEFT's LoRA output for `module`: lora_B(lora_A(x)) * scaling, with torch Linear's x @ W.T."""
    a, b = tensors[key(layer, module, "A")], tensors[key(layer, module, "B")]
    return (x @ a.T) @ b.T * scaling


def ours(adapter, target: str, layer: int, x: np.ndarray) -> np.ndarray:
    a, b = adapter.weights[target]
    return (x @ a[layer]) @ b[layer]


def x_for(target: str, config=LLAMA) -> np.ndarray:
    return np.random.default_rng(7).normal(size=(3, target_shapes(config)[target][0])).astype(np.float32)


def test_every_target_matches_peft(tmp_path):
    tensors = write_adapter(tmp_path / "a", ALL, r=8, alpha=16)
    adapter = load_adapter(tmp_path / "a", LLAMA)
    assert (adapter.name, adapter.path, adapter.rank) == ("a", str(tmp_path / "a"), 8)
    assert sorted(adapter.weights) == sorted(LORA_TARGETS)
    for module, target in OURS.items():
        a, b = adapter.weights[target]
        n_in, n_out = HF_SHAPES[module]
        assert a.shape == (2, n_in, 8) and b.shape == (2, 8, n_out) and a.dtype == b.dtype == np.float32
        for layer in (0, 1):
            x = x_for(target)
            np.testing.assert_allclose(ours(adapter, target, layer, x), peft_delta(tensors, layer, module, x, 2.0),
                                       rtol=1e-5, atol=1e-5)
    # x @ w + delta with the base weight too: the whole linear as PEFT computes it
    w_hf = np.random.default_rng(3).normal(size=(16, 16)).astype(np.float32)  # q_proj.weight [out, in]
    x = x_for("wq")
    np.testing.assert_allclose(x @ w_hf.T + ours(adapter, "wq", 1, x),
                               x @ w_hf.T + peft_delta(tensors, 1, "self_attn.q_proj", x, 2.0), rtol=1e-5, atol=1e-5)


def test_rslora_scales_by_alpha_over_sqrt_r_and_only_targets_appear(tmp_path):
    tensors = write_adapter(tmp_path / "b", ["self_attn.q_proj", "self_attn.v_proj"], r=4, alpha=8, use_rslora=True)
    adapter = load_adapter(tmp_path / "b", LLAMA, name="mine")
    assert adapter.name == "mine" and sorted(adapter.weights) == ["wq", "wv"] and adapter.rank == 4
    x = x_for("wv")
    np.testing.assert_allclose(ours(adapter, "wv", 0, x), peft_delta(tensors, 0, "self_attn.v_proj", x, 4.0),
                               rtol=1e-5, atol=1e-5)


def test_rank_and_alpha_patterns_apply_to_their_modules_only(tmp_path):
    ranks = {"model.layers.1.mlp.down_proj": 4}
    tensors = write_adapter(tmp_path / "c", ALL, r=8, alpha=16, ranks=ranks, rank_pattern=ranks,
                            alpha_pattern={"o_proj": 32})
    adapter = load_adapter(tmp_path / "c", LLAMA)
    assert adapter.rank == 8
    a, b = adapter.weights["w_down"]
    assert not a[1, :, 4:].any() and not b[1, 4:].any() and a[0, :, 4:].any()  # rank 4: the rest zeros
    for layer, module, scaling in ((1, "mlp.down_proj", 16 / 4), (0, "mlp.down_proj", 2.0),
                                   (0, "self_attn.o_proj", 4.0), (1, "self_attn.o_proj", 4.0),
                                   (1, "self_attn.q_proj", 2.0)):
        x = x_for(OURS[module])
        np.testing.assert_allclose(ours(adapter, OURS[module], layer, x),
                                   peft_delta(tensors, layer, module, x, scaling), rtol=1e-5, atol=1e-5)


def test_layers_to_transform_leaves_other_layers_zero(tmp_path):
    tensors = write_adapter(tmp_path / "l", ["self_attn.q_proj"], layers=(1,), layers_to_transform=[1])
    adapter = load_adapter(tmp_path / "l", LLAMA)
    a, b = adapter.weights["wq"]
    assert not a[0].any() and not b[0].any()
    x = x_for("wq")
    np.testing.assert_allclose(ours(adapter, "wq", 1, x), peft_delta(tensors, 1, "self_attn.q_proj", x, 2.0),
                               rtol=1e-5, atol=1e-5)
    write_adapter(tmp_path / "bad", ["self_attn.q_proj"], layers=(0, 1), layers_to_transform=1)
    with pytest.raises(LoraError, match=r"'model.layers.0.self_attn.q_proj', a layer outside its "
                                        r"layers_to_transform \[1\]"):
        load_adapter(tmp_path / "bad", LLAMA)


def test_phi3_fused_modules_split_like_the_base_weights(tmp_path):
    tensors = write_adapter(tmp_path / "p", ["self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj",
                                             "mlp.down_proj"], r=8, alpha=8)
    adapter = load_adapter(tmp_path / "p", PHI3)
    assert sorted(adapter.weights) == sorted(LORA_TARGETS)
    for module, parts in (("self_attn.qkv_proj", (("wq", 0, 16), ("wk", 16, 24), ("wv", 24, 32))),
                          ("mlp.gate_up_proj", (("w_gate", 0, 24), ("w_up", 24, 48)))):
        x = x_for("wq", PHI3)
        fused = peft_delta(tensors, 1, module, x, 1.0)  # [3, q + k + v] / [3, gate + up]
        for target, lo, hi in parts:
            np.testing.assert_array_equal(adapter.weights[target][0][1], tensors[key(1, module, "A")].T)
            np.testing.assert_allclose(ours(adapter, target, 1, x), fused[:, lo:hi], rtol=1e-5, atol=1e-5)


def _break(tmp_path, what: str):
    """An adapter folder with one thing wrong; (folder, config, max_rank, expected message)."""
    folder = tmp_path / "bad"
    tensors = write_adapter(folder, ["self_attn.q_proj", "mlp.down_proj"])
    cfg = json.loads((folder / "adapter_config.json").read_text())
    config, max_rank = LLAMA, None

    def retensor(**extra):
        save_file({**tensors, **extra}, str(folder / "adapter_model.safetensors"))

    if what == "no config":
        (folder / "adapter_config.json").unlink()
        return folder, config, max_rank, "has no adapter_config.json"
    if what in ("no weights", "pickle"):
        (folder / "adapter_model.safetensors").unlink()
        if what == "pickle":
            (folder / "adapter_model.bin").write_bytes(b"\x80\x04.")
            return folder, config, max_rank, ("has only adapter_model.bin, a pickle .*: convert it to "
                                              "adapter_model.safetensors")
        return folder, config, max_rank, "has no adapter_model.safetensors"
    changes = {"prefix": ({"peft_type": "PREFIX_TUNING"}, "peft_type 'PREFIX_TUNING' is not LORA"),
               "modules_to_save": ({"modules_to_save": ["lm_head"]}, r"modules_to_save \['lm_head'\]"),
               "dora": ({"use_dora": True}, "use_dora = True is not supported"),
               "bias": ({"bias": "lora_only"}, "bias 'lora_only' is not supported"),
               "r mismatch": ({"r": 4}, "'model.layers.0.mlp.down_proj' have rank 8 but adapter_config.json "
                                        "gives it r = 4")}
    if what in changes:
        cfg.update(changes[what][0])
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
        return folder, config, max_rank, changes[what][1]
    z = np.zeros
    if what == "embed_tokens":
        retensor(**{"base_model.model.model.embed_tokens.lora_embedding_A": z((8, 32), np.float32)})
        return folder, config, max_rank, "targets 'model.embed_tokens', which jserve cannot apply"
    if what == "lm_head":
        retensor(**{"base_model.model.lm_head.lora_A.weight": z((8, 16), np.float32)})
        return folder, config, max_rank, "targets 'lm_head', which jserve cannot apply"
    if what == "shape":
        retensor(**{key(1, "self_attn.q_proj", "B"): z((12, 8), np.float32)})
        return folder, config, max_rank, (r"'model.layers.1.self_attn.q_proj.lora_B.weight' has shape \[12, 8\], "
                                          r"expected \[16, 8\]")
    if what == "too many layers":
        retensor(**{key(2, "self_attn.q_proj", "A"): z((8, 16), np.float32),
                    key(2, "self_attn.q_proj", "B"): z((16, 8), np.float32)})
        return folder, config, max_rank, "layer 2, but the model has 2 layers"
    if what == "A without B":
        retensor(**{key(1, "self_attn.k_proj", "A"): z((8, 16), np.float32)})
        return folder, config, max_rank, "k_proj.lora_A without its lora_B"
    if what == "max_rank":
        return folder, config, 4, "has rank 8, above max_rank 4"
    if what == "moe mlp":
        return folder, MOE, max_rank, "'model.layers.0.mlp.down_proj': jserve cannot apply LoRA to experts'"
    assert what == "moe experts"
    tensors = {k: v for k, v in tensors.items() if "self_attn" in k}
    retensor(**{key(0, "mlp.experts.0.up_proj", "A"): z((8, 16), np.float32),
                key(0, "mlp.experts.0.up_proj", "B"): z((8, 8), np.float32)})
    return folder, MOE, max_rank, "'model.layers.0.mlp.experts.0.up_proj': jserve cannot apply LoRA to experts'"


@pytest.mark.parametrize("what", ["no config", "no weights", "pickle", "prefix", "modules_to_save", "dora", "bias",
                                  "r mismatch", "embed_tokens", "lm_head", "shape", "too many layers", "A without B",
                                  "max_rank", "moe mlp", "moe experts"])
def test_refusals_are_one_line_naming_the_value(tmp_path, what):
    folder, config, max_rank, message = _break(tmp_path, what)
    with pytest.raises(LoraError, match=message) as e:
        load_adapter(folder, config, max_rank=max_rank)
    assert "\n" not in str(e.value)


def test_moe_attention_targets_load(tmp_path):
    tensors = write_adapter(tmp_path / "m", ["self_attn.q_proj", "self_attn.o_proj"])
    adapter = load_adapter(tmp_path / "m", MOE)
    x = x_for("wo", MOE)
    np.testing.assert_allclose(ours(adapter, "wo", 1, x), peft_delta(tensors, 1, "self_attn.o_proj", x, 2.0),
                               rtol=1e-5, atol=1e-5)


def test_hub_id_offline_without_cache_names_the_id(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match="jserve-test/no-such-adapter"):
        load_adapter("jserve-test/no-such-adapter", LLAMA, download_dir=tmp_path / "cache")
    with pytest.raises(LoraError, match="'no/such/thing' is neither a folder nor a Hugging Face Hub id"):
        load_adapter("no/such/thing", LLAMA)
    (tmp_path / "f.safetensors").write_bytes(b"")
    with pytest.raises(LoraError, match="is a file: give its folder"):
        load_adapter(tmp_path / "f.safetensors", LLAMA)


def _golden(model: str, adapter: str):
    config = ModelConfig.from_hf_config(json.loads((DATA / "arch" / model / "config.json").read_text()))
    folder = DATA / "lora" / model / adapter
    return config, folder, load_file(str(folder / "adapter_model.safetensors")), json.loads(
        (folder / "adapter_config.json").read_text())


# the scaling PEFT gives each module of the generated adapters (tests/data/lora/README.md)
GOLDEN_SCALING = {"a": lambda layer, module: 16 / 8, "b": lambda layer, module: 8 / 4 ** 0.5,
                  "c": lambda layer, module: {(1, "mlp.down_proj"): 16 / 4,
                                              (0, "self_attn.o_proj"): 64 / 16}.get((layer, module), 1.0)}


@pytest.mark.parametrize("adapter_name", ["a", "b", "c"])
@pytest.mark.parametrize("model", ["llama3", "qwen2"])
def test_peft_made_adapters_fold_their_scaling(model, adapter_name):
    config, folder, tensors, cfg = _golden(model, adapter_name)
    adapter = load_adapter(folder, config, max_rank=16)
    assert adapter.rank == cfg["r"]
    shapes = target_shapes(config)
    modules = {k.split(".layers.")[1].split(".lora_")[0] for k in tensors}
    assert {OURS[m.split(".", 1)[1]] for m in modules} == set(adapter.weights)
    for m in modules:
        layer, module = int(m.split(".")[0]), m.split(".", 1)[1]
        a, b = tensors[key(layer, module, "A")], tensors[key(layer, module, "B")]
        ours_a, ours_b = (w[layer] for w in adapter.weights[OURS[module]])
        (n_in, n_out), r = shapes[OURS[module]], a.shape[0]
        assert ours_a.shape == (n_in, cfg["r"]) and ours_b.shape == (cfg["r"], n_out)
        np.testing.assert_array_equal(ours_a[:, :r], a.T)
        np.testing.assert_allclose(ours_b[:r], b.T * GOLDEN_SCALING[adapter_name](layer, module), rtol=1e-6)
        assert not ours_a[:, r:].any() and not ours_b[r:].any()


@pytest.mark.parametrize("adapter_name", ["a", "b", "c"])
@pytest.mark.parametrize("model", ["llama3", "qwen2"])
def test_merged_into_the_base_weights_gives_peft_logits(model, adapter_name):
    """w + A @ B for every target, through jserve's own forward (test_model_arch's), gives the logits
    PEFT computed with the adapter (tests/data/lora/<model>/reference.npz)."""
    from jserve.model.checkpoint import read_params
    from test_model_arch import _forward

    config, params = read_params(DATA / "arch" / model)
    adapter = load_adapter(DATA / "lora" / model / adapter_name, config)
    for target, (a, b) in adapter.weights.items():
        params[target] = params[target] + a @ b
    ref = np.load(DATA / "lora" / model / "reference.npz")
    ids = np.load(DATA / "arch" / model / "reference.npz")["input_ids"]
    logits = _forward(config, params, ids)
    np.testing.assert_allclose(logits, ref[f"logits_{adapter_name}"], atol=1e-4, rtol=0)
    assert np.abs(logits - ref["logits_base"]).max() > 0.3  # the adapter matters


def test_hub_id_resolves_from_the_cache_offline(tmp_path, monkeypatch):
    """A Hub id offline: its snapshot in a Hub cache (refs/main -> snapshots/<commit>) is read, and
    the adapter's path is that snapshot's folder; a revision not cached is a HubError naming it."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    storage = tmp_path / "cache" / "models--jserve-test--tiny-lora"
    snapshot = storage / "snapshots" / ("c" * 40)
    tensors = write_adapter(snapshot, ["self_attn.q_proj"])
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text("c" * 40)
    adapter = load_adapter("jserve-test/tiny-lora", LLAMA, download_dir=tmp_path / "cache")
    assert adapter.name == "jserve-test/tiny-lora" and adapter.path == str(snapshot)
    x = x_for("wq")
    np.testing.assert_allclose(ours(adapter, "wq", 0, x), peft_delta(tensors, 0, "self_attn.q_proj", x, 2.0),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(HubError, match="jserve-test/tiny-lora at revision 'v2'"):
        load_adapter("jserve-test/tiny-lora", LLAMA, revision="v2", download_dir=tmp_path / "cache")

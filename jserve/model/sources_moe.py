"""Mixture-of-experts tensors into the checkpoint layout (`jserve.model.sources` reads the rest).

The router and shared expert map by name like any per-layer weight (`HF_MOE_LAYER`); the experts'
own weights, one expert's or every expert's stacked (HF's, transformers 5's fused gate_up_proj,
llama.cpp's ffn_*_exps), are placed by `place_expert` into [layers, experts, in, out] arrays.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jserve.model import quant
from jserve.model.config import ModelConfig

__all__ = ["GGUF_MOE_LAYER", "HF_MOE_LAYER", "place_expert"]

# Mixture of experts. Per-layer HF names (after "model.layers.{i}.") of the router and the shared
# expert -> (our name, transpose?); Mixtral's block_sparse_moe is read as mlp.
HF_MOE_LAYER = {
    "mlp.gate.weight": ("w_router", True),
    "mlp.shared_expert.gate_proj.weight": ("ws_gate", True),
    "mlp.shared_expert.up_proj.weight": ("ws_up", True),
    "mlp.shared_expert.down_proj.weight": ("ws_down", True),
    "mlp.shared_expert_gate.weight": ("ws_router", True),
}
# One expert's weights (after "model.layers.{i}.mlp.experts.{e}."; Mixtral's w1 / w3 / w2), [out, in].
_HF_EXPERT = {"gate_proj.weight": "we_gate", "up_proj.weight": "we_up", "down_proj.weight": "we_down",
              "w1.weight": "we_gate", "w3.weight": "we_up", "w2.weight": "we_down"}
# Every expert's, stacked [experts, out, in] (after "model.layers.{i}.mlp.experts."): what the GGUF
# reader names llama.cpp's ffn_*_exps; transformers 5's fused gate_up_proj [experts, 2 * ffn, in]
# is split in two.
_HF_EXPERTS_STACKED = {"gate_proj": "we_gate", "up_proj": "we_up", "down_proj": "we_down",
                       "gate_up_proj": "we_gate_up"}
GGUF_MOE_LAYER = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj", "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


def place_expert(config: ModelConfig, hf_name: str, load: Callable[[], Any], params: dict[str, Any],
                 filled: dict[tuple[str, int], set[int]]) -> bool:
    """Put a MoE tensor that is not a plain per-layer weight (an expert's, or every expert's
    stacked) into `params`; False for any other name. Records (name, layer) -> experts read."""
    parts = hf_name.replace(".block_sparse_moe.", ".mlp.").split(".")
    if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and \
            parts[3:] == ["mlp", "shared_expert_gate", "weight"] and "ws_router" in params:
        layer = int(parts[2])  # [1, hidden] (HF), or [hidden] as llama.cpp's ffn_gate_inp_shexp may be
        if layer >= config.num_layers:
            raise ValueError(f"tensor {hf_name!r} names layer {layer} but the model has {config.num_layers} layers")
        array = _float(load(), hf_name).reshape(-1, 1)
        if array.shape != params["ws_router"][layer].shape:
            raise ValueError(f"tensor {hf_name!r} has {array.size} values, expected {config.hidden_size}")
        params["ws_router"][layer][...] = array
        filled.setdefault(("ws_router", layer), set()).update(range(config.num_experts))
        return True
    if len(parts) < 6 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp", "experts"] \
            or not parts[2].isdigit():
        return False
    layer, rest = int(parts[2]), ".".join(parts[5:])
    if layer >= config.num_layers:
        raise ValueError(f"tensor {hf_name!r} names layer {layer} but the model has {config.num_layers} layers")
    E, F = config.num_experts, config.moe_intermediate_size
    if parts[5].isdigit() and ".".join(parts[6:]) in _HF_EXPERT:  # one expert, [out, in]
        name, expert = _HF_EXPERT[".".join(parts[6:])], int(parts[5])
        if expert >= E:
            raise ValueError(f"tensor {hf_name!r} names expert {expert} but the model has {E} experts")
        target = params[name][layer, expert]
        array = _float(load(), hf_name).T
        if array.shape != target.shape:
            raise ValueError(f"tensor {hf_name!r} has shape {array.T.shape}, expected {target.T.shape}")
        target[...] = array
        filled.setdefault((name, layer), set()).add(expert)
        return True
    if rest not in _HF_EXPERTS_STACKED:
        return False
    name = _HF_EXPERTS_STACKED[rest]
    array = np.swapaxes(_float(load(), hf_name), 1, 2)  # [experts, in, out]
    pieces = [("we_gate", array[..., :F]), ("we_up", array[..., F:])] if name == "we_gate_up" else [(name, array)]
    for name, a in pieces:
        target = params[name][layer]
        if a.shape != target.shape:
            raise ValueError(f"tensor {hf_name!r} has shape {a.shape} (as [experts, in, out]), "
                             f"expected {target.shape}")
        target[...] = a
        filled.setdefault((name, layer), set()).update(range(E))
    return True


def _float(array: Any, hf_name: str) -> np.ndarray:
    if quant.is_quantized(array):
        raise ValueError(f"quantized expert weights are not supported yet ({hf_name!r}): read them as floats")
    return np.asarray(array, np.float32)

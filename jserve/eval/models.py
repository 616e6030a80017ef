"""The models an evaluation compares: loaded from checkpoints, or given in memory, optionally
quantized at load (`jserve.model.quant.quantize_params` with a `QuantSpec`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

from jserve.model.config import ModelConfig


@dataclasses.dataclass
class EvalModel:
    """A model's checkpoint-layout weights with what the evaluation needs beside them."""

    config: ModelConfig
    params: dict[str, Any]  # stacked per-layer arrays (float, or QuantizedWeight leaves)
    tokenizer: Any = None  # jserve.text.tokenizer.Tokenizer (the text's and the prompts' tokens)
    eos_token_ids: Sequence[int] = ()
    label: str = "model"
    path: str | None = None  # the checkpoint folder, when loaded from one
    source: str | None = None  # generation.json's source (the GGUF or HF folder converted)
    quantization: dict | None = None  # QuantSpec.to_json() when quantized at load

    @property
    def dtype(self) -> str:
        return str(self.params["final_norm"].dtype)

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "path": self.path, "dtype": self.dtype, "quantization": self.quantization,
                "weights": _weights_description(self.params)}


def _weights_description(params: dict[str, Any]) -> str:
    """"float32", or the quantized weights' schemes ("int4 g32 asymmetric, embed int8 g576 symmetric")."""
    from jserve.model import quant

    kinds = sorted({w.describe() for name, w in params.items() if name != "embed" and quant.is_quantized(w)})
    embed = params.get("embed")
    text = ", ".join(kinds) if kinds else str(params["final_norm"].dtype)
    if quant.is_quantized(embed):
        text += f", embed {embed.describe()}"
    return text


def load_model(model: str | os.PathLike | None, *, dtype: str | None = None, label: str | None = None) -> EvalModel:
    """A checkpoint (or anything `resolve_model` converts: a GGUF, an HF folder, a name; None for
    the default model) with its tokenizer; `dtype` casts float weights while restoring."""
    from jserve.model.checkpoint import load_checkpoint, resolve_model
    from jserve.text.tokenizer import Tokenizer

    path = resolve_model(model, dtype=dtype or "float32")
    config, params, generation = load_checkpoint(path, dtype=dtype)
    tokenizer = Tokenizer.load(path)
    eos = generation.get("eos_token_ids") or list(tokenizer.eos_token_ids)
    return EvalModel(config, dict(params), tokenizer, eos, label or Path(path).name, str(path),
                     generation.get("source"))


def quantized(model: EvalModel, spec: Any, label: str | None = None) -> EvalModel:
    """`model` with its weights quantized by `spec` (a `jserve.model.quant.QuantSpec`)."""
    try:
        from jserve.model.quant import quantize_params
    except ImportError:
        raise ValueError("this jserve has no jserve.model.quant.quantize_params: quantization at load "
                         "is not available") from None
    params = quantize_params(model.config, model.params, spec)
    return dataclasses.replace(model, params=params, label=label or f"{model.label} {spec.label()}",
                               quantization=spec.to_json())


def parse_quantization(name: str | None, group_size: int | None = None) -> Any:
    """`--quantization NAME [--group-size G]` -> a QuantSpec, or None."""
    if name is None:
        if group_size is not None:
            raise ValueError("--group-size needs --quantization")
        return None
    from jserve.model.quant import QuantSpec

    return QuantSpec.parse(name, group_size)

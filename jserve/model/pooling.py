"""How an embedding model turns its final hidden states into one vector per input: the pooling
(last token, mean, first token), normalisation and the Matryoshka sizes it allows.

Read as vLLM does from a sentence-transformers folder (`modules.json`: a `Normalize` module;
`1_Pooling/config.json`: `pooling_mode_lasttoken` / `_mean_tokens` / `_cls_token`) and from
config.json (`is_matryoshka`, `matryoshka_dimensions`); `convert` records it in generation.json
(`pooling`), so a converted checkpoint serves embeddings on its own (`--task auto`).
Host-side numpy: the device pools per chunk (`jserve.runtime.pooled_steps`), this finishes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

POOLING_TYPES = ("last", "mean", "cls")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """`pooling`: one of `POOLING_TYPES`; `normalize`: L2-normalise the vector; `matryoshka`:
    None (no `dimensions` allowed), () (any size up to the hidden size) or the sizes allowed."""

    pooling: str = "last"
    normalize: bool = True
    matryoshka: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PoolingConfig":
        m = data.get("matryoshka")
        return cls(data.get("pooling", "last"), bool(data.get("normalize", True)), None if m is None else tuple(m))

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """ValueError naming `dimensions` where the model does not allow that size."""
        if dimensions is None:
            return
        if self.matryoshka is None:
            raise ValueError(f"dimensions={dimensions}: this model does not support Matryoshka embeddings "
                             "(its config declares no is_matryoshka / matryoshka_dimensions)")
        if not 1 <= dimensions <= hidden_size or (self.matryoshka and dimensions not in self.matryoshka):
            allowed = list(self.matryoshka) if self.matryoshka else f"1 .. {hidden_size}"
            raise ValueError(f"dimensions={dimensions} is not a size this model allows: {allowed}")

    def finish(self, total: np.ndarray, count: int, dimensions: int | None = None) -> np.ndarray:
        """The embedding from the pooled sum over a prompt's chunks (`count` tokens for mean):
        averaged, cut to `dimensions` (Matryoshka, before normalising, as vLLM does), normalised."""
        v = np.asarray(total, np.float32) / (count if self.pooling == "mean" else 1)
        if dimensions is not None:
            v = v[:dimensions]
        if self.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v


def read_sentence_transformers(folder: str | Path) -> PoolingConfig | None:
    """The pooling a Hugging Face folder declares (sentence-transformers files, config.json's
    Matryoshka fields), or None where it declares none (a generation model)."""
    folder = Path(folder)
    if not folder.is_dir() or not (folder / "modules.json").is_file():
        return None
    modules = json.loads((folder / "modules.json").read_text())
    types = [str(m.get("type", "")) for m in modules]
    pool_dir = next((m.get("path") for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    pooling = "last"
    if pool_dir is not None and (folder / pool_dir / "config.json").is_file():
        modes = json.loads((folder / pool_dir / "config.json").read_text())
        chosen = [name for key, name in _ST_MODES.items() if modes.get(key)]
        if len(chosen) != 1:
            raise ValueError(f"{folder / pool_dir / 'config.json'}: jserve pools by exactly one of "
                             f"{sorted(_ST_MODES)}, got {chosen or 'none'}")
        pooling = chosen[0]
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    dims = config.get("matryoshka_dimensions")
    matryoshka = tuple(dims) if dims else (() if config.get("is_matryoshka") else None)
    return PoolingConfig(pooling, any(t.endswith("Normalize") for t in types), matryoshka)


def declared_pooling(path: str | Path) -> PoolingConfig | None:
    """The pooling a model declares: a jserve checkpoint's (generation.json's `pooling`, written by
    `convert`) or a Hugging Face folder's (`read_sentence_transformers`); None for neither."""
    path = Path(path)
    generation = path / "generation.json"
    if generation.is_file():
        data = json.loads(generation.read_text()).get("pooling")
        return None if data is None else PoolingConfig.from_json(data)
    return read_sentence_transformers(path)

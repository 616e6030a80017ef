"""Rotary position embeddings' scaling (`RopeScaling`: Llama 3, linear, Phi-3's LongRoPE) and the
inverse frequencies a model's rotary tables are built from (`rope_inv_freq`)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jserve.model.config import ModelConfig

ROPE_TYPES = ("llama3", "linear", "longrope")
# Set in a step's rotary positions (`StepRow` -> the packed `positions`, never the attention's):
# the token rotates by LongRoPE's long factors. Positions stay below it.
LONG_ROPE_FLAG = 1 << 30


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: `llama3` (Llama 3.1/3.2), `linear` (position interpolation) or
    `longrope` (Phi-3's LongRoPE, "su": each rotary frequency divided by a factor of its own,
    `short_factor` for a sequence of at most `original_max_position_embeddings` tokens,
    `long_factor` beyond, and cos / sin times `attention_factor`)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be positive, got {self.factor}")
        for name in ("short_factor", "long_factor"):  # hashable, also when read back from JSON lists
            object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        if self.rope_type == "longrope":
            if not self.short_factor or len(self.short_factor) != len(self.long_factor):
                raise ValueError(f"longrope needs short_factor and long_factor of one length, got "
                                 f"{len(self.short_factor)} and {len(self.long_factor)}")
            if not all(f > 0 for f in self.short_factor + self.long_factor) or not self.attention_factor > 0:
                raise ValueError("longrope's factors and attention_factor must be positive")
            if self.original_max_position_embeddings < 1:
                raise ValueError(f"longrope's original_max_position_embeddings must be positive, "
                                 f"got {self.original_max_position_embeddings}")


def rope_inv_freq(config: ModelConfig, local: bool = False, long: bool = False) -> list[float]:
    """Rotary inverse frequencies (length rope_dim / 2), with Llama 3 / linear scaling applied;
    `local`: the sliding layers' own (`rope_local_theta`, unscaled: Gemma 3); LongRoPE: the short
    factors', or with `long` the long ones'."""
    dim = config.rope_dim
    theta = config.rope_local_theta if local else config.rope_theta
    if theta is None:
        raise ValueError("the model has no local rotary base (rope_local_theta)")
    inv = [1.0 / (theta ** (2 * i / dim)) for i in range(dim // 2)]
    s = None if local else config.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return [f / s.factor for f in inv]
    if s.rope_type == "longrope":
        return [f / e for f, e in zip(inv, s.long_factor if long else s.short_factor)]
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out

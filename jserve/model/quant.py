"""Quantized weights: jserve's one storage format for int8, int4 and fp8 matmul weights.

A `QuantizedWeight` stands for a float weight `w [..., K, N]` (in, out; per-layer weights carry a
leading layer axis) as integer (or fp8) codes `q` and per-group scales (and, asymmetric, offsets)
along K, the contraction axis:

    w[..., k, n] = scales[..., k // G, n] * q[..., k, n] (+ offsets[..., k // G, n])

in float32 (`dequantize`, the reference every kernel is tested against); G is the group size.
`QuantizedWeight`'s docstring gives the codes per scheme and why offsets are floats. See
docs/architecture.md, "Quantization".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jserve.model.config import LAYER_MATMULS

SCHEMES = ("int8", "int4", "fp8")
GROUP_SIZES = (32, 64, 128)  # int4's; int8 and fp8 default to one scale per output channel
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """Codes and per-group scales (and offsets) for a weight [..., K, N] (the module docstring has the formula).

    A registered pytree: the arrays are leaves (a scanned stack slices their layer axis like any
    weight's), `scheme` and `group_size` are static.

    G is the group size (K for one scale per output channel). Codes:

    - "int8": signed, q in [-128, 127], stored int8 [..., K, N] (llama.cpp's Q8_0 and Q6_K repack to it).
    - "int4": stored two per byte along K, uint8 [..., K / 2, N], row 2i in the low nibble and
      2i + 1 in the high one; symmetric codes are signed ([-8, 7], two's complement nibbles; Q4_0),
      asymmetric ones unsigned ([0, 15]) with an offset (the group's minimum; Q4_1, Q4_K).
    - "fp8": float8_e4m3fn codes [..., K, N], one scale per output channel.

    Offsets are a float ("min", llama.cpp's form) rather than an integer zero point ((q - z) * s, the
    form of Qwix, AQT, AWQ and GPTQ): `d * q + m` is how GGUF's Q4_1 and Q4_K dequantize, so their
    weights repack without changing a bit; a zero point cannot represent them exactly. Scales and
    offsets are float16 where that is exact (GGUF's Q8_0, Q4_0, Q4_1, and `quantize`'s own choice:
    the scale is rounded to float16 first and the codes computed with the rounded scale), else
    float32 (Q4_K and Q6_K's products of two scales).
    """

    values: Any
    scales: Any
    offsets: Any = None
    scheme: str = dataclasses.field(default="int8", metadata=dict(static=True))
    group_size: int = dataclasses.field(default=0, metadata=dict(static=True))

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization scheme must be one of {SCHEMES}, got {self.scheme!r}")

    @property
    def symmetric(self) -> bool:
        return self.offsets is None

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape [..., K, N]."""
        *lead, k, n = self.values.shape
        return (*lead, k * 2 if self.scheme == "int4" else k, n)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in (self.values, self.scales, self.offsets) if a is not None)

    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / float(np.prod(self.shape))

    def describe(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.scheme} g{self.group_size} {kind}"


def is_quantized(w: Any) -> bool:
    return isinstance(w, QuantizedWeight)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How `quantize_params` quantizes a float model: the layer matmuls with `scheme` in groups of
    `group_size` along K (0: one group per output channel), the embedding and LM head with
    `embed_scheme` per channel ("int8" for int8 and int4, "fp8" for fp8; None keeps them float)."""

    scheme: str
    group_size: int = 0
    symmetric: bool = True
    embed_scheme: str | None = "int8"

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization must be one of {SCHEMES}, got {self.scheme!r}")
        if self.scheme == "int4" and self.group_size not in GROUP_SIZES:
            raise ValueError(f"int4 needs a group size of {GROUP_SIZES}, got {self.group_size}")
        if self.scheme == "fp8" and (self.group_size or not self.symmetric):
            raise ValueError("fp8 is symmetric with one scale per output channel (no group size)")
        if self.scheme == "int8" and not self.symmetric:
            raise ValueError("int8 is symmetric (asymmetric codes are int4's)")
        if self.group_size < 0 or self.group_size and self.group_size % 2:
            raise ValueError(f"group size must be a positive even number, got {self.group_size}")

    @classmethod
    def parse(cls, name: str, group_size: int | None = None, symmetric: bool | None = None) -> "QuantSpec":
        """The spec for `--quantize NAME` with an optional `--group-size` (int4 default 32,
        asymmetric as llama.cpp's Q4_1; int8 and fp8 per channel)."""
        if name not in SCHEMES:
            raise ValueError(f"quantization must be one of {SCHEMES}, got {name!r}")
        if name == "int4":
            return cls("int4", 32 if group_size is None else group_size,
                       False if symmetric is None else symmetric, "int8")
        if name == "fp8":
            return cls("fp8", group_size or 0, True, "fp8")
        return cls("int8", group_size or 0, True if symmetric is None else symmetric, "int8")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "QuantSpec":
        return cls(**d)

    def label(self) -> str:
        g = f" g{self.group_size}" if self.group_size else " per-channel"
        return f"{self.scheme}{g} {'sym' if self.symmetric else 'asym'}"


# ----------------------------------------------------------------------------------- int4 codes

def pack_int4(q: np.ndarray) -> np.ndarray:
    """Codes [..., K, N] (signed [-8, 7] or unsigned [0, 15]) -> uint8 [..., K / 2, N] nibble pairs."""
    q = np.asarray(q)
    if q.shape[-2] % 2:
        raise ValueError(f"int4 needs an even K, got shape {q.shape}")
    nib = (q.astype(np.int16) & 0xF).astype(np.uint8)
    return (nib[..., 0::2, :] | (nib[..., 1::2, :] << 4)).astype(np.uint8)


def unpack_int4(packed, signed: bool, xp=np):
    """uint8 [..., K / 2, N] -> int8 codes [..., K, N] (`xp`: numpy or jax.numpy)."""
    lo = packed & 0xF
    hi = (packed >> 4) & 0xF
    q = xp.stack([lo, hi], axis=-2)  # [..., K / 2, 2, N]
    q = q.reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1]).astype(xp.int8)
    if signed:
        q = xp.where(q >= 8, q - 16, q).astype(xp.int8)
    return q


def codes(w: QuantizedWeight, xp=np):
    """The integer (or fp8) codes [..., K, N] of `w`."""
    if w.scheme == "int4":
        return unpack_int4(w.values, w.symmetric, xp)
    return w.values


# ----------------------------------------------------------------------------------- reference

def dequantize(w: QuantizedWeight, dtype=np.float32, xp=np):
    """The float weight [..., K, N] that `w` stands for, computed in float32 as the module
    docstring's formula (numpy by default: the reference; `xp=jnp` traces it)."""
    q = codes(w, xp).astype(xp.float32)
    *lead, K, N = q.shape
    groups = w.scales.shape[-2]
    g = K // groups
    q = q.reshape(*lead, groups, g, N)
    out = q * w.scales.astype(xp.float32)[..., :, None, :]
    if w.offsets is not None:
        out = out + w.offsets.astype(xp.float32)[..., :, None, :]
    return out.reshape(*lead, K, N).astype(dtype)


def quantize(w: np.ndarray, scheme: str, group_size: int = 0, symmetric: bool = True) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight [..., K, N] in groups of `group_size` along K
    (0: per output channel). Scales (and offsets) are float16, rounded before the codes are
    computed so that `dequantize` reproduces exactly what was rounded to."""
    w = np.asarray(w, np.float32)
    *lead, K, N = w.shape
    G = group_size or K
    if K % G:
        raise ValueError(f"group size {G} does not divide the weight's input dimension {K}")
    if scheme == "fp8" and group_size:
        raise ValueError("fp8 has one scale per output channel")
    wg = w.reshape(*lead, K // G, G, N)
    if scheme == "int8" or scheme == "fp8" or symmetric:
        if scheme == "int8":
            qmax, lo, hi = 127.0, -128, 127
        elif scheme == "int4":
            qmax, lo, hi = 7.0, -8, 7
        else:
            qmax = FP8_MAX
        amax = np.abs(wg).max(axis=-2)
        scale = (amax / qmax).astype(np.float16)
        scale = np.where(scale == 0, np.float16(1), scale)
        if not np.isfinite(scale).all():
            raise ValueError("a weight group's scale overflows float16")
        s = scale.astype(np.float32)[..., None, :]
        if scheme == "fp8":
            q = np.clip(wg / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
            return QuantizedWeight(q.reshape(*lead, K, N), scale, None, "fp8", K)
        q = np.clip(np.rint(wg / s), lo, hi).astype(np.int8).reshape(*lead, K, N)
        values = pack_int4(q) if scheme == "int4" else q
        return QuantizedWeight(values, scale, None, scheme, G)
    if scheme != "int4":
        raise ValueError(f"asymmetric quantization is int4's, got {scheme!r}")
    wmin = wg.min(axis=-2)
    wmax = wg.max(axis=-2)
    offset = wmin.astype(np.float16)
    scale = ((wmax - offset.astype(np.float32)) / 15.0).astype(np.float16)
    scale = np.where(scale == 0, np.float16(1), scale)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        raise ValueError("a weight group's scale or offset overflows float16")
    s, m = scale.astype(np.float32)[..., None, :], offset.astype(np.float32)[..., None, :]
    q = np.clip(np.rint((wg - m) / s), 0, 15).astype(np.int8).reshape(*lead, K, N)
    return QuantizedWeight(pack_int4(q), scale, offset, "int4", G)


# ----------------------------------------------------------------------------------- XLA matmul

def xla_quantized_linear(x: jax.Array, w: QuantizedWeight, out_dtype=None) -> jax.Array:
    """x [..., K] @ w in `out_dtype` (default x's), as XLA ops (the XLA backends' quantized linear).

    Per channel (one group): the codes are converted in the dot's operand and the scale applied to
    the [.., N] product, so the weight is read as codes. In groups: x is split into its K / G
    groups and contracted with each group's codes (a dot batched over groups), the per-group
    products scaled and summed, and the offsets' share added as sum_k x[k] per group times the
    offset: the weight is never materialised as floats.
    """
    q = codes(w, jnp)
    *_, K, N = q.shape
    groups = w.scales.shape[-2]
    cdt = x.dtype if x.dtype != jnp.float8_e4m3fn else jnp.bfloat16
    scales = w.scales.astype(jnp.float32)
    if groups == 1:
        y = jnp.dot(x, q.astype(cdt), preferred_element_type=jnp.float32) * scales[0]
        if w.offsets is not None:
            y = y + jnp.sum(x.astype(jnp.float32), axis=-1, keepdims=True) * w.offsets.astype(jnp.float32)[0]
        return y.astype(out_dtype or x.dtype)
    G = K // groups
    lead = x.shape[:-1]
    xg = x.reshape(-1, groups, G)
    offsets = None if w.offsets is None else w.offsets.astype(jnp.float32)
    if offsets is not None and w.scheme == "int4":
        # Unsigned codes centred on 0 (q - 8; the offset takes 8 steps): the partial sums then do not
        # carry a large common term that the offsets' share cancels (bfloat16 partials lose it).
        q = q - 8
        offsets = offsets + 8 * scales
    qg = q.reshape(groups, G, N).astype(cdt)
    # float32 partial sums for float32 activations; a bfloat16 model's come back rounded once to
    # bfloat16, as its float matmuls' products do (XLA:CPU has no batched bf16 x bf16 -> f32 dot).
    part = jnp.einsum("mgk,gkn->mgn", xg, qg,
                      preferred_element_type=jnp.float32 if cdt == jnp.float32 else None).astype(jnp.float32)
    y = jnp.einsum("mgn,gn->mn", part, scales)
    if offsets is not None:
        xs = jnp.sum(xg.astype(jnp.float32), axis=-1)  # [m, groups]
        y = y + xs @ offsets
    return y.reshape(*lead, N).astype(out_dtype or x.dtype)


def embed_rows(table: QuantizedWeight, tokens: jax.Array, dtype) -> jax.Array:
    """Embedding rows of `tokens` from a quantized embedding held as its transpose [hidden, vocab]
    (the head's weight, grouped along hidden): column t dequantized."""
    q = codes(table, jnp)  # [D, V]
    cols = jnp.take(q, tokens, axis=1).astype(jnp.float32)  # [D, *tokens]
    scales = jnp.take(table.scales, tokens, axis=1).astype(jnp.float32)  # [groups, *tokens]
    D, groups = q.shape[0], table.scales.shape[0]
    cols = cols.reshape(groups, D // groups, *tokens.shape) * scales[:, None]
    if table.offsets is not None:
        cols = cols + jnp.take(table.offsets, tokens, axis=1).astype(jnp.float32)[:, None]
    return jnp.moveaxis(cols.reshape(D, *tokens.shape), 0, -1).astype(dtype)


# ----------------------------------------------------------------------------------- whole models


def quantize_stacked(w: Any, scheme: str, group_size: int = 0, symmetric: bool = True) -> QuantizedWeight:
    """`quantize` a stacked weight [layers, K, N] one layer at a time (bounded host memory)."""
    parts = [quantize(np.asarray(w[i], np.float32), scheme, group_size, symmetric) for i in range(w.shape[0])]
    return QuantizedWeight(np.stack([p.values for p in parts]), np.stack([p.scales for p in parts]),
                           None if parts[0].offsets is None else np.stack([p.offsets for p in parts]),
                           scheme, parts[0].group_size)


def quantize_params(config: Any, params: dict[str, Any], spec: QuantSpec) -> dict[str, Any]:
    """Checkpoint-layout float params (stacked per-layer arrays) -> the same dict with the layer
    matmuls quantized by `spec`, and the LM head (a tied embedding: held as its transpose
    [hidden, vocab], which the head and the lookup both read) by `spec.embed_scheme` per channel.
    An untied input embedding stays float (a step reads only its rows)."""
    out = dict(params)
    for name in LAYER_MATMULS:
        w = params[name]
        if is_quantized(w):
            raise ValueError(f"weight {name!r} is already quantized ({w.describe()})")
        K = w.shape[-2]
        if spec.group_size and K % spec.group_size:
            raise ValueError(f"group size {spec.group_size} does not divide {name}'s input dimension {K}")
        out[name] = quantize_stacked(w, spec.scheme, spec.group_size, spec.symmetric)
    if spec.embed_scheme is not None:
        if config.tie_word_embeddings:
            out["embed"] = quantize(np.asarray(params["embed"], np.float32).T, spec.embed_scheme)
        else:
            out["lm_head"] = quantize(np.asarray(params["lm_head"], np.float32), spec.embed_scheme)
    return out


def param_bytes(params: Any) -> int:
    """Bytes of every array in a params tree (quantized weights' codes, scales and offsets included)."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))


def float_dtype(params: dict[str, Any]) -> Any:
    """The float weights' dtype (the activations'): the final norm's, which is never quantized."""
    return params["final_norm"].dtype


def param_count(params: Any) -> int:
    """Weights in a params tree, a quantized weight counting its float shape's elements."""
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    return sum(int(np.prod(w.shape)) for w in leaves)


def estimate_bytes(shapes: dict[str, tuple[int, ...]], spec: QuantSpec, float_bytes: int, *,
                   tied: bool) -> int:
    """Bytes of a model's weights quantized by `spec` (`quantize_params`' result), from the
    checkpoint's shapes (`jserve.model.llama.param_shapes`): codes, float16 scales and offsets."""
    def quantized(shape, scheme, group, symmetric):
        *lead, K, N = shape
        G = group or K
        n = int(np.prod(lead, dtype=np.int64)) if lead else 1
        codes = n * K * N // (2 if scheme == "int4" else 1)
        return codes + n * (K // G) * N * 2 * (1 if symmetric else 2)

    total = 0
    for name, shape in shapes.items():
        if name in LAYER_MATMULS:
            total += quantized(shape, spec.scheme, spec.group_size, spec.symmetric)
        elif spec.embed_scheme is not None and (name == "embed" and tied or name == "lm_head"):
            total += quantized(shape[::-1] if name == "embed" else shape, spec.embed_scheme, 0, True)
        else:
            total += int(np.prod(shape, dtype=np.int64)) * float_bytes
    return total

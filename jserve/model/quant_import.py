"""Pre-quantized GGUF tensors repacked into jserve's `QuantizedWeight`, never through a float copy.

Every function here takes a checkpoint's own packed arrays (numpy; no JAX, no torch) and returns
the same weight in jserve's format (see `jserve.model.quant`): codes, per-group scales and, when
asymmetric, float offsets along K, in the [K, N] (in, out) orientation. Nothing is rounded: the
weight that `quant.dequantize` reconstructs is the one the checkpoint's own reference decodes.

Each GGUF block layout (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) and what it becomes is its decoder's
docstring (`_q8_0`, ...). A GGUF linear weight is N rows of K inputs, each row a run of blocks
along K; the layouts and the float operation order follow `gguf.quants` (the `gguf` PyPI package,
llama.cpp's gguf-py/gguf/quants.py), the bit-for-bit reference the tests compare against. See
docs/architecture.md, "Quantization".
"""


from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jserve.model.quant import QuantizedWeight, pack_int4

# GGML type -> (elements per block, bytes per block); names as gguf.GGMLQuantizationType spells them.
_GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
GGUF_TYPES = tuple(_GGUF_BLOCKS)



# ------------------------------------------------------------------------------------------ GGUF

def _type_name(tensor_type: Any) -> str:
    name = getattr(tensor_type, "name", None)
    if name is None:
        try:
            import gguf

            name = gguf.GGMLQuantizationType(int(tensor_type)).name
        except (ImportError, ValueError, TypeError):
            name = str(tensor_type)
    return name


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at bytes [start, start + 2) of every block, as float16 [..., 1]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)


def _nibbles(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return b & np.uint8(0x0F), b >> np.uint8(4)


def from_gguf(tensor_type: Any, data: np.ndarray, shape: Sequence[int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks as jserve's `QuantizedWeight` [..., K, N].

    `tensor_type`: the tensor's `gguf.GGMLQuantizationType` (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; each
    layout is its decoder's docstring, `_DECODERS`); `data`: its raw bytes as `GGUFReader` gives
    them (`tensor.data`, uint8 [..., N, bytes per row]); `shape`: GGUF's own shape, `tensor.shape`
    (ne order: K, the contiguous row axis, first, then N, then any outer axes), which is jserve's
    [K, N] orientation. A tensor with outer axes (e.g. experts, ne = [K, N, E]) comes back with
    them leading: [E, K, N]. GGUF's F32 / F16 / BF16 tensors (norms, and whatever llama.cpp kept
    in float) are the caller's; Hugging Face AWQ and GPTQ tensors are `jserve.model.quant_hf`'s.
    """
    name = _type_name(tensor_type)
    if name not in _GGUF_BLOCKS:
        raise ValueError(f"GGUF tensor type {name} is not a supported quantized type "
                         f"(supported: {', '.join(GGUF_TYPES)}; F32, F16 and BF16 are the caller's to read)")
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"a quantized GGUF weight needs at least 2 dimensions, got shape {shape}")
    K, N, outer = shape[0], shape[1], shape[2:][::-1]
    blocks = _gguf_blocks(name, data, shape)
    q, scales, offsets, scheme, group = _DECODERS[name](blocks)
    return _assemble(q, scales, offsets, scheme, group, K, N, outer)


def _gguf_blocks(name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`data` as uint8 [rows, blocks per row, bytes per block], checked against GGUF `shape`."""
    block, type_size = _GGUF_BLOCKS[name]
    K, N, outer = shape[0], shape[1], shape[2:]
    if K % block:
        raise ValueError(f"{name} rows hold blocks of {block}; K = {K} (shape {shape}) is not a multiple "
                         "(`shape` is GGUF's ne order, tensor.shape: K first)")
    row_bytes = K // block * type_size
    data = np.asarray(data)
    if data.dtype != np.uint8:
        data = np.ascontiguousarray(data).view(np.uint8)
    rows = int(np.prod(outer, dtype=np.int64)) * N
    if data.size != rows * row_bytes or (data.ndim > 1 and data.shape[-1] != row_bytes):
        raise ValueError(f"{name} data of shape {data.shape} does not hold a tensor of GGUF shape {shape} "
                         f"({rows} rows of {row_bytes} bytes); `shape` is GGUF's ne order (tensor.shape: K first)")
    return data.reshape(rows, K // block, type_size)


# Each decoder: GGUF blocks [rows, blocks, bytes] -> (codes, scales, offsets or None, scheme, group
# size), codes and scales in the row's element order (`_assemble` makes them [..., K, N]).

def _q8_0(blocks: np.ndarray) -> tuple:
    """Q8_0 (34-byte blocks of 32): f16 d, 32 int8 q; w = q * d.
    -> "int8", g32, float16 scales d."""
    scales = _f16(blocks, 0)[..., 0]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return q, scales, None, "int8", 32


def _q4_0(blocks: np.ndarray) -> tuple:
    """Q4_0 (18 bytes / 32): f16 d, 16 bytes; byte i holds element i (low nibble) and i + 16
    (high); w = d * (nibble - 8).  -> "int4" g32 symmetric, signed codes nibble - 8, float16 scales."""
    return _q4_nibbles(blocks, 2).astype(np.int8) - np.int8(8), _f16(blocks, 0)[..., 0], None, "int4", 32


def _q4_1(blocks: np.ndarray) -> tuple:
    """Q4_1 (20 bytes / 32): f16 d, f16 m, 16 bytes as Q4_0; w = (d * nibble) + m.
    -> "int4" g32 asymmetric, unsigned codes, float16 scales d and offsets m."""
    return _q4_nibbles(blocks, 4), _f16(blocks, 0)[..., 0], _f16(blocks, 2)[..., 0], "int4", 32


def _q4_nibbles(blocks: np.ndarray, first: int) -> np.ndarray:
    """Q4_0 / Q4_1's codes [rows, blocks, 32] from the nibbles at bytes `first`... of each block."""
    lo, hi = _nibbles(blocks[..., first:])
    return np.concatenate([lo, hi], axis=-1)  # byte i -> elements i and i + 16


def _q4_k(blocks: np.ndarray) -> tuple:
    """Q4_K (144 bytes / 256): f16 d, f16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128
    bytes of nibbles (32-byte chunk c: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1);
    w = (d * sc) * q - (dmin * m), the two products in float32 first.
    -> "int4" g32 asymmetric, float32 scales d * sc and offsets -(dmin * m) (x - y == x + (-y)
    exactly in IEEE arithmetic, signed zeros included)."""
    rows, num_blocks = blocks.shape[:2]
    d = _f16(blocks, 0).astype(np.float32)
    dmin = _f16(blocks, 2).astype(np.float32)
    s = blocks[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    scales = d * sc.astype(np.float32)  # [rows, blocks, 8]
    offsets = -(dmin * mn.astype(np.float32))
    lo, hi = _nibbles(blocks[..., 16:].reshape(rows, num_blocks, 4, 1, 32))
    q = np.concatenate([lo, hi], axis=-2)  # [rows, blocks, chunk c, (sub-block 2c, 2c + 1), 32]
    return q, scales, offsets, "int4", 32


def _q6_k(blocks: np.ndarray) -> tuple:
    """Q6_K (210 bytes / 256): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8
    scales, f16 d; element h * 128 + r (h in 0..1) is (ql[64h + r % 64] >> 4 (r // 64)) & 15 |
    ((qh[32h + r % 32] >> 2 (r // 32)) & 3) << 4, minus 32; w = (d * sc) * q per 16 elements.
    -> "int8" g16, codes q - 32 in [-32, 31], float32 scales d * sc."""
    rows, num_blocks = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(rows, num_blocks, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = blocks[..., 128:192].reshape(rows, num_blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    low = (ql & np.uint8(15)).reshape(rows, num_blocks, 2, 128)
    high = (qh & np.uint8(3)).reshape(rows, num_blocks, 2, 128)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scales = _f16(blocks, 208).astype(np.float32) * sc  # [rows, blocks, 16]
    return q, scales, None, "int8", 16


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}


def _assemble(q, scales, offsets, scheme, group, K, N, outer) -> QuantizedWeight:
    """Row-major GGUF codes [rows, ...] (K per row) and per-group scales to jserve's [..., K, N]."""
    lead = (*outer, N)

    def to_kn(a, width):
        return np.ascontiguousarray(np.swapaxes(a.reshape(*lead, width), -1, -2))

    codes = to_kn(q, K)
    values = pack_int4(codes) if scheme == "int4" else codes.astype(np.int8)
    return QuantizedWeight(values, to_kn(scales, K // group),
                           None if offsets is None else to_kn(offsets, K // group), scheme, group)


# ------------------------------------------------------------------------------- weight plumbing

def permute_output_channels(w: QuantizedWeight, perm) -> QuantizedWeight:
    """`w` with its output channels (columns) reordered: column j of the result is column
    `perm[j]` of `w`. For llama.cpp's rotary permutation of Q / K rows, pass
    `sources.unpermute_rotary(np.arange(N), num_heads)`."""
    perm = np.asarray(perm)
    N = w.values.shape[-1]
    if perm.shape != (N,) or not np.issubdtype(perm.dtype, np.integer) or \
            not np.array_equal(np.sort(perm), np.arange(N)):
        raise ValueError(f"perm must be a permutation of the {N} output channels, got shape {perm.shape}")

    def take(a):
        return None if a is None else np.take(np.asarray(a), perm, axis=-1)

    return QuantizedWeight(take(w.values), take(w.scales), take(w.offsets), w.scheme, w.group_size)


def stack_layers(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Per-layer weights stacked on a new leading layer axis (every array); all must share the
    scheme, group size, symmetry, array dtypes and shapes."""
    weights = list(weights)
    if not weights:
        raise ValueError("stack_layers needs at least one weight")
    first = weights[0]

    def signature(w):
        return (w.scheme, w.group_size, w.symmetric,
                tuple((np.dtype(a.dtype).name, tuple(a.shape)) if a is not None else None
                      for a in (w.values, w.scales, w.offsets)))

    want = signature(first)
    for i, w in enumerate(weights):
        if not isinstance(w, QuantizedWeight):
            raise ValueError(f"layer {i} is not a QuantizedWeight ({type(w).__name__})")
        if signature(w) != want:
            raise ValueError(f"layer {i} does not match layer 0: {signature(w)} vs {want} "
                             "(scheme, group size, symmetric, (dtype, shape) of values, scales, offsets)")
    offsets = None if first.offsets is None else np.stack([np.asarray(w.offsets) for w in weights])
    return QuantizedWeight(np.stack([np.asarray(w.values) for w in weights]),
                           np.stack([np.asarray(w.scales) for w in weights]), offsets,
                           first.scheme, first.group_size)

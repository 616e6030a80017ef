"""Pre-quantized checkpoints repacked into jserve's `QuantizedWeight`, never through a float copy.

Every function here takes a checkpoint's own packed arrays (numpy; no JAX, no torch) and returns
the same weight in jserve's format (see `jserve.model.quant`): codes, per-group scales and, when
asymmetric, float offsets along K, in the [K, N] (in, out) orientation. Nothing is rounded: the
weight that `quant.dequantize` reconstructs is the one the checkpoint's own reference decodes.

GGUF (`from_gguf`)
------------------
A GGUF linear weight is N rows of K inputs; each row is a run of blocks along K. The layouts and
the float operation order follow `gguf.quants` (the `gguf` PyPI package, llama.cpp's
gguf-py/gguf/quants.py), which is the bit-for-bit reference the tests compare against:

- Q8_0 (34-byte blocks of 32): f16 d, 32 int8 q; w = q * d.
  -> "int8", g32, float16 scales d.
- Q4_0 (18 bytes / 32): f16 d, 16 bytes; byte i holds element i (low nibble) and i + 16 (high);
  w = d * (nibble - 8).  -> "int4" g32 symmetric, signed codes nibble - 8, float16 scales.
- Q4_1 (20 bytes / 32): f16 d, f16 m, 16 bytes as Q4_0; w = (d * nibble) + m.
  -> "int4" g32 asymmetric, unsigned codes, float16 scales d and offsets m.
- Q4_K (144 bytes / 256): f16 d, f16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes
  of nibbles (32-byte chunk c: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1);
  w = (d * sc) * q - (dmin * m), the two products in float32 first.
  -> "int4" g32 asymmetric, float32 scales d * sc and offsets -(dmin * m) (x - y == x + (-y)
  exactly in IEEE arithmetic, signed zeros included).
- Q6_K (210 bytes / 256): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales,
  f16 d; element h * 128 + r (h in 0..1) is (ql[64h + r % 64] >> 4 (r // 64)) & 15 |
  ((qh[32h + r % 32] >> 2 (r // 32)) & 3) << 4, minus 32; w = (d * sc) * q per 16 elements.
  -> "int8" g16, codes q - 32 in [-32, 31], float32 scales d * sc.

GGUF's F32 / F16 / BF16 tensors (norms, and whatever llama.cpp kept in float) are the caller's.

Hugging Face AWQ (`from_awq`), AutoAWQ's "gemm" checkpoint layout
-----------------------------------------------------------------
Source: AutoAWQ awq/utils/packing_utils.py (`unpack_awq`, `reverse_awq_order`, `dequantize_gemm`)
and awq/modules/linear/gemm.py (`WQLinear_GEMM.from_linear`, the packer); vLLM's awq.py reads the
same config keys (`w_bit`/`bits`, `q_group_size`/`group_size`, `zero_point`).

- qweight int32 [K, N / 8]: 8 4-bit codes along N per int32; the nibble at bits 4i..4i+3 of
  word j holds column 8j + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (so column 8j + c
  is nibble AWQ_REVERSE_ORDER[c], [0, 4, 1, 5, 2, 6, 3, 7]).
- qzeros int32 [K / G, N / 8], packed the same way; scales [K / G, N] (float16).
- w = (q - z) * s; no "+1" on the zeros.

Hugging Face GPTQ (`from_gptq`), AutoGPTQ / GPTQModel / transformers+optimum
----------------------------------------------------------------------------
Source: AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py (`QuantLinear.pack` and its
torch dequantization in `forward`), GPTQModel gptqmodel/utils/model.py
(`convert_gptq_v1_to_v2_format_module`) for "gptq_v2", AutoGPTQ's quantization/gptq.py for g_idx.

- qweight int32 [K * bits / 32, N]: packed along K, row r holding input rows r * 32/bits + i at
  bits i * bits (i = 0 first, the least significant).
- qzeros int32 [K / G, N * bits / 32]: packed along N the same way.
- scales [K / G, N] float16; g_idx int32 [K], the group of each input row.
- checkpoint_format "gptq" (v1, AutoGPTQ and transformers' default): the zero point is stored
  minus one, and decoded as ((word >> shift) & mask) + 1, so a stored 15 decodes to 16 (AutoGPTQ's
  and vLLM's kernels; GPTQModel's v1 -> v2 conversion adds 0x11111111 to the whole word and would
  carry into the next nibble instead: such checkpoints, asymmetric with a zero of 0, are
  ambiguous, and we follow the kernels). "gptq_v2" (GPTQModel): the zero point is stored as is.
- w = (q - z) * s, G = K when group_size is -1.
- desc_act (act-order) reorders input rows and records the groups in g_idx; only a g_idx equal to
  k // G (static_groups, group_size -1, or no act-order) maps to jserve's contiguous groups.

Mapping zero points to jserve's offsets
---------------------------------------
Where every zero point is the midpoint (8 for 4-bit, 128 for 8-bit: GPTQ's sym=True), the codes
become signed (q - mid) with no offset: exact, and the scales keep their dtype (float16; bfloat16
and float32 scales become float32). Otherwise the weight is asymmetric, scales and offsets float32:
4-bit codes stay unsigned with offset -(z * s); 8-bit codes become q - 128 (int8) with offset
(128 - z) * s. With float16 or bfloat16 scales every product is exact in float32 (an 11-bit
significand times a code of at most 9 bits), so q * s + offset equals (q - z) * s evaluated in
float32 bit for bit; with float32 scales the two roundings (product, then sum) can differ from
(q - z) * s's one by an ulp.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from jserve.model.quant import QuantizedWeight, pack_int4

# GGML type -> (elements per block, bytes per block); names as gguf.GGMLQuantizationType spells them.
_GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
GGUF_TYPES = tuple(_GGUF_BLOCKS)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of a word's 8 is nibble AWQ_REVERSE_ORDER[c]
GPTQ_FORMATS = ("gptq", "gptq_v2")


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

    `tensor_type`: the tensor's `gguf.GGMLQuantizationType` (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K);
    `data`: its raw bytes as `GGUFReader` gives them (`tensor.data`, uint8 [..., N, bytes per row]);
    `shape`: GGUF's own shape, `tensor.shape` (ne order: K, the contiguous row axis, first, then N,
    then any outer axes), which is jserve's [K, N] orientation. A tensor with outer axes (e.g.
    experts, ne = [K, N, E]) comes back with them leading: [E, K, N].
    """
    name = _type_name(tensor_type)
    if name not in _GGUF_BLOCKS:
        raise ValueError(f"GGUF tensor type {name} is not a supported quantized type "
                         f"(supported: {', '.join(GGUF_TYPES)}; F32, F16 and BF16 are the caller's to read)")
    block, type_size = _GGUF_BLOCKS[name]
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"a quantized GGUF weight needs at least 2 dimensions, got shape {shape}")
    K, N, outer = shape[0], shape[1], shape[2:][::-1]
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
    blocks = data.reshape(rows, K // block, type_size)

    if name == "Q8_0":
        scales = _f16(blocks, 0)[..., 0]
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        return _assemble(q, scales, None, "int8", 32, K, N, outer)
    if name in ("Q4_0", "Q4_1"):
        first = 2 if name == "Q4_0" else 4
        lo, hi = _nibbles(blocks[..., first:])
        q = np.concatenate([lo, hi], axis=-1)  # [rows, blocks, 32]: byte i -> elements i and i + 16
        scales = _f16(blocks, 0)[..., 0]
        if name == "Q4_0":
            return _assemble(q.astype(np.int8) - np.int8(8), scales, None, "int4", 32, K, N, outer)
        return _assemble(q, scales, _f16(blocks, 2)[..., 0], "int4", 32, K, N, outer)
    if name == "Q4_K":
        d = _f16(blocks, 0).astype(np.float32)
        dmin = _f16(blocks, 2).astype(np.float32)
        s = blocks[..., 4:16]
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        scales = d * sc.astype(np.float32)  # [rows, blocks, 8]
        offsets = -(dmin * mn.astype(np.float32))
        lo, hi = _nibbles(blocks[..., 16:].reshape(rows, K // block, 4, 1, 32))
        q = np.concatenate([lo, hi], axis=-2)  # [rows, blocks, chunk c, (sub-block 2c, 2c + 1), 32]
        return _assemble(q, scales, offsets, "int4", 32, K, N, outer)
    # Q6_K
    ql = blocks[..., 0:128].reshape(rows, K // block, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = blocks[..., 128:192].reshape(rows, K // block, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    low = (ql & np.uint8(15)).reshape(rows, K // block, 2, 128)
    high = (qh & np.uint8(3)).reshape(rows, K // block, 2, 128)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scales = _f16(blocks, 208).astype(np.float32) * sc  # [rows, blocks, 16]
    return _assemble(q, scales, None, "int8", 16, K, N, outer)


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
    `checkpoint.unpermute_rotary(np.arange(N), num_heads)`."""
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


# ---------------------------------------------------------------------------- zero-point formats

def _unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their 32 / bits codes (least significant first) laid out along `axis`
    (0: rows, each word's codes becoming consecutive rows; 1: columns likewise)."""
    u = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    mask = np.uint32((1 << bits) - 1)
    if axis == 0:
        codes = (u[:, None, :] >> shifts[None, :, None]) & mask  # [rows, per word, N]
        return codes.reshape(u.shape[0] * shifts.size, u.shape[1])
    codes = (u[:, :, None] >> shifts[None, None, :]) & mask  # [rows, words, per word]
    return codes.reshape(u.shape[0], u.shape[1] * shifts.size)


def _from_zero_points(q: np.ndarray, z: np.ndarray, scales: np.ndarray, bits: int, group: int,
                      require_symmetric: bool = False) -> QuantizedWeight:
    """Unsigned codes q [K, N], integer zero points z [K / G, N] and scales [K / G, N] standing for
    (q - z) * s, as a QuantizedWeight (see the module docstring)."""
    scales = np.asarray(scales)
    mid = 1 << (bits - 1)
    scheme = "int4" if bits == 4 else "int8"
    if np.all(z == mid):
        codes = (q.astype(np.int16) - mid).astype(np.int8)
        s = scales if scales.dtype == np.float16 else scales.astype(np.float32)
        values = pack_int4(codes) if bits == 4 else codes
        return QuantizedWeight(values, np.ascontiguousarray(s), None, scheme, group)
    if require_symmetric:
        bad = np.unique(z[z != mid])[:8].tolist()
        raise ValueError(f"the checkpoint says sym=True but zero points other than {mid} occur ({bad}); "
                         "is checkpoint_format (gptq = v1, stored minus one; gptq_v2) right?")
    s = scales.astype(np.float32)
    if bits == 4:
        return QuantizedWeight(pack_int4(q.astype(np.uint8)), s, -(z.astype(np.float32) * s), "int4", group)
    codes = (q.astype(np.int16) - 128).astype(np.int8)
    return QuantizedWeight(codes, s, (128 - z.astype(np.float32)) * s, "int8", group)


def _group(group_size: int, K: int) -> int:
    group = K if group_size in (-1, 0, None) else int(group_size)
    if group <= 0 or K % group:
        raise ValueError(f"group size {group_size} does not divide the input dimension {K}")
    return group


def _check_shape(what: str, a: np.ndarray, want: tuple[int, ...]) -> None:
    if tuple(a.shape) != want:
        raise ValueError(f"{what} has shape {tuple(a.shape)}, expected {want}")


def from_awq(qweight, qzeros, scales, group_size: int, bits: int = 4) -> QuantizedWeight:
    """An AutoAWQ "gemm" linear (qweight int32 [K, N / 8], qzeros int32 [K / G, N / 8], scales
    [K / G, N]) as jserve's int4 [K, N] (asymmetric unless every zero point is 8)."""
    if bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit here, got bits={bits}")
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    for name, a in (("qweight", qweight), ("qzeros", qzeros)):
        if a.dtype not in (np.int32, np.uint32):
            raise ValueError(f"AWQ {name} must be int32 words, got {a.dtype}")
    if qweight.ndim != 2:
        raise ValueError(f"AWQ qweight must be [K, N / 8], got shape {qweight.shape}")
    K, N = qweight.shape[0], qweight.shape[1] * 8
    group = _group(group_size, K)
    _check_shape("AWQ qzeros", qzeros, (K // group, N // 8))
    _check_shape("AWQ scales", scales, (K // group, N))
    order = (np.arange(N) // 8) * 8 + np.tile(np.asarray(AWQ_REVERSE_ORDER), N // 8)
    q = _unpack_words(qweight, 4, axis=1)[:, order]
    z = _unpack_words(qzeros, 4, axis=1)[:, order]
    return _from_zero_points(q, z, scales, 4, group)


def from_gptq(qweight, qzeros, scales, g_idx=None, bits: int = 4, group_size: int = 128, sym: bool = True,
              checkpoint_format: str = "gptq") -> QuantizedWeight:
    """A GPTQ linear (qweight int32 [K * bits / 32, N], qzeros int32 [K / G, N * bits / 32], scales
    [K / G, N], g_idx [K] or None) as jserve's int4 (bits 4) or int8 (bits 8) [K, N].

    `checkpoint_format` "gptq" (v1: zero points stored minus one) or "gptq_v2"; `group_size` -1
    for one group per output channel; `sym=True` requires every zero point to be the midpoint (a
    wrong `checkpoint_format` shows as zero points of 7 or 9). A g_idx other than k // G (act-order
    without static groups) raises: jserve's groups are contiguous along K.
    """
    if bits not in (4, 8):
        raise ValueError(f"GPTQ bits={bits} is not supported (4 and 8 are)")
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                         f"({', '.join(GPTQ_FORMATS)} are)")
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    for name, a in (("qweight", qweight), ("qzeros", qzeros)):
        if a.dtype not in (np.int32, np.uint32):
            raise ValueError(f"GPTQ {name} must be int32 words, got {a.dtype}")
    if qweight.ndim != 2:
        raise ValueError(f"GPTQ qweight must be [K * bits / 32, N], got shape {qweight.shape}")
    per_word = 32 // bits
    K, N = qweight.shape[0] * per_word, qweight.shape[1]
    group = _group(group_size, K)
    if N % per_word:
        raise ValueError(f"GPTQ output dimension {N} is not a multiple of {per_word} (qzeros' packing)")
    _check_shape("GPTQ qzeros", qzeros, (K // group, N // per_word))
    _check_shape("GPTQ scales", scales, (K // group, N))
    if g_idx is not None:
        g_idx = np.asarray(g_idx)
        if g_idx.shape != (K,) or not np.array_equal(g_idx, np.arange(K) // group):
            raise ValueError("GPTQ g_idx is not k // group_size: an act-order (desc_act) checkpoint whose groups "
                             "are not contiguous along K, which jserve's format cannot hold")
    q = _unpack_words(qweight, bits, axis=0)
    z = _unpack_words(qzeros, bits, axis=1).astype(np.int32)
    if checkpoint_format == "gptq":
        z = z + 1
    return _from_zero_points(q, z, scales, bits, group, require_symmetric=sym)


# ------------------------------------------------------------------------------------ the config

_AWQ_VERSIONS_ELSEWHERE = ("gemv", "gemv_fast", "marlin", "exllama", "exllamav2", "ipex")


def quantization_spec_from_hf(config_json: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """The validated `quantization_config` of a Hugging Face config.json (the parsed dict, the
    quantization_config itself, or a path to the file), normalised:

    AWQ: {"quant_method": "awq", "bits": 4, "group_size", "zero_point": True, "version": "gemm",
    "modules_to_not_convert"}; GPTQ: {"quant_method": "gptq", "bits": 4 | 8, "group_size" (-1:
    per channel), "sym", "desc_act", "static_groups", "checkpoint_format": "gptq" | "gptq_v2",
    "lm_head" (whether the LM head is quantized too), "modules_to_not_convert"}. `bits`,
    `group_size`, `sym` and `checkpoint_format` are `from_gptq`'s keyword arguments, `group_size`
    and `bits` `from_awq`'s. Anything this module cannot repack exactly raises a ValueError that
    names the field and its value.
    """
    if isinstance(config_json, (str, Path)):
        config_json = json.loads(Path(config_json).read_text())
    if not isinstance(config_json, Mapping):
        raise ValueError(f"expected a config.json mapping, got {type(config_json).__name__}")
    qc = config_json.get("quantization_config", config_json if "quant_method" in config_json else None)
    if not isinstance(qc, Mapping):
        raise ValueError("config.json has no quantization_config")
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _awq_spec(qc)
    if method == "gptq":
        return _gptq_spec(qc)
    raise ValueError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported (awq and gptq are)")


def _first(qc: Mapping[str, Any], keys: Sequence[str], default: Any = None) -> Any:
    for k in keys:
        if k in qc and qc[k] is not None:
            return qc[k]
    return default


def _int_field(qc, keys, default=None) -> int:
    v = _first(qc, keys, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"quantization_config.{keys[0]} must be an integer, got {v!r}")
    return v


def _bool_field(qc, key, default) -> bool:
    v = qc.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, bool):
        raise ValueError(f"quantization_config.{key} must be true or false, got {v!r}")
    return v


def _awq_spec(qc: Mapping[str, Any]) -> dict[str, Any]:
    bits = _int_field(qc, ("bits", "w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits={bits}: AWQ is supported with 4 bits only")
    group = _int_field(qc, ("group_size", "q_group_size"))
    if group != -1 and group <= 0:
        raise ValueError(f"quantization_config.group_size={group} is not a group size (positive, or -1)")
    version = str(_first(qc, ("version",), "gemm")).lower()
    if version != "gemm":
        where = "a kernel's packing" if version in _AWQ_VERSIONS_ELSEWHERE else "unknown"
        raise ValueError(f"quantization_config.version={version!r} ({where}) is not supported: "
                         "only AutoAWQ's \"gemm\" checkpoint layout is")
    backend = str(_first(qc, ("backend",), "autoawq")).lower()
    if backend != "autoawq":
        raise ValueError(f"quantization_config.backend={backend!r} is not supported (autoawq's packing is; "
                         "llm-awq packs differently)")
    if not _bool_field(qc, "zero_point", True):
        raise ValueError("quantization_config.zero_point=false is not supported (AutoAWQ's gemm layout has zeros)")
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": list(qc.get("modules_to_not_convert") or [])}


def _gptq_spec(qc: Mapping[str, Any]) -> dict[str, Any]:
    bits = _int_field(qc, ("bits",))
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits={bits} is not supported for GPTQ (4 and 8 are)")
    group = _int_field(qc, ("group_size",))
    if group != -1 and group <= 0:
        raise ValueError(f"quantization_config.group_size={group} is not a group size (positive, or -1)")
    fmt = str(_first(qc, ("checkpoint_format", "format"), "gptq")).lower()
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"quantization_config.checkpoint_format={fmt!r} is not supported "
                         f"({', '.join(GPTQ_FORMATS)} are)")
    if _bool_field(qc, "is_marlin_format", False):
        raise ValueError("quantization_config.is_marlin_format=true is not supported (Marlin repacks the codes)")
    pack_dtype = str(qc.get("pack_dtype") or "int32").lower().removeprefix("torch.")
    if pack_dtype != "int32":
        raise ValueError(f"quantization_config.pack_dtype={pack_dtype!r} is not supported (int32 words are)")
    if qc.get("dynamic"):
        raise ValueError("quantization_config.dynamic (per-module bits / group sizes) is not supported")
    sym = _bool_field(qc, "sym", True)
    desc_act = _bool_field(qc, "desc_act", False)
    static_groups = _bool_field(qc, "static_groups", False)
    if desc_act and group != -1 and not static_groups:
        raise ValueError("quantization_config.desc_act=true (act-order) with group_size "
                         f"{group} and no static_groups is not supported: its groups are not contiguous along K")
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
            "static_groups": static_groups, "checkpoint_format": fmt, "lm_head": _bool_field(qc, "lm_head", False),
            "modules_to_not_convert": list(qc.get("modules_to_not_convert") or [])}

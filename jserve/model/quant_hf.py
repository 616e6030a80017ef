"""Hugging Face AWQ and GPTQ tensors repacked into jserve's `QuantizedWeight`, never through a
float copy (numpy only; the GGUF side is `jserve.model.quant_import`).

`from_awq` (AutoAWQ's "gemm" layout) and `from_gptq` (AutoGPTQ / GPTQModel, v1 and v2) document
their sources' packing; `_from_zero_points` how zero points become jserve's float offsets,
exactly. See docs/architecture.md, "Quantization".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from jserve.model.quant import QuantizedWeight, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of a word's 8 is nibble AWQ_REVERSE_ORDER[c]
GPTQ_FORMATS = ("gptq", "gptq_v2")


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
    (q - z) * s, as a QuantizedWeight (see the module docstring).

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


def _packed(kind: str, qweight, qzeros, scales, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three arrays of a packed linear, checked: int32 words in qweight (2-D, `layout`) and qzeros."""
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    for name, a in (("qweight", qweight), ("qzeros", qzeros)):
        if a.dtype not in (np.int32, np.uint32):
            raise ValueError(f"{kind} {name} must be int32 words, got {a.dtype}")
    if qweight.ndim != 2:
        raise ValueError(f"{kind} qweight must be {layout}, got shape {qweight.shape}")
    return qweight, qzeros, scales


def from_awq(qweight, qzeros, scales, group_size: int, bits: int = 4) -> QuantizedWeight:
    """An AutoAWQ "gemm" linear (qweight int32 [K, N / 8], qzeros int32 [K / G, N / 8], scales
    [K / G, N]) as jserve's int4 [K, N] (asymmetric unless every zero point is 8).

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
    """
    if bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit here, got bits={bits}")
    qweight, qzeros, scales = _packed("AWQ", qweight, qzeros, scales, "[K, N / 8]")
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
    """
    if bits not in (4, 8):
        raise ValueError(f"GPTQ bits={bits} is not supported (4 and 8 are)")
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                         f"({', '.join(GPTQ_FORMATS)} are)")
    qweight, qzeros, scales = _packed("GPTQ", qweight, qzeros, scales, "[K * bits / 32, N]")
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

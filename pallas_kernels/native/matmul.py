"""The native CPU matmul (`matmul.cc`), built on first use (`pallas_kernels.native.build`).

`pack(w)` once at load, then `matmul_packed(x, packed, n)`: `x @ w` with w [K, N] packed as
[N / P, K, P] panels (P = `panel()`: 24 columns where the build has AVX2, 48 with AVX-512),
float32 or bfloat16 (`matmul_packed_many`: several weights that read the same x, one call): the
paged runner's layer matmuls and tied LM head on CPU (see `jserve.runtime.backends.native_cpu`).
Without a compiler `available()` is False and the runner keeps XLA's dots and unpacked weights.
Quantized weights (int8, int4) pack with `pack_quantized` into a `PackedQuantized` (its docstring
gives the layout), read as codes and dequantized in registers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.native.build import NativeLibrary

TARGET = "jserve_matmul_packed"
TARGET_MANY = "jserve_matmul_packed_many"
_LIBRARY = NativeLibrary("matmul", Path(__file__).with_name("matmul.cc"),
                         {TARGET: "JserveMatmulPacked", TARGET_MANY: "JserveMatmulPackedMany"},
                         what="native CPU matmul", fallback="using XLA's dot")


def available(quantized: bool = False) -> bool:
    """Build (once per machine and source), load and register the kernel; False if that failed.
    `quantized`: its build with the quantized kernels too (`build.NativeLibrary`)."""
    return _LIBRARY.available(quantized)


def unavailable_reason(quantized: bool = False) -> str | None:
    return _LIBRARY.unavailable_reason(quantized)


@functools.cache
def panel() -> int:
    """Columns per packed panel of this machine's build (kPanel in matmul.cc: three SIMD
    vectors, 24 columns with AVX2, 48 with AVX-512, 24 in the plain-C++ fallback)."""
    if not available():
        raise RuntimeError(f"native CPU matmul unavailable: {unavailable_reason()}")
    return _LIBRARY.function("JserveMatmulPanel")()


@functools.cache
def int_dot_isa() -> str | None:
    """The integer dot products over int8 activations this machine's build has (quant_dot.h):
    "avx512-vnni" (AVX-512 with VNNI and VBMI), "avx2", or None (`int8_rows` is ignored)."""
    if not available():
        return None
    return {1: "avx512-vnni", 2: "avx2"}.get(_LIBRARY.function("JserveMatmulIntDot")())


def int_dot_available() -> bool:
    """Whether this machine's build has the integer dot products (`int_dot_isa()`)."""
    return int_dot_isa() is not None


# From how many rows of x on the integer path is faster (docs/performance.md, "Int8 activations and
# integer dot products"): with its codes stored as the integer kernel reads them
# (`PackedQuantized.quads`), int4 from one row, and int8 from one row too where AVX-512 VNNI reads
# its quads (a SmolLM2-135M decode step, int8 in groups of 32 or per channel: 2-3 % slower at
# batch 1, 1.2x faster at 4 and 16); AVX2 builds store no int8 quads, and their int8 float path is
# as fast below 8 rows.
DEFAULT_INT8_ROWS = 8
ACT_BLOCK = 32  # columns of K per activation scale (quant_dot.h's kActBlock)


def default_int8_rows(scheme: str) -> int:
    """The engine's `int8_rows` for a weight of this scheme ("int8" or "int4") on this build."""
    if scheme == "int4" and int_dot_available() or scheme == "int8" and int_dot_isa() == "avx512-vnni":
        return 1
    return DEFAULT_INT8_ROWS


WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def pack(w: jax.Array) -> jax.Array:
    """[K, N] -> [ceil(N / P), K, P] with P = `panel()`: column panels, N padded with zero
    columns. A bfloat16 weight stays bfloat16 (the kernel reads half the bytes and computes in
    float32); any other dtype becomes float32."""
    if w.ndim != 2:
        raise ValueError(f"pack needs a 2-D weight [K, N], got shape {w.shape}")
    k, n = w.shape
    width = panel()
    panels = -(-n // width)
    w = jnp.pad(w if w.dtype in WEIGHT_DTYPES else w.astype(jnp.float32),
                ((0, 0), (0, panels * width - n)))
    return w.reshape(k, panels, width).transpose(1, 0, 2)


def unpack(packed: jax.Array, n: int) -> jax.Array:
    """Inverse of `pack`: [N / P, K, P] -> [K, n]."""
    p, k, width = packed.shape
    return packed.transpose(1, 0, 2).reshape(k, p * width)[:, :n]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedQuantized:
    """A quantized weight w [K, N] packed for the native matmul (`pack_quantized`).

    A registered pytree: `codes` and `scales` are leaves; `scheme` ("int8" or "int4"),
    `group_size` (G) and `n` (N, the unpadded output width) are static.

    codes: int8 [N / P, K, P], or uint8 [N / P, K / 2, P] for int4: byte (i, j) of a panel holds
      rows 2i (low nibble) and 2i + 1 (high) of its column j, unsigned ([0, 15]) where the weight
      has offsets, and where it is symmetric its signed codes [-8, 7] plus 8 (the kernel converts
      unsigned nibbles, and takes 8 times the group's sum of x off). Padded columns: zero scales.
    scales: float32 or float16 [N / P, K / G, S, P]: S = 1, each group's scale; S = 2, its scale
      then its offset. w[k, n] = scales[n // P, k // G, 0, n % P] * code (+ scales[.., 1, ..]).

    Quantized weights (`jserve.model.quant.QuantizedWeight`, int8 and int4) pack with
    `pack_quantized(w)` into a `PackedQuantized`: the codes in the same column panels ([N / P, K, P]
    int8, [N / P, K / 2, P] uint8 nibble pairs for int4) and the per-group scales (and offsets) beside
    them as [N / P, K / G, S, P] (S = 2: scale, then offset). `matmul_packed` and `matmul_packed_many`
    take one wherever they take float panels; the kernel reads the codes and dequantizes in registers
    (products accumulated per group in float32, the scale applied once per group, an offset as its
    share times the group's sum of x), so an int4 weight is read as half a byte per weight and its
    scales. fp8 codes do not pack (`can_pack_quantized`).
    """

    codes: Any
    scales: Any
    scheme: str = dataclasses.field(default="int8", metadata=dict(static=True))
    group_size: int = dataclasses.field(default=0, metadata=dict(static=True))
    n: int = dataclasses.field(default=0, metadata=dict(static=True))
    # From this many rows of x on (0: never) the kernel quantizes x to int8 per block of 32 and
    # takes integer dot products (`int_dot_available()`), else dequantizes to float32; see `with_int8_rows`.
    int8_rows: int = dataclasses.field(default=0, metadata=dict(static=True))
    # Codes stored as quads (quant_dot.h's QuadCodes) instead of rows (int8) or nibble pairs (int4):
    # where only the integer path reads them (`with_int8_rows(1)` on a build with it: int8 with
    # AVX-512 VNNI); `quantized_codes` and `quantized_rows` read either.
    quads: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def symmetric(self) -> bool:
        return self.scales.shape[2] == 1

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's shape [K, N]."""
        rows = self.codes.shape[1]
        return (2 * rows if self.scheme == "int4" else rows, self.n)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in (self.codes, self.scales))

    def with_int8_rows(self, rows: int) -> "PackedQuantized":
        """This weight with `int8_rows` = rows (0: the float path at every row count). The codes are
        stored as quads where every row count takes the integer path (rows 1) and the build's
        kernel reads them so (int8: AVX-512 VNNI), else as rows (int8) or pairs (int4)."""
        if rows < 0:
            raise ValueError(f"int8_rows must be >= 0 (0: never), got {rows}")
        isa = int_dot_isa()
        int4 = self.scheme == "int4"
        block = min(self.group_size, ACT_BLOCK)  # the activations' block (quant_dot.h's ActBlockFor)
        quads = (rows == 1 and self.codes.shape[2] == panel() and self.group_size % (8 if int4 else 4) == 0
                 and block % 4 == 0 and self.group_size % block == 0
                 and (isa is not None if int4 else isa == "avx512-vnni"))
        codes = self.codes
        if quads != self.quads:
            to, back = (_pairs_to_quads, _quads_to_pairs) if int4 else (_rows_to_quads, _quads_to_rows)
            codes = (to if quads else back)(codes)
        return dataclasses.replace(self, codes=codes, int8_rows=int(rows), quads=quads)

    def __getitem__(self, key):
        """`param[...]` (how the model reads a weight) is the weight itself."""
        if key is Ellipsis:
            return self
        raise TypeError(f"a PackedQuantized weight is read whole (`w[...]`), got index {key!r}")


QUANTIZED_SCHEMES = ("int8", "int4")
SCALE_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def can_pack_quantized(w: Any) -> bool:
    """Whether `pack_quantized` takes this `QuantizedWeight` (a 2-D int8 or int4 weight)."""
    return (getattr(w, "scheme", None) in QUANTIZED_SCHEMES and len(w.values.shape) == 2
            and len(w.scales.shape) == 2 and w.scales.shape[0] >= 1)


def pack_quantized(w: Any) -> PackedQuantized:
    """A `jserve.model.quant.QuantizedWeight` of shape [K, N] (int8 or int4, symmetric or with
    offsets, scales float16 or float32) -> `PackedQuantized` panels of P = `panel()` columns, N
    padded with zero codes and zero scales (and offsets). Scales and offsets of different dtypes
    both become float32; other scale dtypes become float32."""
    if not can_pack_quantized(w):
        raise ValueError(f"pack_quantized needs a 2-D int8 or int4 QuantizedWeight, got scheme "
                         f"{getattr(w, 'scheme', None)!r} with codes {getattr(w.values, 'shape', None)}")
    rows, n = w.values.shape
    groups = w.scales.shape[0]
    k = 2 * rows if w.scheme == "int4" else rows
    if k % groups or (w.scheme == "int4" and (k // groups) % 2):
        raise ValueError(f"pack_quantized: {groups} groups do not split K={k} into groups of even size")
    width = panel()
    panels = -(-n // width)
    pad = panels * width - n
    code_dtype = jnp.uint8 if w.scheme == "int4" else jnp.int8
    codes = jnp.asarray(w.values).astype(code_dtype)
    if w.scheme == "int4" and w.offsets is None:
        codes = codes ^ jnp.uint8(0x88)  # two's complement nibbles [-8, 7] -> code + 8 in [0, 15]
    codes = jnp.pad(codes, ((0, 0), (0, pad)))
    codes = codes.reshape(rows, panels, width).transpose(1, 0, 2)
    parts = [jnp.asarray(w.scales)] + ([] if w.offsets is None else [jnp.asarray(w.offsets)])
    dtype = parts[0].dtype if all(p.dtype == parts[0].dtype for p in parts) and parts[0].dtype in SCALE_DTYPES \
        else jnp.dtype(jnp.float32)
    scales = jnp.stack([jnp.pad(p.astype(dtype), ((0, 0), (0, pad))) for p in parts], axis=1)  # [G, S, N]
    scales = scales.reshape(groups, len(parts), panels, width).transpose(2, 0, 1, 3)
    return PackedQuantized(codes, scales, w.scheme, k // groups, n)


def _pairs_to_quads(codes: jax.Array) -> jax.Array:
    """int4 codes [P, K / 2, W] as nibble pairs -> as quads (quant_dot.h's QuadCodes), same shape:
    per 8 rows t and vector v of L = W / 3 columns (a panel is three SIMD vectors), byte 4j + i holds
    row 8t + i (low nibble) and 8t + 4 + i (high) of column Lv + j."""
    p, half, w = codes.shape
    rows = jnp.stack([codes & 0xF, codes >> 4], axis=2).reshape(p, half // 4, 2, 4, 3, w // 3)  # t h i v j
    return (rows[:, :, 0] | (rows[:, :, 1] << 4)).transpose(0, 1, 3, 4, 2).reshape(p, half, w).astype(jnp.uint8)


def _quads_to_pairs(codes: jax.Array) -> jax.Array:
    """The inverse of `_pairs_to_quads`."""
    p, half, w = codes.shape
    q = codes.reshape(p, half // 4, 3, w // 3, 4)  # t v j i
    rows = jnp.stack([q & 0xF, q >> 4], axis=2).transpose(0, 1, 2, 5, 3, 4).reshape(p, 2 * half, w)  # t h i | v j
    return (rows[:, 0::2] | (rows[:, 1::2] << 4)).astype(jnp.uint8)


def _rows_to_quads(codes: jax.Array) -> jax.Array:
    """int8 codes [P, K, W] as rows -> as quads (quant_dot.h's QuadCodes), same shape and dtype:
    per 4 rows r and vector v of L = W / 3 columns, byte 4j + i holds row 4r + i of column Lv + j,
    plus 128 (the bits of an unsigned byte, as VPDPBUSD reads them)."""
    p, k, w = codes.shape
    q = codes.reshape(p, k // 4, 4, 3, w // 3).transpose(0, 1, 3, 4, 2).reshape(p, k, w)  # r i v j -> r v j i
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(q, jnp.uint8) ^ jnp.uint8(0x80), jnp.int8)


def _quads_to_rows(codes: jax.Array) -> jax.Array:
    """The inverse of `_rows_to_quads`."""
    p, k, w = codes.shape
    c = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(codes, jnp.uint8) ^ jnp.uint8(0x80), jnp.int8)
    return c.reshape(p, k // 4, 3, w // 3, 4).transpose(0, 1, 4, 2, 3).reshape(p, k, w)


def quads_bits(weights) -> int:
    """The FFI calls' `quads` attribute for these quantized weights: 1 where the int4 ones are stored
    as quads, 2 where the int8 ones are (one call may mix the schemes, as GGUF layers do)."""
    return (1 if any(w.quads and w.scheme == "int4" for w in weights) else 0) | \
        (2 if any(w.quads and w.scheme == "int8" for w in weights) else 0)


def quantized_codes(packed: PackedQuantized) -> jax.Array:
    """The integer codes [K, N] of a `PackedQuantized` (int8; int4 unpacked, signed where symmetric)."""
    back = _quads_to_pairs if packed.scheme == "int4" else _quads_to_rows
    codes = back(packed.codes) if packed.quads else packed.codes
    c = codes.transpose(1, 0, 2).reshape(codes.shape[1], -1)[:, :packed.n]
    if packed.scheme == "int8":
        return c
    q = jnp.stack([c & 0xF, c >> 4], axis=1).reshape(2 * c.shape[0], c.shape[1]).astype(jnp.int8)
    return q - 8 if packed.symmetric else q


def quantized_rows(packed: PackedQuantized, ids: jax.Array, dtype) -> jax.Array:
    """Columns `ids` of the weight [K, N] that `packed` stands for, as rows [*ids.shape, K] in
    `dtype` (dequantized in float32): the embedding lookup of a tied table packed as its
    transpose (token t: panel t // P, lane t % P)."""
    lanes = packed.codes.shape[2]
    p, lane = ids // lanes, ids % lanes
    if packed.quads and packed.scheme == "int8":  # row k of column lane: quad k // 4, vector, lane, byte k % 4
        vec = lanes // 3
        k = jnp.arange(packed.codes.shape[1])
        at = (k // 4 * 4 * lanes + k % 4)[None] + (lane // vec * 4 * vec + lane % vec * 4)[..., None]
        c = packed.codes.reshape(packed.codes.shape[0], -1)[p[..., None], at]  # [*ids, K]
        c = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(c, jnp.uint8) ^ jnp.uint8(0x80), jnp.int8)
    elif packed.quads:  # column lane's 4 bytes of each octet (4 lanes bytes) of rows: rows 8t + i, 8t + 4 + i
        octets = packed.codes.reshape(packed.codes.shape[0], -1, 4 * lanes)
        vec = lanes // 3
        at = (lane // vec * 4 * vec + lane % vec * 4)[..., None, None] + jnp.arange(4)
        b = octets[p[..., None, None], jnp.arange(octets.shape[1])[:, None], at]  # [*ids, K / 8, 4]
        c = jnp.stack([b & 0xF, b >> 4], axis=-2).reshape(*ids.shape, -1).astype(jnp.int8)
        if packed.symmetric:
            c = c - 8
    else:
        c = packed.codes[p, :, lane]  # [*ids, K or K / 2]
    if packed.scheme == "int4" and not packed.quads:
        c = jnp.stack([c & 0xF, c >> 4], axis=-1).reshape(*ids.shape, 2 * c.shape[-1]).astype(jnp.int8)
        if packed.symmetric:
            c = c - 8
    s = packed.scales[p, :, :, lane].astype(jnp.float32)  # [*ids, K / G, S]
    groups = s.shape[-2]
    q = c.astype(jnp.float32).reshape(*ids.shape, groups, -1)
    out = q * s[..., 0:1]
    if not packed.symmetric:
        out = out + s[..., 1:2]
    return out.reshape(*ids.shape, q.shape[-1] * groups).astype(dtype)


def matmul_packed(x: jax.Array, packed, n: int | None = None) -> jax.Array:
    """`x @ w` in float32 (x cast to float32) for x [..., K] and `packed = pack(w)` (width `n`
    needed) or `pack_quantized(w)` (its own `n` unless given); returns float32 [..., n]."""
    if isinstance(packed, PackedQuantized):
        return _call(TARGET_MANY, x, (packed,), (packed.n if n is None else n,))[0]
    return _call(TARGET, x, (packed,), (n,))[0]


def matmul_packed_many(x: jax.Array, packed: Sequence, ns: Sequence[int] | None = None) -> tuple[jax.Array, ...]:
    """`(x @ w_1, ..., x @ w_k)` for `packed[i] = pack(w_i)` or `pack_quantized(w_i)` as one call:
    the panels of all the weights are shared out over the threads together (q/k/v, gate/up: one
    wait, not three). `ns` may be left out where every weight is a `PackedQuantized`."""
    if ns is None:
        ns = tuple(w.n if isinstance(w, PackedQuantized) else None for w in packed)
    if len(packed) != len(ns) or not packed or any(n is None for n in ns):
        raise ValueError(f"matmul_packed_many needs one width per weight, got {len(packed)} weights "
                         f"and widths {tuple(ns)}")
    return _call(TARGET_MANY, x, tuple(packed), tuple(ns))


def _check_float(w, x, width):
    if w.ndim != 3 or w.shape[2] != width or x.shape[-1] != w.shape[1]:
        raise ValueError(f"matmul_packed needs x [..., K] and a packed weight [N / {width}, K, {width}], "
                         f"got {x.shape} and {w.shape}")
    if w.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"matmul_packed needs a float32 or bfloat16 packed weight, got {w.dtype}")


def _check_quantized(w: PackedQuantized, x, width):
    k = w.shape[0]
    if (w.codes.ndim != 3 or w.codes.shape[2] != width or x.shape[-1] != k or w.scales.ndim != 4
            or w.scales.shape[0] != w.codes.shape[0] or w.scales.shape[3] != width
            or w.scales.shape[1] * w.group_size != k or w.scales.dtype not in SCALE_DTYPES
            or w.codes.dtype != (jnp.uint8 if w.scheme == "int4" else jnp.int8)):
        raise ValueError(f"matmul_packed needs x [..., K] and a quantized weight packed for [K, N] with "
                         f"{width}-column panels, got {x.shape} and {w.scheme} codes {w.codes.shape} "
                         f"{w.codes.dtype}, scales {w.scales.shape} {w.scales.dtype}")


def _call(target: str, x: jax.Array, packed: tuple, ns: tuple) -> tuple[jax.Array, ...]:
    width = panel()  # raises if the kernel is unavailable
    args = []
    for w, n in zip(packed, ns):
        if isinstance(w, PackedQuantized):
            _check_quantized(w, x, width)
            args += [w.codes, w.scales]
            panels = w.codes.shape[0]
        else:
            _check_float(w, x, width)
            args.append(w)
            panels = w.shape[0]
        if not 0 < n <= panels * width:
            raise ValueError(f"n={n} must be in (0, {panels * width}] for a weight of {panels} panels")
    lead = x.shape[:-1]
    flat = x.reshape(math.prod(lead), x.shape[-1]).astype(jnp.float32)
    shapes = [jax.ShapeDtypeStruct((flat.shape[0], (w.codes if isinstance(w, PackedQuantized) else w).shape[0]
                                    * width), jnp.float32) for w in packed]
    many = target == TARGET_MANY
    target = _LIBRARY.target(target, any(isinstance(w, PackedQuantized) for w in packed))
    quantized = [w for w in packed if isinstance(w, PackedQuantized)]
    # The call's rows: its weights' fewest (a weight stored as quads needs the integer path at every count).
    attrs = {"int8_rows": np.int32(min((w.int8_rows for w in quantized), default=0)),
             "quads": np.int32(quads_bits(quantized))} if many else {}
    outs = jax.ffi.ffi_call(target, shapes if many else shapes[0], vmap_method="sequential")(flat, *args, **attrs)
    outs = outs if many else (outs,)
    return tuple((o if o.shape[1] == n else o[:, :n]).reshape(*lead, n) for o, n in zip(outs, ns))

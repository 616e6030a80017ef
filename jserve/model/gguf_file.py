"""A GGUF file's metadata and tensors, read as `gguf.GGUFReader` reads them, in a fraction of its time.

`gguf.GGUFReader` builds a numpy view per metadata value, so a large vocabulary (Gemma 3's 262144
tokens, scores and types) costs about a million of them, seconds before a single tensor is read
(docs/performance.md, "Host side"). The header is plain length-prefixed records: `read_gguf_kv`
parses the metadata directly (the tokenizer's reader), and the tensor infos after it are parsed here; each
tensor's `data` is the same memory-mapped view of the file GGUFReader gives (quantized types as
their raw bytes, [..., rows, bytes per row]), so `gguf.quants.dequantize` and
`jserve.model.quant_import` read it unchanged.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np

from jserve.text.tokenizer_gguf import read_gguf_kv

__all__ = ["GGUFFile", "GGUFTensor"]

_DEFAULT_ALIGNMENT = 32


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF's order (innermost first, as GGUFReader's), `data` a view of the file."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


class GGUFFile:
    """`meta`: every metadata key's value (strings, numbers, lists, as `ReaderField.contents()`
    gives them); `tensors`: the tensors in file order."""

    def __init__(self, path: str | Path):
        import gguf
        from gguf.quants import quant_shape_to_byte_shape

        path = Path(path)
        meta, num_tensors, pos = read_gguf_kv(path)
        self.meta: dict[str, Any] = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in meta.items()}
        self._map = np.memmap(path, mode="r")
        buf = self._map.view(np.ndarray)  # plain views: a memmap's own slicing is slow
        infos = []
        for _ in range(num_tensors):
            (n,) = struct.unpack_from("<Q", buf, pos)
            name = bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8")
            pos += 8 + n
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, gguf.GGMLQuantizationType(ggml_type), offset))
        alignment = int(self.meta.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: invalid general.alignment {alignment}")
        start = pos + (-pos % alignment)
        plain = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
                 gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                 gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                 gguf.GGMLQuantizationType.I64: np.int64}
        self.tensors: list[GGUFTensor] = []
        seen = set()
        for name, dims, ggml_type, offset in infos:
            if name in seen:
                raise ValueError(f"{path}: tensor {name!r} appears twice")
            seen.add(name)
            n_elems = int(np.prod(dims, dtype=np.int64))
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block_size
            np_dims = tuple(reversed(dims))
            at = start + offset
            if at + n_bytes > buf.size:
                raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
            raw = buf[at:at + n_bytes]
            if ggml_type in plain:
                data = raw.view(plain[ggml_type]).reshape(np_dims)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(np_dims, ggml_type))
            self.tensors.append(GGUFTensor(name, ggml_type, np.array(dims, dtype=np.uint64), data))

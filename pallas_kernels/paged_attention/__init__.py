"""Paged attention over a KV cache laid out `[num_kv_heads, num_pages, page_size, head_dim]`.

`paged_attention` (decode: one query per row) and `paged_prefill_attention` (a causal chunk of
queries per row) dispatch to a backend: "cpu" (a native C++ kernel called through XLA's FFI,
built on first use; Pallas interpret mode without a compiler), "cpu_pallas" (interpret mode only),
"tpu" (Mosaic TPU kernel), "gpu" (Mosaic GPU kernel for Hopper; the XLA gather for float32 K/V
or head sizes it does not take) or "reference" (pure jnp). `ragged_paged_attention` takes a
whole mixed batch (decode rows and prefill chunks, tokens flattened) in one call, on the same
backends (`ragged.py`).
"""

from pallas_kernels.paged_attention.ops import BACKENDS, paged_attention, paged_prefill_attention
from pallas_kernels.paged_attention.ragged import ragged_paged_attention
from pallas_kernels.paged_attention.reference import paged_attention_reference, paged_prefill_attention_reference

__all__ = ["BACKENDS", "paged_attention", "paged_prefill_attention", "paged_attention_reference",
           "paged_prefill_attention_reference", "ragged_paged_attention"]

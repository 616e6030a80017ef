"""jserve: an LLM serving engine on JAX (paged KV cache, Pallas kernels, continuous batching).

`from jserve import LLM, SamplingParams` is the offline API. Names are imported lazily so that
the pure-Python bookkeeping modules (request, page_table, scheduler) never pull in JAX.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jserve.llm",
    "LoRARequest": "jserve.core.lora_slots",
    "SamplingParams": "jserve.core.request",
    "StructuredOutputsParams": "jserve.core.request",
    "RequestOutput": "jserve.core.request",
    "CompletionOutput": "jserve.core.request",
    "Logprob": "jserve.core.request",
    "ModelConfig": "jserve.model.config",
    "Tokenizer": "jserve.text.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jserve' has no attribute {name!r}")

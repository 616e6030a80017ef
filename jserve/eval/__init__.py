"""`jserve eval`: perplexity, KL divergence from a reference and greedy agreement (the quality
measurement behind quantization's gate), defined as llama.cpp's `llama-perplexity` defines them.

Modules: text (the evaluation text), chunks (llama.cpp's chunking and scored positions), metrics
(per-token statistics and summaries), models (loading, quantizing at load), scoring (running a
model over chunks), greedy (greedy agreement), report (`EvalReport`, JSON and table), evaluate
(the whole measurement), cli (`jserve eval`). Names are imported lazily: building the CLI's
parser imports no JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "evaluate": "jserve.eval.evaluate",
    "EvalModel": "jserve.eval.models",
    "load_model": "jserve.eval.models",
    "quantized": "jserve.eval.models",
    "EvalReport": "jserve.eval.report",
    "default_text": "jserve.eval.text",
    "load_text": "jserve.eval.text",
    "write_text": "jserve.eval.text",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jserve.eval' has no attribute {name!r}")

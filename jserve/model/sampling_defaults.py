"""A model's own sampling defaults: Hugging Face's generation_config.json, read as vLLM's
`--generation-config auto` reads it.

vLLM applies the keys its model creator set to a value other than transformers' default
(`GenerationConfig.to_diff_dict`): temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as the default max_tokens. `jserve convert` records them in generation.json
(`sampling_defaults`), so a checkpoint carries them; the server applies them to the fields a
request leaves out (`--generation-config`, jserve.server.cli).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# transformers' GenerationConfig defaults: a key set to its default is not the creator's choice
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                                "repetition_penalty": 1.0, "max_new_tokens": None}
_REQUEST_NAME = {"max_new_tokens": "max_tokens"}  # the request field each key is the default of
_INTEGERS = frozenset({"top_k", "max_new_tokens"})


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """The sampling defaults in `folder`/generation_config.json, by request field name ({} when
    there is none); ValueError naming a key whose value is not a number of the right kind."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    out = {}
    for key, default in _HF_DEFAULTS.items():
        value = data.get(key)
        if value is None or value == default:
            continue
        kind = int if key in _INTEGERS else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
            want = "an integer" if key in _INTEGERS else "a finite number"
            raise ValueError(f"{path}: {key} must be {want}, got {value!r}")
        out[_REQUEST_NAME.get(key, key)] = value
    return out


def of_source(source: str | Path) -> dict[str, Any]:
    """The defaults a conversion of `source` records: a jserve checkpoint's own, a Hugging Face
    folder's generation_config.json, none for a GGUF file (llama.cpp keeps none in it)."""
    src = Path(source)
    if (src / "generation.json").is_file():
        return dict(json.loads((src / "generation.json").read_text()).get("sampling_defaults", {}))
    return read_generation_config(src) if src.is_dir() else {}


def resolve(choice: str | None, recorded: dict[str, Any]) -> dict[str, Any]:
    """`--generation-config`: "auto" (the default, as vLLM's) the checkpoint's `recorded`
    defaults, "vllm" none (the API's own), a folder its generation_config.json's."""
    if choice in (None, "auto"):
        return dict(recorded)
    if choice == "vllm":
        return {}
    if not Path(choice).is_dir():
        raise ValueError(f"--generation-config {choice}: give 'auto', 'vllm' or a folder holding "
                         f"generation_config.json")
    return read_generation_config(choice)

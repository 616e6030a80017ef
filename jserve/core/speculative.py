"""Speculative decoding's settings (`SpeculativeConfig`, vLLM's `speculative_config`). Pure Python.

A speculative step proposes up to k draft tokens per decoding sequence, and the target model
verifies them all in one fixed-shape step (`jserve.runtime.runner.Runner.execute_verify`): it
samples at each of the k + 1 positions, and a draft is accepted while it equals the target's own
sample at its position. The first sample that differs (or the one after the last draft) is kept
too, so every verified row gains 1 .. k + 1 tokens, each exactly the token decoding without
speculation would have sampled (same per-row seed and step): greedy and seeded output are token
for token those of plain decoding. For a deterministic proposal (n-gram lookup, a greedy draft
model) this is Leviathan et al.'s rejection sampling: a draft d is accepted with probability
p(d) = min(1, p(d) / q(d)) for the point mass q, and on rejection the kept token follows p
without d, renormalised (`max(0, p - q)`), so the output distribution is the target's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DRAFT_QUANTIZATIONS = ("int8", "int4", "fp8", "gguf")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """What to propose and when (the keys of vLLM's `speculative_config`, plus the turn-down knobs).

    Attributes:
      method: "ngram" (prompt lookup over the sequence's own tokens) or "draft_model" (a smaller
        model with the same vocabulary, `model`, proposing greedily).
      num_speculative_tokens: k, drafts per sequence and step (1 .. 16).
      prompt_lookup_min, prompt_lookup_max: the n-gram sizes tried, longest first (ngram).
      model: the draft model (a checkpoint folder, Hugging Face folder, .gguf or converted name).
      quantization: quantize the draft's weights at load, "int8", "int4", "fp8", or "gguf" (a
        .gguf file's own weights); a draft's quality moves the acceptance rate, never the output,
        so no quality gate applies.
      disable_by_batch_size: no speculation in a step with more decoding sequences than this
        (the verify step stops being bandwidth-bound; None: the engine's measured default).
      min_acceptance: a sequence whose acceptance rate, after `acceptance_window` proposed
        tokens, falls below this stops proposing for `backoff_steps` steps (0 turns it off).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance: float = 0.2
    acceptance_window: int = 16
    backoff_steps: int = 16

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
                                ("prompt_lookup_min", 1, 64), ("prompt_lookup_max", 1, 64),
                                ("acceptance_window", 1, 10**6), ("backoff_steps", 0, 10**6)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1, got {size!r}")
        if isinstance(self.min_acceptance, bool) or not isinstance(self.min_acceptance, (int, float)) or not (
                0 <= self.min_acceptance <= 1):
            raise ValueError(f"speculative_config.min_acceptance must be in [0, 1], got {self.min_acceptance!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft checkpoint)")
        if self.method == "ngram" and (self.model is not None or self.quantization is not None):
            raise ValueError("speculative_config: 'model' and 'quantization' are for method 'draft_model', not 'ngram'")
        if self.quantization not in (None, *DRAFT_QUANTIZATIONS):
            raise ValueError(f"speculative_config.quantization must be one of {DRAFT_QUANTIZATIONS}, "
                             f"got {self.quantization!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | Mapping[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From a dict, a JSON object's text (the command line's `--speculative-config`) or None;
        ValueError naming an unknown key or a bad value. A method given as "draft" or "[ngram]"
        spellings is not guessed at: the names are METHODS."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object / dict, got {type(value).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ValueError(f"unknown speculative_config key {unknown[0]!r}; the keys are: {', '.join(names)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs 'method', one of {METHODS}")
        return cls(**value)

"""What the server reads of an `AsyncLLMEngine`'s engine: fixed once the engine is built, so any
thread may read them (the step records are a C-level copy)."""

from __future__ import annotations

from typing import Any


class EngineFacts:
    """A mixin over `self.engine` (an `LLMEngine`)."""

    engine: Any

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.max_num_seqs

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: the token ids a request may carry."""
        return self.engine.runner.config.vocab_size

    @property
    def num_kv_tokens(self) -> int:
        """Tokens the KV pages hold in all (pages x page size; 0 for an engine without pages)."""
        runner = self.engine.runner
        return getattr(runner, "num_pages", 0) * getattr(runner, "page_size", 0)

    @property
    def cache_config(self) -> dict[str, Any]:
        """The KV cache's settings (page size, pages, dtype, prefix caching, memory fraction)."""
        config, runner = self.engine.config, self.engine.runner
        return {"page_size": getattr(runner, "page_size", 0), "num_pages": getattr(runner, "num_pages", 0),
                "kv_cache_dtype": config.kv_cache_dtype, "enable_prefix_caching": config.enable_prefix_caching,
                "memory_fraction": config.memory_fraction}

    @property
    def quantization(self) -> dict[str, Any] | None:
        """The weights' quantization record (label, bits, quality report); None: float weights."""
        return self.engine.quantization

    def step_records(self) -> list:
        """The recent steps' `StepRecord`s, oldest first (a C-level copy: safe beside the thread)."""
        return list(self.engine.runner.records.copy())

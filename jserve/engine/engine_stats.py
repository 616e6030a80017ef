"""An `LLMEngine`'s counters and gauges, as `LLMEngine.stats()` returns them: steps, pages,
prefix-cache hits, the host's idle time between device calls, lazy buckets, structured outputs,
the host KV tier, speculation and async scheduling. Read, never written, here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jserve.engine.llm_engine import LLMEngine


def engine_stats(engine: "LLMEngine") -> dict[str, Any]:
    """`LLMEngine.stats()`: every counter and gauge by name (jserve.server.metrics maps them)."""
    log = engine.runner.step_log
    real, padded = log.total_real_tokens, log.total_padded_tokens
    pools = [t.pool for t in engine.page_tables]
    return {
        "num_steps": engine.num_steps,
        "num_preemptions": engine.scheduler.num_preemptions,
        "num_recomputes": engine.scheduler.num_recomputes,
        "compilations": engine.runner.num_compilations,
        # The prompt-logprob step compiles on first use (not warmed up): counted here.
        "compilations_after_warmup": engine.runner.num_compilations_after_warmup + (
            engine.runner.num_score_compilations) + sum(
            r.num_compilations_after_warmup for r in engine.draft_runners()),
        "pages_in_use": sum(p.num_used_pages for p in pools),
        "pages_cached": sum(p.num_cached_pages for p in pools),
        "pages_free": sum(p.num_free_pages for p in pools),
        "pages_released_behind_window": sum(t.num_window_released_pages for t in engine.page_tables),
        "num_pages": engine.runner.num_pages,
        "prefix_cache_hit_tokens": sum(t.num_prefix_hit_tokens for t in engine.page_tables),
        "prefix_cache_query_tokens": sum(t.num_prefix_query_tokens for t in engine.page_tables),
        "padded_token_fraction": (padded - real) / padded if padded else 0.0,
        "computed_tokens": real,
        "num_running": engine.scheduler.num_running,
        "num_waiting": engine.scheduler.num_waiting,
        **_idle_stats(engine),
        **_bucket_stats(engine),
        **_structured_stats(engine),
        **engine.kv_offload.stats(),
        **(engine.speculator.stats() if engine.speculator is not None else {}),
        **({"launched_steps": engine.runner.overlap.num_launched,
            "overlapped_steps": engine.runner.overlap.num_overlapped,
            "sync_steps": engine.step_fn.num_sync_steps} if engine.async_scheduling else {}),
    }


def _idle_stats(engine: "LLMEngine", recent: int = 64) -> dict[str, float]:
    """The host time between consecutive device calls (the device idles), over the last
    `recent` calls: its mean, and its share of the calls' time plus it."""
    records = list(engine.runner.records)[-recent:]
    idle = sum(r.idle_before for r in records)
    busy = sum(r.seconds for r in records)
    return {"step_idle_seconds": idle / len(records) if records else 0.0,
            "step_idle_fraction": idle / (idle + busy) if idle + busy > 0 else 0.0}


def _bucket_stats(engine: "LLMEngine") -> dict[str, int]:
    """Lazy buckets (`jserve.runtime.lazy_buckets`): calls run in a larger compiled shape than
    their own while it compiled in the background, and the shapes still compiling."""
    lazy = engine.runner.lazy
    return {"bucket_fallbacks": lazy.fallbacks if lazy else 0,
            "buckets_pending": len(lazy.pending) if lazy else 0,
            "warming": int(bool(lazy and lazy.warming)), "buckets_failed": len(lazy.failed) if lazy else 0}


def _structured_stats(engine: "LLMEngine") -> dict[str, Any]:
    return {
        "structured_requests": engine.num_structured_requests,
        "grammar_errors": engine.scheduler.num_grammar_errors,
        "grammars_compiled": engine.grammars.num_compiled,
        "grammar_compile_seconds": engine.grammars.compile_seconds,
        **engine.runner.masks.stats(),  # host time filling masks: in all, and per step of the last 64
    }

"""Prometheus metrics of the server and the engine: TTFT, TPOT, queue vs compute, MBU/MFU, padding waste.

One `ServerMetrics` per app, each with its own `CollectorRegistry` (two apps in one process do
not clash). Request-level numbers are observed as requests finish; engine gauges are refreshed
from `AsyncLLMEngine.stats()` and the runner's recent step records at every scrape.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_REQUEST = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
RECENT_STEPS = 64  # step records behind the utilisation gauges


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("jserve_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("jserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("jserve_generation_tokens", "generated tokens", registry=r)

        def hist(name: str, doc: str, buckets=_LATENCY) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.ttft = hist("jserve_time_to_first_token_seconds", "arrival to first generated token")
        self.tpot = hist("jserve_time_per_output_token_seconds", "decode time per output token after the first")
        self.itl = hist("jserve_inter_token_latency_seconds", "time between successive streamed outputs")
        self.e2e = hist("jserve_e2e_request_latency_seconds", "arrival to finish", _REQUEST)
        self.queue = hist("jserve_request_queue_time_seconds", "arrival to first scheduled (waiting)", _REQUEST)
        self.prefill = hist("jserve_request_prefill_time_seconds", "first scheduled to first token", _REQUEST)
        self.decode = hist("jserve_request_decode_time_seconds", "first token to finish", _REQUEST)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=r)

        self.running = gauge("jserve_num_requests_running", "sequences in the running batch")
        self.waiting = gauge("jserve_num_requests_waiting", "sequences waiting to be scheduled")
        self.in_flight = gauge("jserve_num_requests_in_flight", "engine requests the server has not finished")
        self.pages_used = gauge("jserve_kv_pages_used", "KV pages held by requests")
        self.pages_cached = gauge("jserve_kv_pages_cached", "free KV pages still holding prefix-cache entries")
        self.pages_total = gauge("jserve_kv_pages_total", "KV pages in the pool")
        self.window_pages = gauge("jserve_kv_pages_released_behind_window", "KV pages given back behind a "
                                  "sliding window every layer shares, since start")
        self.kv_usage = gauge("jserve_kv_cache_usage_ratio", "used / total KV pages")
        self.prefix_hit_rate = gauge("jserve_prefix_cache_hit_rate", "prompt tokens found in the prefix cache "
                                                                     "/ prompt tokens looked up")
        self.preemptions = gauge("jserve_num_preemptions", "preemptions since start")
        self.compilations = gauge("jserve_compilations_after_warmup", "jit compilations after warm-up "
                                                                       "(should stay 0)")
        self.padding = gauge("jserve_padded_token_fraction", "padding / padded tokens over all steps")
        self.steps = gauge("jserve_num_steps", "engine steps since start")
        self.tokens_per_s = gauge("jserve_step_tokens_per_second", "real tokens per second of step time, "
                                                                   f"last {RECENT_STEPS} steps")
        self.bytes_per_s = gauge("jserve_achieved_bytes_per_second", "minimum bytes moved per second of step "
                                                                     f"time (bandwidth use), last {RECENT_STEPS} steps")
        self.flops_per_s = gauge("jserve_achieved_flops_per_second", "useful FLOPs per second of step time, "
                                                                     f"last {RECENT_STEPS} steps")
        self.ready = gauge("jserve_ready", "1 once warmed up and serving, else 0")
        self.idle = {key: gauge("jserve_" + key, doc) for key, doc in (
            ("step_idle_seconds", "host time between consecutive device steps (the device idles), mean of "
                                  "the last 64 steps"),
            ("step_idle_fraction", "that idle time's share of step time plus it, last 64 steps"))}
        self.overlap = {key: gauge("jserve_" + key, doc) for key, doc in (
            ("launched_steps", "async scheduling: steps dispatched before the one before was read"),
            ("overlapped_steps", "async scheduling: those dispatched while the step before still ran"),
            ("sync_steps", "async scheduling: steps that waited for the one before (penalties, grammars, "
                           "prompt logprobs)"),
            ("num_recomputes", "sequences recomputed as they passed a LongRoPE model's original context"))}
        self.buckets = {key: gauge("jserve_" + key, doc) for key, doc in (
            ("bucket_fallbacks", "calls run in a larger compiled bucket than their own while it compiled in "
                                 "the background (lazy buckets)"),
            ("buckets_pending", "buckets still compiling in the background"),
            ("buckets_failed", "buckets whose background compilation failed (their calls keep falling back)"))}
        # Structured outputs: LLMEngine.stats() key -> its gauge.
        self.structured = {key: gauge(name, doc) for key, name, doc in (
            ("structured_requests", "jserve_structured_requests", "requests with structured outputs since start"),
            ("grammar_errors", "jserve_grammar_errors", "sampled tokens a grammar refused (should stay 0)"),
            ("grammars_compiled", "jserve_grammars_compiled", "structured-output constraints compiled (cache misses)"),
            ("grammar_compile_seconds", "jserve_grammar_compile_seconds", "time spent compiling constraints, total"),
            ("mask_seconds", "jserve_structured_mask_seconds", "host time filling grammar bitmasks, total"),
            ("mask_steps", "jserve_structured_mask_steps", "steps that filled a grammar bitmask"),
            ("mask_seconds_per_step", "jserve_structured_mask_seconds_per_step",
             "host time filling the grammar bitmask per step, mean of the last 64 such steps"))}
        # Speculative decoding (0 without it): LLMEngine.stats() key -> its gauge.
        self.speculative = {key: gauge("jserve_" + key, doc) for key, doc in (
            ("spec_proposed_tokens", "draft tokens verified since start"),
            ("spec_accepted_tokens", "draft tokens accepted (equal to the target's sample) since start"),
            ("spec_verify_rows", "rows verified since start (one per sequence per verify step)"),
            ("spec_verify_steps", "verify steps since start"),
            ("spec_turned_down_steps", "steps run without speculation because of the batch size"),
            ("spec_acceptance_rate", "accepted / proposed draft tokens since start"),
            ("spec_mean_accepted_length", "tokens a verified row gained per verify step (1 + accepted drafts), "
                                          "mean since start"))}
        self.quantization = Gauge("jserve_quantization_info", "1, labelled with the weights' quantization "
                                  "(none for float weights)", ["quantization"], registry=r)
        self.bits_per_weight = gauge("jserve_weight_bits_per_weight", "stored bits per weight (codes, scales, "
                                                                      "offsets; 0 for float weights)")
        self.quality_kl = gauge("jserve_quantization_kl_mean", "mean KL divergence from the float model in the "
                                                               "weights' quality report")
        self.quality_top1 = gauge("jserve_quantization_top1_agreement", "top-1 agreement with the float model "
                                                                        "in the weights' quality report")

    def set_quantization(self, summary: dict[str, Any] | None) -> None:
        """The weights' quantization and its measured quality (`app.quantization_summary`)."""
        self.quantization.labels(quantization=summary["label"] if summary else "none").set(1)
        if summary:
            for gauge, key in ((self.bits_per_weight, "bits_per_weight"), (self.quality_kl, "kl_mean"),
                               (self.quality_top1, "top1_agreement")):
                if summary.get(key) is not None:
                    gauge.set(summary[key])

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe_timings(self, timings: Any) -> None:
        """A finished engine request's `RequestTimings`."""
        for hist, value in ((self.queue, timings.queue_time), (self.prefill, timings.prefill_time),
                            (self.decode, timings.decode_time), (self.e2e, timings.e2e_time)):
            if value is not None:
                hist.observe(value)
        if timings.first_token_time is not None:
            self.ttft.observe(timings.first_token_time - timings.arrival_time)
        if timings.decode_time is not None and timings.num_output_tokens > 1:
            self.tpot.observe(timings.decode_time / (timings.num_output_tokens - 1))
        self.prompt_tokens.inc(timings.num_prompt_tokens)
        self.generation_tokens.inc(timings.num_output_tokens)

    def update_engine(self, stats: dict, records: Iterable[Any] = ()) -> None:
        """Engine gauges from `LLMEngine.stats()` and recent runner `StepRecord`s."""
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.pages_used.set(stats.get("pages_in_use", 0))
        self.pages_cached.set(stats.get("pages_cached", 0))
        total = stats.get("num_pages", 0)
        self.pages_total.set(total)
        self.window_pages.set(stats.get("pages_released_behind_window", 0))
        self.kv_usage.set(stats.get("pages_in_use", 0) / total if total else 0.0)
        query = stats.get("prefix_cache_query_tokens", 0)
        self.prefix_hit_rate.set(stats.get("prefix_cache_hit_tokens", 0) / query if query else 0.0)
        self.preemptions.set(stats.get("num_preemptions", 0))
        self.compilations.set(stats.get("compilations_after_warmup", 0))
        self.padding.set(stats.get("padded_token_fraction", 0.0))
        self.steps.set(stats.get("num_steps", 0))
        for key, gauge_ in (*self.structured.items(), *self.speculative.items(), *self.idle.items(),
                            *self.overlap.items(), *self.buckets.items()):
            gauge_.set(stats.get(key, 0))
        recent = list(records)[-RECENT_STEPS:]
        seconds = sum(r.seconds for r in recent)
        if seconds > 0:
            self.tokens_per_s.set(sum(r.real_tokens for r in recent) / seconds)
            self.bytes_per_s.set(sum(r.bytes_needed for r in recent) / seconds)
            self.flops_per_s.set(sum(r.flops_needed for r in recent) / seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

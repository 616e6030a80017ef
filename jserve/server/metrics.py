"""Prometheus metrics of the server and the engine: jserve's own series (TTFT, TPOT, queue vs
compute, MBU/MFU, padding waste), vLLM's `vllm:*` series (`metrics_vllm`, once an engine is
attached) and the process collector (`process_*`, `python_*`).

One `ServerMetrics` per app, each with its own `CollectorRegistry` (two apps in one process do
not clash). Request-level numbers are observed as requests finish; engine gauges are refreshed
from `AsyncLLMEngine.stats()` and the runner's recent step records at every scrape.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jserve.server.metrics_vllm import VllmMetrics

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_REQUEST = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
RECENT_STEPS = 64  # step records behind the utilisation gauges

# Histograms: attribute, name after "jserve_", help, buckets.
_HISTOGRAMS = (
    ("ttft", "time_to_first_token_seconds", "arrival to first generated token", _LATENCY),
    ("tpot", "time_per_output_token_seconds", "decode time per output token after the first", _LATENCY),
    ("itl", "inter_token_latency_seconds", "time between successive streamed outputs", _LATENCY),
    ("e2e", "e2e_request_latency_seconds", "arrival to finish", _REQUEST),
    ("queue", "request_queue_time_seconds", "arrival to first scheduled (waiting)", _REQUEST),
    ("prefill", "request_prefill_time_seconds", "first scheduled to first token", _REQUEST),
    ("decode", "request_decode_time_seconds", "first token to finish", _REQUEST),
)
# Gauges set at each scrape from the `LLMEngine.stats()` key of the same row: key, name after
# "jserve_", help. Totals since start stay gauges here (their counters are the vllm:* ones).
_STATS_GAUGES = (
    ("num_running", "num_requests_running", "sequences in the running batch"),
    ("num_waiting", "num_requests_waiting", "sequences waiting to be scheduled"),
    ("pages_in_use", "kv_pages_used", "KV pages held by requests"),
    ("pages_cached", "kv_pages_cached", "free KV pages still holding prefix-cache entries"),
    ("num_pages", "kv_pages_total", "KV pages in the pool"),
    ("pages_released_behind_window", "kv_pages_released_behind_window",
     "KV pages given back behind a sliding window every layer shares, since start"),
    ("num_preemptions", "num_preemptions", "preemptions since start"),
    ("compilations_after_warmup", "compilations_after_warmup", "jit compilations after warm-up (should stay 0)"),
    ("padded_token_fraction", "padded_token_fraction", "padding / padded tokens over all steps"),
    ("num_steps", "num_steps", "engine steps since start"),
    ("step_idle_seconds", "step_idle_seconds", "host time between consecutive device steps (the device idles), "
                                               "mean of the last 64 steps"),
    ("step_idle_fraction", "step_idle_fraction", "that idle time's share of step time plus it, last 64 steps"),
    ("launched_steps", "launched_steps", "async scheduling: steps dispatched before the one before was read"),
    ("overlapped_steps", "overlapped_steps", "async scheduling: those dispatched while the step before still ran"),
    ("sync_steps", "sync_steps", "async scheduling: steps that waited for the one before (penalties, grammars, "
                                 "prompt logprobs)"),
    ("num_recomputes", "num_recomputes", "sequences recomputed as they passed a LongRoPE model's original context"),
    ("bucket_fallbacks", "bucket_fallbacks", "calls run in a larger compiled bucket than their own while it "
                                             "compiled in the background (lazy buckets)"),
    ("buckets_pending", "buckets_pending", "buckets still compiling in the background"),
    ("warming", "warming", "1 while buckets compile in the background (calls may run padded further, slower), "
                           "else 0; /health says so too"),
    ("buckets_failed", "buckets_failed", "buckets whose background compilation failed (their calls keep falling "
                                         "back)"),
    ("structured_requests", "structured_requests", "requests with structured outputs since start"),
    ("grammar_errors", "grammar_errors", "sampled tokens a grammar refused (should stay 0)"),
    ("grammars_compiled", "grammars_compiled", "structured-output constraints compiled (cache misses)"),
    ("grammar_compile_seconds", "grammar_compile_seconds", "time spent compiling constraints, total"),
    ("mask_seconds", "structured_mask_seconds", "host time filling grammar bitmasks, total"),
    ("mask_steps", "structured_mask_steps", "steps that filled a grammar bitmask"),
    ("mask_seconds_per_step", "structured_mask_seconds_per_step",
     "host time filling the grammar bitmask per step, mean of the last 64 such steps"),
    ("computed_tokens", "computed_tokens", "tokens the device computed since start (prompts' and decodes', "
                                           "padding excluded)"),
    ("kv_offload_pages_offloaded", "kv_offload_pages_offloaded", "host KV tier: pages copied out since start"),
    ("kv_offload_pages_reloaded", "kv_offload_pages_reloaded", "host KV tier: pages copied back since start"),
    ("prefix_cache_hit_tokens", "prefix_cache_hit_tokens_device", "prompt tokens found in the device's prefix cache"),
    ("kv_offload_host_hit_tokens", "prefix_cache_hit_tokens_host", "prompt tokens reloaded from the host KV tier"),
    ("kv_offload_host_pages", "kv_offload_host_pages", "host KV tier: pages held (ready to reload)"),
    ("kv_offload_pages_in_flight", "kv_offload_pages_in_flight", "host KV tier: device pages pinned by a copy out"),
    ("kv_offload_bytes_per_second", "kv_offload_bytes_per_second", "host KV tier: bytes copied out / their copy "
                                                                   "time (dispatch to completion seen)"),
    ("kv_reload_bytes_per_second", "kv_reload_bytes_per_second", "host KV tier: bytes copied back / their time"),
    ("kv_reload_seconds", "kv_reload_seconds", "host KV tier: time the reloads took, total (until seen done, "
                                               "polled once a step: an upper bound)"),
    ("kv_reload_host_seconds", "kv_reload_host_seconds", "host KV tier: the host's part of the reloads (staging "
                                                         "the slots, dispatching the copies), total"),
    ("kv_reload_prefill_seconds_saved", "kv_reload_prefill_seconds_saved", "host KV tier: the prefill time the "
                                                                           "reloaded tokens would have taken (est.)"),
    ("spec_proposed_tokens", "spec_proposed_tokens", "draft tokens verified since start"),
    ("spec_accepted_tokens", "spec_accepted_tokens", "draft tokens accepted (equal to the target's sample) since "
                                                     "start"),
    ("spec_verify_rows", "spec_verify_rows", "rows verified since start (one per sequence per verify step)"),
    ("spec_verify_steps", "spec_verify_steps", "verify steps since start"),
    ("spec_turned_down_steps", "spec_turned_down_steps", "steps run without speculation because of the batch size"),
    ("spec_acceptance_rate", "spec_acceptance_rate", "accepted / proposed draft tokens since start"),
    ("spec_mean_accepted_length", "spec_mean_accepted_length", "tokens a verified row gained per verify step "
                                                               "(1 + accepted drafts), mean since start"),
)
# LoRA gauges from `LoraManager.stats()` (a dict counts its entries): key, name after "jserve_lora_", help.
_LORA_GAUGES = (
    ("loaded", "adapters_loaded", "LoRA adapters requests may name (--lora-modules and loaded at run time)"),
    ("resident", "adapters_resident", "LoRA adapters in a device slot"),
    ("running", "adapters_running", "LoRA adapters that running requests use"),
    ("max_loras", "max_loras", "device slots for LoRA adapters (--max-loras)"),
    ("num_loads", "slot_loads", "LoRA adapters written into a device slot since start"),
)
# Gauges the server sets itself: attribute, name after "jserve_", help.
_GAUGES = (
    ("in_flight", "num_requests_in_flight", "engine requests the server has not finished"),
    ("kv_usage", "kv_cache_usage_ratio", "used / total KV pages"),
    ("prefix_hit_rate", "prefix_cache_hit_rate", "prompt tokens found in the prefix cache / prompt tokens looked up"),
    ("tokens_per_s", "step_tokens_per_second", f"real tokens per second of step time, last {RECENT_STEPS} steps"),
    ("bytes_per_s", "achieved_bytes_per_second", "minimum bytes moved per second of step time (bandwidth use), "
                                                 f"last {RECENT_STEPS} steps"),
    ("flops_per_s", "achieved_flops_per_second", f"useful FLOPs per second of step time, last {RECENT_STEPS} steps"),
    ("ready", "ready", "1 once warmed up and serving, else 0"),
    ("bits_per_weight", "weight_bits_per_weight", "stored bits per weight (codes, scales, offsets; 0 for float "
                                                  "weights)"),
    ("quality_kl", "quantization_kl_mean", "mean KL divergence from the float model in the weights' quality report"),
    ("quality_top1", "quantization_top1_agreement", "top-1 agreement with the float model in the weights' quality "
                                                    "report"),
)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        for collector in (prometheus_client.ProcessCollector, prometheus_client.PlatformCollector,
                          prometheus_client.GCCollector):
            collector(registry=r)  # process_* and python_* as on prometheus_client's default registry
        self.requests = Counter("jserve_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("jserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("jserve_generation_tokens", "generated tokens", registry=r)
        for attr, name, doc, buckets in _HISTOGRAMS:
            setattr(self, attr, Histogram("jserve_" + name, doc, buckets=buckets, registry=r))
        for attr, name, doc in _GAUGES:
            setattr(self, attr, Gauge("jserve_" + name, doc, registry=r))
        self.from_stats = {key: Gauge("jserve_" + name, doc, registry=r) for key, name, doc in _STATS_GAUGES}
        self.quantization = Gauge("jserve_quantization_info", "1, labelled with the weights' quantization "
                                  "(none for float weights)", ["quantization"], registry=r)
        self.lora = {key: Gauge("jserve_lora_" + name, doc, registry=r) for key, name, doc in _LORA_GAUGES}
        self.lora_requests = Gauge("jserve_lora_requests", "requests run with each LoRA adapter since start",
                                   ["lora_name"], registry=r)
        self.vllm: VllmMetrics | None = None  # once `attach` knows the model

    def attach(self, model_name: str, max_model_len: int, cache_config: dict[str, Any]) -> None:
        """Add the `vllm:*` series for the served model (`ServerState.attach`)."""
        if self.vllm is not None:
            raise RuntimeError("these metrics already describe a model; give each app its own ServerMetrics")
        self.vllm = VllmMetrics(self.registry, model_name, max_model_len, cache_config)

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

    def observe_itl(self, seconds: float) -> None:
        """The time between two successive outputs of one stream."""
        self.itl.observe(seconds)
        if self.vllm is not None:
            self.vllm.observe_itl(seconds)

    def observe_timings(self, timings: Any, params: Any = None, sample_tokens: Sequence[int] = ()) -> None:
        """A finished engine request's `RequestTimings`, its `SamplingParams` and the tokens each
        of its samples generated (`VllmMetrics.observe_request`)."""
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
        if self.vllm is not None:
            self.vllm.observe_request(timings, params, sample_tokens)

    def update_engine(self, stats: dict, records: Iterable[Any] = ()) -> None:
        """Engine gauges from `LLMEngine.stats()` and recent runner `StepRecord`s; the `vllm:*`
        series from the same."""
        for key, gauge in self.from_stats.items():
            gauge.set(stats.get(key, 0))
        total = stats.get("num_pages", 0)
        self.kv_usage.set(stats.get("pages_in_use", 0) / total if total else 0.0)
        query = stats.get("prefix_cache_query_tokens", 0)
        self.prefix_hit_rate.set(stats.get("prefix_cache_hit_tokens", 0) / query if query else 0.0)
        records = list(records)
        recent = records[-RECENT_STEPS:]
        seconds = sum(r.seconds for r in recent)
        if seconds > 0:
            self.tokens_per_s.set(sum(r.real_tokens for r in recent) / seconds)
            self.bytes_per_s.set(sum(r.bytes_needed for r in recent) / seconds)
            self.flops_per_s.set(sum(r.flops_needed for r in recent) / seconds)
        for key, value in (stats.get("lora") or {}).items():
            if key in self.lora:
                self.lora[key].set(len(value) if isinstance(value, dict) else value)
        for name, count in (stats.get("lora") or {}).get("requests_total", {}).items():
            self.lora_requests.labels(lora_name=name).set(count)
        if self.vllm is not None:
            self.vllm.update(stats, records)

    def render(self) -> bytes:
        return generate_latest(self.registry)

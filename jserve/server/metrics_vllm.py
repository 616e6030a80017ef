"""vLLM's Prometheus series (`vllm:*`) beside jserve's own, so that vLLM's Grafana dashboards and the
Gateway API Inference Extension's endpoint picker read a jserve server as they read vLLM.

Names, types, label names and buckets are vLLM v1's (`vllm/v1/metrics/loggers.py`; the sources
and their commits are in tests/data/vllm_metric_names.json), every series labelled with the
first served model name and `engine="0"`. Gauges are set at each scrape from
`AsyncLLMEngine.stats()`; counters advance by what the engine's monotone totals gained since the
last scrape (they never decrease); request histograms are observed as requests finish. README.md
("GET /metrics") says what the dashboards and the gateway read.
"""

from __future__ import annotations

from typing import Any, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason: each exported from 0
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0)
_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N = (1, 2, 5, 10, 20)
_LENGTHS = object()  # stands for vLLM's 1-2-5 buckets up to max_model_len

# Request histograms: attribute, name after "vllm:", help, buckets.
_HISTOGRAMS = (
    ("ttft", "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT),
    ("itl", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL),
    ("tpot", "time_per_output_token_seconds", "Histogram of time per output token in seconds (the "
                                              "inter-token latencies, as vLLM v1 observes it).", _ITL),
    ("request_tpot", "request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", _ITL),
    ("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _REQUEST),
    ("queue", "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _REQUEST),
    ("inference", "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     _REQUEST),
    ("prefill", "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _REQUEST),
    ("decode", "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _REQUEST),
    ("prompt_len", "request_prompt_tokens", "Number of prefill tokens processed.", _LENGTHS),
    ("generation_len", "request_generation_tokens", "Number of generation tokens processed.", _LENGTHS),
    ("max_generation_len", "request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", _LENGTHS),
    ("params_n", "request_params_n", "Histogram of the n request parameter.", _N),
    ("params_max_tokens", "request_params_max_tokens", "Histogram of the max_tokens request parameter.", _LENGTHS),
    ("iteration_tokens", "iteration_tokens_total", "Histogram of number of tokens per engine_step.", _ITERATION),
)
# Counters fed from the engine's monotone totals: name after "vllm:", help, stats key.
_COUNTERS = (
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_query_tokens"),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hit_tokens"),
    ("num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
    ("prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_verify_rows"),
    ("spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_proposed_tokens"),
    ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_accepted_tokens"),
)
# Gauges set at each scrape: name after "vllm:", help.
_GAUGES = (
    ("num_requests_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ("gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage. "
                             "DEPRECATED: Use vllm:kv_cache_usage_perc instead."),
)


def buckets_1_2_5(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    if not isinstance(max_value, int) or max_value < 1:
        raise ValueError(f"max_value must be an integer >= 1, got {max_value!r}")
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    """The `vllm:*` series of one served model, registered on `registry`.

    Args:
      model_name: the `model_name` label (the first served model name).
      max_model_len: the top of the token-count buckets.
      cache_config: `AsyncLLMEngine.cache_config`, for `vllm:cache_config_info`.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 cache_config: dict[str, Any]):
        values = (model_name, "0")
        lengths = buckets_1_2_5(max_model_len)
        self.hist = {attr: Histogram("vllm:" + name, doc, LABELS, buckets=lengths if b is _LENGTHS else b,
                                     registry=registry).labels(*values) for attr, name, doc, b in _HISTOGRAMS}
        self.counters = {key: Counter("vllm:" + name, doc, LABELS, registry=registry).labels(*values)
                         for name, doc, key in _COUNTERS}
        self.gauges = {name: Gauge("vllm:" + name, doc, LABELS, registry=registry).labels(*values)
                       for name, doc in _GAUGES}
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=registry)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self._success, self._values = success, values
        self._per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", (*LABELS, "position"), registry=registry)
        info = {"block_size": cache_config["page_size"], "num_gpu_blocks": cache_config["num_pages"],
                "num_cpu_blocks": 0, "cache_dtype": cache_config["kv_cache_dtype"],
                "enable_prefix_caching": cache_config["enable_prefix_caching"],
                "gpu_memory_utilization": cache_config["memory_fraction"]}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", (*LABELS, *info),
              registry=registry).labels(*values, *map(str, info.values())).set(1)
        # The gateway's endpoint picker reads this family also from a server without LoRA (max_lora
        # 0); its value is the time of the last update: the picker takes the newest.
        self._lora = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                           ("model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                           registry=registry)
        self._lora_labels = (model_name, "0", "", "")
        self._lora.labels(*self._lora_labels).set_to_current_time()
        self._seen: dict[Any, float] = {}  # counter child -> the engine total it last advanced to
        self._last_record: Any = None  # the newest step record already observed

    def update(self, stats: dict, records: Sequence[Any]) -> None:
        """At a scrape: gauges from `stats`, counters from its monotone totals, and each step
        record not seen before into `iteration_tokens_total`."""
        self.gauges["num_requests_running"].set(stats.get("num_running", 0))
        self.gauges["num_requests_waiting"].set(stats.get("num_waiting", 0))
        total = stats.get("num_pages", 0)
        usage = stats.get("pages_in_use", 0) / total if total else 0.0
        self.gauges["kv_cache_usage_perc"].set(usage)
        self.gauges["gpu_cache_usage_perc"].set(usage)
        self._update_lora(stats.get("lora"))
        for key, child in self.counters.items():
            self._advance(child, stats.get(key, 0))
        finished = stats.get("finished_requests", {})
        for reason in sorted({*FINISH_REASONS, *finished}):
            if reason not in self.success:
                self.success[reason] = self._success.labels(*self._values, reason)
            self._advance(self.success[reason], finished.get(reason, 0))
        for pos, count in enumerate(stats.get("spec_accepted_per_position", ())):
            self._advance(self._per_position.labels(*self._values, str(pos)), count)
        self._observe_steps(records)

    def _update_lora(self, lora: dict | None) -> None:
        """`vllm:lora_requests_info` as vLLM sets it: the adapters of running and of waiting requests,
        comma-separated, at the scrape's time; the series of the previous names is dropped."""
        labels = self._lora_labels if lora is None else (
            self._lora_labels[0], str(lora["max_loras"]), ",".join(lora["waiting"]), ",".join(sorted(lora["running"])))
        if labels != self._lora_labels:
            self._lora.remove(*self._lora_labels)
            self._lora_labels = labels
        self._lora.labels(*labels).set_to_current_time()

    def _advance(self, child: Any, total: float) -> None:
        last = self._seen.get(child, 0)
        child.inc(total - last if total >= last else total)  # below the last: the engine's count restarted
        self._seen[child] = total

    def _observe_steps(self, records: Sequence[Any]) -> None:
        """The records after the last one seen (all of them once it has left the engine's window)."""
        start = 0
        for i in range(len(records) - 1, -1, -1):
            if records[i] is self._last_record:
                start = i + 1
                break
        for record in records[start:]:
            steps = max(1, getattr(record, "steps", 1))  # a multi-step call: its tokens per model step
            for _ in range(steps):
                self.hist["iteration_tokens"].observe(record.real_tokens / steps)
        if records:
            self._last_record = records[-1]

    def observe_itl(self, seconds: float) -> None:
        self.hist["itl"].observe(seconds)
        self.hist["tpot"].observe(seconds)

    def observe_request(self, timings: Any, params: Any = None, sample_tokens: Sequence[int] = ()) -> None:
        """A finished request's `RequestTimings`; `params`: its `SamplingParams`; `sample_tokens`:
        the tokens each of its samples generated (else its total counts as one sample)."""
        h = self.hist
        for name, value in (("queue", timings.queue_time), ("prefill", timings.prefill_time),
                            ("decode", timings.decode_time), ("e2e", timings.e2e_time),
                            ("inference", _since(timings.finished_time, timings.first_scheduled_time)),
                            ("ttft", _since(timings.first_token_time, timings.arrival_time))):
            if value is not None:
                h[name].observe(value)
        h["prompt_len"].observe(timings.num_prompt_tokens)
        h["generation_len"].observe(timings.num_output_tokens)
        longest = max(sample_tokens, default=timings.num_output_tokens)
        h["max_generation_len"].observe(longest)
        if timings.decode_time is not None and longest > 1:
            h["request_tpot"].observe(timings.decode_time / (longest - 1))
        if params is not None:
            h["params_n"].observe(params.n)
            if params.max_tokens is not None:
                h["params_max_tokens"].observe(params.max_tokens)


def _since(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start

"""/metrics speaks vLLM's `vllm:*` series (and the process collector) beside jserve's own.

tests/data/vllm_metric_names.json lists every series vLLM's published Grafana dashboard and the
Gateway API Inference Extension's endpoint picker query, with the files and commits it was read
from; a live server on the tiny SmolLM2-shaped model (test_server's engine) must export each with
vLLM's type, labels and buckets, and its counters must only grow between scrapes.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from types import SimpleNamespace

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from conftest import DATA
from jserve.core.request import SamplingParams
from jserve.server.metrics_vllm import VllmMetrics, buckets_1_2_5
from test_server import MAX_MODEL_LEN, MODEL, PROMPTS, engine, engine_idle, request, run_sync, serving  # noqa: F401

NAMES = json.loads((DATA / "vllm_metric_names.json").read_text())
CACHE = {"page_size": 4, "num_pages": 256, "kv_cache_dtype": "auto", "enable_prefix_caching": True,
         "memory_fraction": 0.9}  # test_server's engine
LONG_PROMPT = " ".join(PROMPTS)  # a few full KV pages: a repeat finds them in the prefix cache


@pytest.fixture(scope="module")
def stop_request(engine):  # noqa: F811 - the fixture imported above
    """A greedy request that ends with finish_reason "stop" (its second token is a stop id)."""
    ids = engine.tokenizer.encode(PROMPTS[1])
    out = run_sync(engine, [ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    return {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop_token_ids": [out.token_ids[1]]}


@pytest.fixture(scope="module")
def server(engine, stop_request):  # noqa: F811
    with serving(engine, (MODEL, "an-alias")) as srv:
        yield srv


def scrape(server) -> dict:
    status, headers, body = request(server, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), (status, headers)
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def samples(families: dict, name: str) -> dict:
    """Sample name + sorted labels -> value, of every family."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
            if s.name == name}


def value(families: dict, name: str, **labels) -> float:
    found = [s.value for f in families.values() for s in f.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def counters(families: dict) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() if f.type == "counter"
            for s in f.samples if s.name.endswith("_total")}


async def _dropped_stream(url: str) -> None:
    """Read one chunk of a long stream, then hang up (the server aborts the request)."""
    body = {"prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()
            resp.close()


def first_traffic(server, stop_request) -> None:
    """n=2 (two "length" samples), a "stop", a streamed chat ("length"), a dropped stream ("abort")."""
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 4, "n": 2,
                                                                   "temperature": 1.0, "ignore_eos": True})
    assert status == 200 and [c["finish_reason"] for c in body["choices"]] == ["length", "length"], body
    status, _, body = request(server, "POST", "/v1/completions", stop_request)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
    status, _, text = request(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "ignore_eos": True, "stream": True})
    assert status == 200 and b'"finish_reason":"length"' in text.replace(b" ", b"")
    llm = server.state.engine.engine
    step = llm.step

    def paced_step():  # the dropped stream must still be running when the server sees the hang-up
        out = step()
        time.sleep(0.004)
        return out

    llm.step = paced_step  # the engine thread looks the method up at every step
    try:
        asyncio.run(_dropped_stream(server.url))
        engine_idle(server)
    finally:
        del llm.step


def check_listed_series(families: dict) -> None:
    """Every listed series: its TYPE, the queried sample names, vLLM's labels and buckets."""
    lengths = [float(b) for b in buckets_1_2_5(MAX_MODEL_LEN)]
    for entry in NAMES["metrics"]:
        name = entry["name"]
        assert name in families, f"{name} is missing from /metrics"
        family = families[name]
        assert family.type == entry["type"], (name, family.type)
        if entry.get("only_with_speculation"):
            continue  # no samples without a speculative config
        assert family.samples, name
        for queried in entry["queried_as"]:
            assert any(s.name == queried for s in family.samples), (name, queried)
        labels = {"model_name", *entry.get("labels", ()), *(() if name == "vllm:lora_requests_info" else ("engine",))}
        for s in family.samples:
            assert labels <= set(s.labels), (name, s.labels)
            assert s.labels["model_name"] == MODEL, (name, s.labels)
        if entry["type"] == "histogram":
            want = entry["buckets"]
            if isinstance(want, str):
                want = lengths if want == "1-2-5 up to max_model_len" else NAMES["bucket_sets"][want]
            bounds = [float(s.labels["le"]) for s in family.samples if s.name == name + "_bucket"]
            assert bounds == [float(b) for b in want] + [float("inf")], (name, bounds)


def test_server_exports_every_listed_vllm_series(server, stop_request):
    before = scrape(server)
    assert value(before, "vllm:request_success_total", finished_reason="abort") == 0  # each reason from 0
    first_traffic(server, stop_request)
    after = scrape(server)
    check_listed_series(after)

    def gained(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert gained("vllm:request_success_total", finished_reason="length") == 3  # the n=2 pair and the chat
    assert gained("vllm:request_success_total", finished_reason="stop") == 1
    assert gained("vllm:request_success_total", finished_reason="abort") == 1
    assert gained("vllm:request_params_n_bucket", le="2.0") - gained("vllm:request_params_n_bucket", le="1.0") == 1
    # The n=2 pair generated 8 tokens, its longest sample 4; every other request has one sample.
    assert gained("vllm:request_generation_tokens_sum") - gained("vllm:request_max_num_generation_tokens_sum") == 4
    assert gained("vllm:inter_token_latency_seconds_count") >= 5  # the streamed chat's 6 outputs
    assert gained("vllm:iteration_tokens_total_count") > 0 and gained("vllm:iteration_tokens_total_sum") > 0
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:kv_cache_usage_perc") == 0.0
    info = next(iter(after["vllm:cache_config_info"].samples)).labels
    assert (info["block_size"], info["num_gpu_blocks"], info["enable_prefix_caching"]) == ("4", "256", "True")
    lora = next(iter(after["vllm:lora_requests_info"].samples))
    assert lora.labels["running_lora_adapters"] == "" and abs(lora.value - time.time()) < 60
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_start_time_seconds", "python_info"):
        assert name in after, f"{name}: the process collector is missing"
    grown = counters(after)
    assert all(grown[k] >= v for k, v in counters(before).items())


def test_counters_grow_with_the_engine_between_scrapes(server):
    before = scrape(server)
    for _ in range(2):  # the same prompt twice: the second finds its pages in the prefix cache
        status, _, body = request(server, "POST", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 5,
                                                                       "temperature": 0, "ignore_eos": True})
        assert status == 200, body
    engine_idle(server)
    after = scrape(server)
    old, new = counters(before), counters(after)
    assert set(old) <= set(new) and all(new[k] >= v for k, v in old.items())

    def gained(name):
        return value(after, name) - value(before, name)

    prompt = body["usage"]["prompt_tokens"]
    assert gained("vllm:prompt_tokens_total") == gained("jserve_prompt_tokens_total") == 2 * prompt
    assert gained("vllm:generation_tokens_total") == gained("jserve_generation_tokens_total") == 10
    assert gained("vllm:prefix_cache_queries_total") >= gained("vllm:prefix_cache_hits_total") > 0
    assert gained("vllm:request_prompt_tokens_count") == gained("vllm:e2e_request_latency_seconds_count") == 2


# ------------------------------------------------------------------------------ without a server

def _metrics() -> tuple[VllmMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return VllmMetrics(registry, "m", 128, CACHE), registry


def _sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def test_counters_advance_by_the_engine_totals_and_never_decrease():
    m, registry = _metrics()
    for stats, want in (({"num_preemptions": 5}, 5), ({"num_preemptions": 8}, 8),
                        ({"num_preemptions": 3}, 11),  # the engine's count restarted: 3 new ones
                        ({"num_preemptions": 3}, 11)):
        m.update(stats, [])
        assert _sample(registry, "vllm:num_preemptions_total") == want
    m.update({"finished_requests": {"stop": 2, "repetition": 1}, "spec_accepted_per_position": [4, 1]}, [])
    m.update({"finished_requests": {"stop": 3, "repetition": 1}, "spec_accepted_per_position": [6, 2]}, [])
    assert _sample(registry, "vllm:request_success_total", finished_reason="stop") == 3
    assert _sample(registry, "vllm:request_success_total", finished_reason="repetition") == 1  # a reason vLLM lacks
    assert _sample(registry, "vllm:request_success_total", finished_reason="length") == 0
    assert [_sample(registry, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(2)] == [6, 2]


def test_each_step_record_counts_once_in_iteration_tokens():
    m, registry = _metrics()
    a, b = SimpleNamespace(real_tokens=12, steps=1), SimpleNamespace(real_tokens=3, steps=1)
    m.update({}, [a, b])
    m.update({}, [a, b])  # nothing new
    m.update({}, [b, SimpleNamespace(real_tokens=8, steps=4)])  # a left the window; a 4-step decode
    assert _sample(registry, "vllm:iteration_tokens_total_count") == 2 + 4
    assert _sample(registry, "vllm:iteration_tokens_total_sum") == 12 + 3 + 8
    assert _sample(registry, "vllm:iteration_tokens_total_bucket", le="1.0") == 0
    assert _sample(registry, "vllm:iteration_tokens_total_bucket", le="8.0") == 5  # 3 and the four 2s


def test_token_buckets_are_vllms():
    assert buckets_1_2_5(128) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(1) == [1]
    with pytest.raises(ValueError, match=re.escape("max_value must be an integer >= 1, got 0")):
        buckets_1_2_5(0)


def test_the_list_names_a_commit_for_each_source():
    sources = NAMES["sources"]
    assert all(re.fullmatch(r"[0-9a-f]{40}", s["commit"]) and s["repo"] and s["path"] for s in sources.values())
    for entry in NAMES["metrics"]:
        assert set(entry["by"]) | {entry["defined_in"]} <= set(sources), entry
        assert entry["name"].startswith("vllm:") and entry["type"] in ("counter", "gauge", "histogram"), entry
    queried = {e["name"] for e in NAMES["metrics"] if e["by"]}
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_requests_running"} <= queried


def test_token_totals_grow_as_tokens_come_not_at_the_end():
    """vLLM counts prompt tokens when the prefill is done and generated tokens each step: a long
    generation's tokens appear in rate() while it runs, not all at its end."""
    from jserve.core.request import CompletionOutput, RequestOutput
    from jserve.engine.request_ledger import RequestLedger

    ledger = RequestLedger(max_timings=4)

    def out(rid, lengths, finished=False):
        reason = "length" if finished else None
        return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(i, "", [7] * k, None, reason)
                                                    for i, k in enumerate(lengths)], finished=finished)

    ledger.count(out("a", [1, 1]), first=True)
    assert ledger.totals() == {"finished_requests": {}, "prompt_tokens": 3, "generation_tokens": 2}
    ledger.count(out("b", [1]), first=True)
    ledger.count(out("a", [4, 2]), first=False)
    assert ledger.totals()["generation_tokens"] == 7 and ledger.totals()["prompt_tokens"] == 6
    ledger.count(out("a", [5, 5], finished=True), first=False)
    ledger.count(out("b", [3], finished=True), first=False)
    assert ledger.totals() == {"finished_requests": {"length": 3}, "prompt_tokens": 6, "generation_tokens": 13}
    assert ledger._generated == {}  # nothing kept for finished requests

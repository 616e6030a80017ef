"""`jserve bench` against a real `jserve serve` subprocess: its figures agree with the server's /metrics.

The engine is test_server's tiny random SmolLM2-shaped model with the vocabulary padded to the
real tokenizer's (the same shapes, so warm-up loads them from the persistent compilation cache).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

import jserve.bench as bench
from conftest import DATA, free_port, wait_healthy
from jserve.bench import server_metrics

_SERVE = '''
import dataclasses, sys
import jax.numpy as jnp
import numpy as np
import jserve.cli
import jserve.server.cli as cli
from jserve.model.checkpoint import read_params
from jserve.engine import EngineConfig, build_engine
from jserve.llm import enable_compilation_cache
from jserve.text.tokenizer import Tokenizer

enable_compilation_cache()  # the test run's cache (JSERVE_COMPILATION_CACHE is inherited)


class Tiny:
    def __init__(self, args):
        config, params = read_params(sys.argv[1])
        tokenizer = Tokenizer.load(sys.argv[2])
        embed = np.asarray(params["embed"])
        extra = np.random.default_rng(0).normal(0, embed.std(), (tokenizer.vocab_size - embed.shape[0], embed.shape[1]))
        params = {**params, "embed": np.concatenate([embed, extra.astype(embed.dtype)])}
        config = dataclasses.replace(config, vocab_size=tokenizer.vocab_size)
        cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=4,
                           num_pages=256, backend="cpu", warmup=True)
        self.engine = build_engine(config, {k: jnp.asarray(v) for k, v in params.items()}, tokenizer, [], cfg)


cli._load = Tiny
sys.exit(jserve.cli.main(["serve", "--port", sys.argv[3], "--served-model-name", "tiny", "--grace-period", "5"]))
'''


@pytest.fixture(scope="module")
def served(smollm2_checkpoint):
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(DATA / "arch" / "smollm2"), str(smollm2_checkpoint),
                             str(port)], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, [proc], 240)  # a cold compilation cache: five shapes of a 49152-wide vocabulary
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_bench_agrees_with_server_metrics(served, tmp_path):
    args = bench.parse_args(["--base-url", served, "--workload", "mix", "--scale", "0.15", "--num-requests", "8",
                             "--concurrency", "4", "--warmup-requests", "2", "--quiet", "--output-dir", str(tmp_path),
                             "--no-plots"])
    result = asyncio.run(bench.run_benchmark(args))
    assert args.model == "tiny"  # from /v1/models
    m = result["runs"][0]["metrics"]
    assert m["completed"] == 8 and m["failed"] == 0, m["errors"]
    assert result["warmup"]["completed"] == 2
    a = m["server_metrics"]
    assert a is not None, "jserve's /metrics was not scraped"
    assert a["requests"] == {"server": 8, "client": 8}
    # token counts: exactly the same
    assert m["input_tokens_exact"]
    assert a["prompt_tokens"]["server"] == a["prompt_tokens"]["client"] == m["total_input_tokens"]
    assert a["generation_tokens"]["server"] == a["generation_tokens"]["client"] == m["total_output_tokens"]
    assert m["total_output_tokens"] == sum(s.max_tokens for s in bench.build_workload("mix", 8, "completions", 0.15, 0))
    # TTFT: the server's histogram runs from the engine's arrival stamp to the sampled token; the
    # client's adds HTTP, tokenization, the hand-off to the event loop, detokenization and the SSE
    # write: *measured* 3-25 ms per request on the loaded 2-core machine, a fixed cost that is tens
    # of percent of this tiny model's ~20 ms TTFT and a few percent of a real model's under load.
    server_ttft, client_ttft = a["ttft_mean_ms"]["server"], a["ttft_mean_ms"]["client"]
    assert 0 < server_ttft <= client_ttft
    assert a["ttft_mean_ms"]["rel_diff"] < 0.05 or client_ttft - server_ttft < 40.0, a["ttft_mean_ms"]
    # the gauge is scraped and reads 0. NB: the runner counts new (kind, batch, tokens) keys, not
    # real jit cache misses, so a recompile of a warmed-up key (uncommitted KV at warm-up, see
    # docs/performance.md) does not show here.
    assert a["compilations_after_warmup"] == 0 and a["compilations_during_run"] == 0
    assert a["steps_during_run"] > 0
    table = server_metrics.format_agreement(a)
    assert "ttft_mean_ms" in table and "generation_tokens" in table
    assert (tmp_path / "results.json").is_file()


def test_no_server_metrics_flag_and_cli_entry(served, capsys):
    """`jserve bench` from the console entry point; --no-server-metrics skips the scrape."""
    import jserve.cli

    rc = jserve.cli.main(["bench", "--base-url", served + "/v1", "--workload", "short-short", "--scale", "0.1",
                          "--num-requests", "2", "--concurrency", "2", "--no-server-metrics"])
    out = capsys.readouterr().out
    assert rc == 0 and "Completed requests:" in out and "server /metrics" not in out
    assert server_metrics.metrics_url(served + "/v1") == served + "/metrics"


def test_parse_metrics_and_compare_without_a_server():
    text = ("# HELP jserve_time_to_first_token_seconds x\n# TYPE jserve_time_to_first_token_seconds histogram\n"
            'jserve_time_to_first_token_seconds_bucket{le="+Inf"} 3.0\n'
            "jserve_time_to_first_token_seconds_sum 0.3\njserve_time_to_first_token_seconds_count 3.0\n"
            "# TYPE jserve_prompt_tokens counter\njserve_prompt_tokens_total 30.0\n"
            "# TYPE jserve_generation_tokens counter\njserve_generation_tokens_total 12.0\n"
            "# TYPE jserve_compilations_after_warmup gauge\njserve_compilations_after_warmup 0.0\n")
    after = server_metrics.parse_metrics(text)
    assert after["jserve_time_to_first_token_seconds_count"] == 3.0 and after["jserve_prompt_tokens_total"] == 30.0
    before = {"jserve_time_to_first_token_seconds_sum": 0.1, "jserve_time_to_first_token_seconds_count": 1.0,
              "jserve_prompt_tokens_total": 10.0, "jserve_generation_tokens_total": 4.0}
    metrics = {"ttft_ms": {"mean": 110.0}, "total_input_tokens": 20, "input_tokens_exact": True,
               "total_output_tokens": 8, "completed": 2}
    a = server_metrics.compare(before, after, metrics)
    assert a["ttft_mean_ms"]["server"] == pytest.approx(100.0) and a["ttft_mean_ms"]["rel_diff"] == pytest.approx(0.1)
    assert a["prompt_tokens"] == {"server": 20.0, "client": 20, "rel_diff": 0.0}
    assert a["generation_tokens"]["server"] == 8.0 and a["compilations_during_run"] == 0.0
    assert server_metrics.compare(None, after, metrics) is None


def _metrics_text(ttft_count: float, spec: tuple[float, float, float] | None) -> str:
    """A jserve /metrics page; ``spec``: the (proposed, accepted, verify rows) gauges, None: without them."""
    text = ("# TYPE jserve_time_to_first_token_seconds histogram\n"
            f'jserve_time_to_first_token_seconds_bucket{{le="+Inf"}} {ttft_count}\n'
            f"jserve_time_to_first_token_seconds_sum {ttft_count / 10}\n"
            f"jserve_time_to_first_token_seconds_count {ttft_count}\n")
    if spec is not None:
        for name, value in zip(("proposed_tokens", "accepted_tokens", "verify_rows"), spec):
            text += f"# TYPE jserve_spec_{name} gauge\njserve_spec_{name} {value}\n"
        text += "# TYPE jserve_spec_turned_down_steps gauge\njserve_spec_turned_down_steps 0.0\n"
    return text


_CLIENT = {"ttft_ms": {"mean": 100.0}, "total_input_tokens": 0, "input_tokens_exact": False,
           "total_output_tokens": 100, "completed": 2}


def test_compare_speculative_gauges():
    """The spec_* gauges' deltas over the run, the acceptance rate and mean accepted length, and their line."""
    before = server_metrics.parse_metrics(_metrics_text(2.0, (40.0, 20.0, 10.0)))
    after = server_metrics.parse_metrics(_metrics_text(4.0, (240.0, 170.0, 60.0)))
    a = server_metrics.compare(before, after, _CLIENT)
    assert (a["spec_proposed_tokens"], a["spec_accepted_tokens"], a["spec_verify_rows"]) == (200.0, 150.0, 50.0)
    assert a["spec_acceptance_rate"] == pytest.approx(0.75)
    assert a["spec_mean_accepted_length"] == pytest.approx(4.0)
    assert a["spec_verify_steps"] is None and a["spec_turned_down_steps"] == 0.0  # a gauge the server lacks: None
    table = server_metrics.format_agreement(a)
    assert "speculative decoding: 200 draft tokens proposed, 150 accepted (75.0%), mean accepted length 4.00" in table
    # exported but no speculation during the run (a jserve serving without it): no rates, no line
    a = server_metrics.compare(after, after, _CLIENT)
    assert a["spec_proposed_tokens"] == 0.0 and a["spec_acceptance_rate"] is None
    assert a["spec_mean_accepted_length"] is None
    assert "speculative" not in server_metrics.format_agreement(a)


def test_compare_without_speculative_gauges():
    before = server_metrics.parse_metrics(_metrics_text(2.0, None))
    after = server_metrics.parse_metrics(_metrics_text(4.0, None))
    assert not any(k.startswith("jserve_spec") for k in after)
    a = server_metrics.compare(before, after, _CLIENT)
    assert a["requests"]["server"] == 2.0
    for key in ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verify_rows", "spec_acceptance_rate",
                "spec_mean_accepted_length"):
        assert a[key] is None
    assert "speculative" not in server_metrics.format_agreement(a)


def test_compare_prefill_tokens_and_hits_by_tier():
    """Prompt tokens computed = computed tokens less one per decode (generated - requests), and
    the prefix-cache hits by tier, over the run."""
    def text(steps, computed, device, host):
        return (_metrics_text(steps, None) + f"# TYPE jserve_generation_tokens counter\n"
                f"jserve_generation_tokens_total {10 * steps}\n"
                f"# TYPE jserve_computed_tokens gauge\njserve_computed_tokens {computed}\n"
                f"# TYPE jserve_prefix_cache_hit_tokens_device gauge\njserve_prefix_cache_hit_tokens_device {device}\n"
                f"# TYPE jserve_prefix_cache_hit_tokens_host gauge\njserve_prefix_cache_hit_tokens_host {host}\n")
    before, after = (server_metrics.parse_metrics(text(*x)) for x in ((2.0, 50.0, 8.0, 0.0), (4.0, 450.0, 40.0, 16.0)))
    a = server_metrics.compare(before, after, _CLIENT)
    assert (a["generation_tokens"]["server"], a["requests"]["server"]) == (20.0, 2.0)
    assert a["prefill_tokens_computed"] == 400.0 - (20.0 - 2.0)
    assert (a["prefix_cache_hit_tokens_device"], a["prefix_cache_hit_tokens_host"]) == (32.0, 16.0)
    assert server_metrics.compare(*(server_metrics.parse_metrics(_metrics_text(s, None)) for s in (2.0, 4.0)),
                                  _CLIENT)["prefill_tokens_computed"] is None

"""The server's own view of a run: scrape Prometheus ``/metrics`` before and after, take deltas, and
set them beside the client's figures (TTFT, prompt and generated token counts).

Only jserve exports the ``jserve_*`` series; for any other server the scrape returns None and the
benchmark reports the client's figures alone.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

TTFT = "jserve_time_to_first_token_seconds"
PROMPT_TOKENS = "jserve_prompt_tokens_total"
GENERATION_TOKENS = "jserve_generation_tokens_total"
COMPILATIONS = "jserve_compilations_after_warmup"
# Speculative decoding's totals since start (gauges; 0 on a jserve without it, absent elsewhere).
SPEC_PROPOSED = "jserve_spec_proposed_tokens"
SPEC_ACCEPTED = "jserve_spec_accepted_tokens"
SPEC_VERIFY_ROWS = "jserve_spec_verify_rows"
_SPEC = (SPEC_PROPOSED, SPEC_ACCEPTED, SPEC_VERIFY_ROWS, "jserve_spec_verify_steps", "jserve_spec_turned_down_steps")
COMPUTED = "jserve_computed_tokens"
# Prefix-cache hits by tier: the device's cache, the host KV tier (--kv-offload-bytes).
_HITS = ("jserve_prefix_cache_hit_tokens_device", "jserve_prefix_cache_hit_tokens_host",
         "jserve_kv_reload_seconds", "jserve_kv_reload_host_seconds", "jserve_kv_reload_prefill_seconds_saved")
_KEEP = (f"{TTFT}_sum", f"{TTFT}_count", PROMPT_TOKENS, GENERATION_TOKENS, COMPILATIONS,
         "jserve_num_preemptions", "jserve_num_steps", "jserve_padded_token_fraction", *_SPEC, COMPUTED, *_HITS)


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition, by sample name (labelled ones are skipped)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = float(sample.value)
    return out


def metrics_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/metrics"


async def scrape(base_url: str, headers: dict | None = None, timeout: float = 10.0) -> dict[str, float] | None:
    """jserve's counters at ``base_url``/metrics, or None when the server exports none of them."""
    try:
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.get(metrics_url(base_url), headers=headers or {},
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        logger.info("no /metrics at %s: %s", base_url, e)
        return None
    try:
        values = parse_metrics(text)
    except ValueError:  # not Prometheus text (a server answering 200 with HTML, say)
        return None
    kept = {k: values[k] for k in _KEEP if k in values}
    return kept if f"{TTFT}_count" in kept else None


def _rel(client: float | None, server: float | None) -> float | None:
    """(client - server) / server."""
    if client is None or server is None or server == 0:
        return None
    return (client - server) / server


def compare(before: dict[str, float] | None, after: dict[str, float] | None, metrics: dict) -> dict | None:
    """The server's deltas over a run next to the client's ``metrics`` (from `report.compute_metrics`).

    Returns None when either scrape is missing. Token counts are the server's finished requests;
    the client counts only the requests it completed (failures make them differ). The ``spec_*``
    entries are speculative decoding's deltas over the run (None without the gauges) and
    ``spec_acceptance_rate`` = accepted / proposed, ``spec_mean_accepted_length`` = 1 + accepted /
    verified rows (None when nothing was proposed or verified).
    """
    if before is None or after is None:
        return None

    def delta(key: str) -> float | None:
        return after[key] - before.get(key, 0.0) if key in after else None

    n = delta(f"{TTFT}_count")
    ttft_sum = delta(f"{TTFT}_sum")
    server_ttft_ms = 1000 * ttft_sum / n if n and ttft_sum is not None else None
    client_ttft_ms = metrics["ttft_ms"]["mean"]
    prompt, generated = delta(PROMPT_TOKENS), delta(GENERATION_TOKENS)
    client_in = metrics["total_input_tokens"] if metrics.get("input_tokens_exact") else None
    client_out = metrics["total_output_tokens"]
    proposed, accepted, rows = delta(SPEC_PROPOSED), delta(SPEC_ACCEPTED), delta(SPEC_VERIFY_ROWS)
    return {
        "requests": {"server": n, "client": metrics["completed"]},
        "ttft_mean_ms": {"server": server_ttft_ms, "client": client_ttft_ms,
                         "rel_diff": _rel(client_ttft_ms, server_ttft_ms)},
        "prompt_tokens": {"server": prompt, "client": client_in, "rel_diff": _rel(client_in, prompt)},
        "generation_tokens": {"server": generated, "client": client_out, "rel_diff": _rel(client_out, generated)},
        "compilations_after_warmup": after.get(COMPILATIONS),
        "compilations_during_run": delta(COMPILATIONS),
        "steps_during_run": delta("jserve_num_steps"),
        "preemptions_during_run": delta("jserve_num_preemptions"),
        **{key.removeprefix("jserve_"): delta(key) for key in (*_SPEC, *_HITS)},
        # The prompts' tokens computed (not served by a cache): all computed less one per decode.
        "prefill_tokens_computed": (delta(COMPUTED) - (generated - n) if None not in (delta(COMPUTED), generated, n)
                                    else None),
        "spec_acceptance_rate": accepted / proposed if proposed and accepted is not None else None,
        "spec_mean_accepted_length": 1 + accepted / rows if rows and accepted is not None else None,
    }


def format_agreement(a: dict[str, Any]) -> str:
    """A few lines for the terminal table."""
    def num(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = ["server /metrics vs client:", f"  {'':<20}{'server':>12}{'client':>12}{'diff':>9}"]
    for key, spec in (("ttft_mean_ms", ".2f"), ("prompt_tokens", ".0f"), ("generation_tokens", ".0f")):
        row = a[key]
        diff = "-" if row["rel_diff"] is None else f"{100 * row['rel_diff']:+.1f}%"
        lines.append(f"  {key:<20}{num(row['server'], spec):>12}{num(row['client'], spec):>12}{diff:>9}")
    lines.append(f"  requests finished {num(a['requests']['server'], '.0f')}, completed "
                 f"{a['requests']['client']}; compilations after warm-up {num(a['compilations_after_warmup'], '.0f')}"
                 f" (this run: {num(a['compilations_during_run'], '.0f')})")
    if a.get("spec_proposed_tokens") or a.get("spec_turned_down_steps"):  # speculation ran or was turned down
        rate = a["spec_acceptance_rate"]
        lines.append(f"  speculative decoding: {num(a['spec_proposed_tokens'], '.0f')} draft tokens proposed, "
                     f"{num(a['spec_accepted_tokens'], '.0f')} accepted"
                     + ("" if rate is None else f" ({100 * rate:.1f}%)")
                     + f", mean accepted length {num(a['spec_mean_accepted_length'], '.2f')} over "
                     f"{num(a['spec_verify_rows'], '.0f')} verified rows; "
                     f"{num(a.get('spec_turned_down_steps'), '.0f')} steps turned down")
    return "\n".join(lines)

"""Online serving benchmark for any OpenAI-compatible server (`jserve bench`, `jserve bench ab`).

Drives ``/v1/completions`` or ``/v1/chat/completions`` with streaming requests (raw SSE over
aiohttp) at a fixed concurrency or with Poisson arrivals, and reports throughput, TTFT, TPOT,
inter-token and end-to-end latency, goodput under SLOs, the server's queue / prefill / decode split
(from jserve's usage block) and, against jserve, the server's own /metrics for the same run.

Modules: `workloads` (what to send), `client` (how it is sent and timed), `report` (figures and the
table), `server_metrics` (/metrics deltas), `plots` (PNG), `runs` (a load's flags and `run_benchmark`),
`server` (`ServerProcess`: a server started for a benchmark), `ab` (two servers in alternation), `cli`
(the command line).
"""

from jserve.bench.cli import main, parse_args
from jserve.bench.client import RequestRecord, endpoint_url, request_body, run_load, send_request
from jserve.bench.report import compute_metrics, format_table, percentile, summarize, table
from jserve.bench.runs import plan_runs, run_benchmark
from jserve.bench.server import ServerProcess, free_port
from jserve.bench.workloads import NAMED_WORKLOADS, WORKLOADS, RequestSpec, build_workload

__all__ = ["NAMED_WORKLOADS", "WORKLOADS", "RequestRecord", "RequestSpec", "ServerProcess", "build_workload",
           "compute_metrics", "endpoint_url", "format_table", "free_port", "main", "parse_args", "percentile",
           "plan_runs", "request_body", "run_benchmark", "run_load", "send_request", "summarize", "table"]

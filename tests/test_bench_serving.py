"""jserve.bench (`jserve bench`: its loads, workloads and metrics) against a fake OpenAI-compatible
SSE server on 127.0.0.1 (no model, no JAX); test_bench_servers runs `jserve bench ab` on it too."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys

import pytest
from aiohttp import web

import jserve.bench as bench
from jserve.bench import workloads

TTFT_S = 0.05  # the fake server's delay before the first token
TOKEN_S = 0.01  # and between tokens
QUEUE_MS, PREFILL_MS = 3.0, 7.0


def _fake_app(seen: list[dict], metrics: bool = False) -> web.Application:
    """Streams max_tokens chunks ("tok0 tok1 ..."), then a usage chunk with jserve's timing fields;
    ``metrics``: also a /metrics page whose totals (TTFT count, speculative gauges) follow the requests seen."""

    async def handle(request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        seen.append({"path": request.path, "body": body, "auth": request.headers.get("Authorization")})
        if chat:
            prompt = " ".join(m["content"] for m in body["messages"])
        else:
            prompt = body["prompt"]
        if "FAIL" in prompt:
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        n = int(body["max_tokens"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(TTFT_S)
        for i in range(n):
            if i:
                await asyncio.sleep(TOKEN_S)
            choice = ({"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None} if chat
                      else {"index": 0, "text": f"tok{i} ", "finish_reason": None})
            # split one event over two data lines sometimes, as SSE allows (joined with a newline)
            payload = json.dumps({"id": "x", "choices": [choice], "usage": None})
            if i % 2:
                payload = payload.replace(', "usage"', ',\ndata: "usage"')
            await resp.write(f"data: {payload}\n\n".encode())
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                 "total_tokens": len(prompt.split()) + n, "prompt_tokens_details": {"cached_tokens": 0},
                 "queue_ms": QUEUE_MS, "prefill_ms": PREFILL_MS, "decode_ms": round(TOKEN_S * 1000 * (n - 1), 3)}
        await resp.write(b": keep-alive comment\n\n")
        await resp.write(f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", lambda r: handle(r, chat=False))
    app.router.add_post("/v1/chat/completions", lambda r: handle(r, chat=True))
    app.router.add_get("/v1/models", lambda r: web.json_response({"object": "list", "data": [{"id": "fake-model"}]}))

    async def metrics_page(request: web.Request) -> web.Response:
        n = len(seen)  # each request: 8 drafts proposed, 6 accepted, over 3 verified rows
        return web.Response(text=(
            "# TYPE jserve_time_to_first_token_seconds histogram\n"
            f'jserve_time_to_first_token_seconds_bucket{{le="+Inf"}} {n}\n'
            f"jserve_time_to_first_token_seconds_sum {n * TTFT_S}\njserve_time_to_first_token_seconds_count {n}\n"
            f"# TYPE jserve_spec_proposed_tokens gauge\njserve_spec_proposed_tokens {8 * n}\n"
            f"# TYPE jserve_spec_accepted_tokens gauge\njserve_spec_accepted_tokens {6 * n}\n"
            f"# TYPE jserve_spec_verify_rows gauge\njserve_spec_verify_rows {3 * n}\n"
            "# TYPE jserve_other gauge\njserve_other 1.0\n"), content_type="text/plain")

    if metrics:
        app.router.add_get("/metrics", metrics_page)
    return app


async def _with_server(argv: list[str], model: str | None, metrics: bool = False,
                       quiet: bool = True) -> tuple[dict, list[dict]]:
    seen: list[dict] = []
    runner = web.AppRunner(_fake_app(seen, metrics))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        model_args = ["--model", model] if model else []  # None: the script asks /v1/models
        args = bench.parse_args(["--base-url", f"http://127.0.0.1:{port}", *model_args, *(["--quiet"] * quiet),
                                 *argv])
        result = await bench.run_benchmark(args)
    finally:
        await runner.cleanup()
    return result, seen


def run(argv: list[str], model: str | None = "fake", **kw) -> tuple[dict, list[dict]]:
    return asyncio.run(_with_server(argv, model, **kw))


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_concurrency_mode_counts_latencies_and_outputs(tmp_path):
    result, seen = run(["--workload", "short-short", "--scale", "0.25", "--num-requests", "8",
                        "--concurrency", "4", "--api-key", "sk-test", "--output-dir", str(tmp_path)])
    (run0,) = result["runs"]
    m = run0["metrics"]
    assert m["completed"] == 8 and m["failed"] == 0
    assert m["total_output_tokens"] == 8 * 8  # 32 * 0.25 tokens each, exact from usage
    assert m["total_input_tokens"] == 8 * 8 and m["input_tokens_exact"]
    # request bodies: streaming with usage, ignore_eos, exact max_tokens, bearer key
    assert len(seen) == 8 and all(s["path"] == "/v1/completions" for s in seen)
    b = seen[0]["body"]
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["ignore_eos"] is True and b["max_tokens"] == 8 and b["model"] == "fake"
    assert seen[0]["auth"] == "Bearer sk-test"
    # latencies roughly match the fake delays (generous upper bounds: shared CPUs)
    # Sleeps are never shorter than asked; upper bounds are loose because a loaded 2-core CI
    # machine can delay the fake server (a +20 ms bound failed once in a cold-cache CI run).
    assert TTFT_S * 1000 <= m["ttft_ms"]["median"] < TTFT_S * 1000 + 1000
    assert TOKEN_S * 1000 * 0.9 <= m["tpot_ms"]["median"] < TOKEN_S * 1000 + 200
    assert TOKEN_S * 1000 * 0.9 <= m["itl_ms"]["median"] < TOKEN_S * 1000 + 200
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = m[key]
        assert s["min"] <= s["median"] <= s["p90"] <= s["p99"] <= s["max"]
        assert s["min"] <= s["mean"] <= s["max"]
    assert m["e2e_ms"]["min"] >= (TTFT_S + 7 * TOKEN_S) * 1000 * 0.95
    # 8 requests, 4 at a time, ~0.12 s each: two waves
    assert 0.2 < m["duration_s"] < 20.0
    assert m["request_throughput"] == pytest.approx(8 / m["duration_s"])
    assert m["output_throughput"] == pytest.approx(64 / m["duration_s"])
    # server-side split from the usage block
    st = m["server_timing_ms"]
    assert st["queue_ms"]["mean"] == QUEUE_MS and st["prefill_ms"]["median"] == PREFILL_MS
    assert st["decode_ms"]["mean"] == pytest.approx(70.0)
    assert m["goodput"] is None
    # per-request records
    reqs = run0["requests"]
    assert len(reqs) == 8 and all(r["ok"] and r["output_tokens"] == 8 and len(r["itl"]) == 7 for r in reqs)
    # JSON written and parseable; plots written when matplotlib is around
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["runs"][0]["metrics"]["completed"] == 8 and len(saved["runs"][0]["requests"]) == 8
    assert "api_key" not in saved["config"]
    if _has_matplotlib():
        assert (tmp_path / "cdf_concurrency4.png").stat().st_size > 1000
    else:
        assert not list(tmp_path.glob("*.png"))


def test_concurrency_is_respected():
    """With concurrency 1 the requests run one after another: duration ~ the sum of their e2e latencies."""
    result, seen = run(["--workload", "short-short", "--scale", "0.125", "--num-requests", "3", "--concurrency", "1"],
                       model=None)
    assert {s["body"]["model"] for s in seen} == {"fake-model"}  # from GET /v1/models
    m = result["runs"][0]["metrics"]
    reqs = result["runs"][0]["requests"]
    starts = sorted(r["start"] for r in reqs)
    assert all(b - a >= (TTFT_S + 3 * TOKEN_S) * 0.95 for a, b in zip(starts, starts[1:]))
    assert m["duration_s"] >= 3 * (TTFT_S + 3 * TOKEN_S) * 0.95


def test_rate_mode_sweep_goodput_and_chat(tmp_path):
    result, seen = run(["--workload", "shared-prefix", "--endpoint", "chat", "--scale", "0.125",
                        "--num-requests", "6", "--sweep-rate", "20,inf", "--seed", "3",
                        "--slo-ttft-ms", "1000", "--slo-tpot-ms", "0.001", "--output-dir", str(tmp_path)])
    assert result["sweep"] == "request_rate" and len(result["runs"]) == 2
    assert [r["load"]["request_rate"] for r in result["runs"]] == [20.0, float("inf")]
    assert all(s["path"] == "/v1/chat/completions" for s in seen)
    systems = {s["body"]["messages"][0]["content"] for s in seen}
    assert len(systems) == 1 and seen[0]["body"]["messages"][0]["role"] == "system"  # shared prefix
    assert len({s["body"]["messages"][1]["content"] for s in seen[:6]}) > 1
    rated, burst = (r["metrics"] for r in result["runs"])
    for m in (rated, burst):
        assert m["completed"] == 6 and m["total_output_tokens"] == 6 * 4
        # an unattainable TPOT SLO: nobody is good
        assert m["good_requests"] == 0 and m["goodput"] == 0.0 and m["slo"] == {"ttft": 1000, "tpot": 0.001}
    # Poisson arrivals at 20/s are spread out (seeded), the 'inf' burst starts everything at once
    rated_starts = sorted(r["start"] for r in result["runs"][0]["requests"])
    burst_starts = sorted(r["start"] for r in result["runs"][1]["requests"])
    assert rated_starts[-1] > 0.05 and burst_starts[-1] < min(0.5, rated_starts[-1])
    saved = json.loads((tmp_path / "results.json").read_text())  # strict JSON (no Infinity)
    assert saved["runs"][1]["load"]["request_rate"] == "inf"
    if _has_matplotlib():
        assert (tmp_path / "sweep.png").is_file() and len(list(tmp_path.glob("cdf_*.png"))) == 2


def test_goodput_counts_requests_within_slos():
    result, _ = run(["--workload", "short-short", "--scale", "0.125", "--num-requests", "4", "--concurrency", "4",
                     "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000"])
    m = result["runs"][0]["metrics"]
    assert m["good_requests"] == 4 and m["slo_attainment"] == 1.0
    assert m["goodput"] == pytest.approx(m["request_throughput"])
    # the same records judged by a TTFT SLO below the fake server's TTFT: nobody passes
    recs = [bench.RequestRecord(**r) for r in result["runs"][0]["requests"]]
    m2 = bench.compute_metrics(recs, m["duration_s"], slo_ttft_ms=TTFT_S * 1000 / 2, slo_tpot_ms=None)
    assert m2["good_requests"] == 0


def test_jsonl_replay_and_failures(tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "one two three", "max_tokens": 5},
        {"input_len": 10, "output_len": 2},
        {"prompt": "this will FAIL", "max_tokens": 3},
        {"prompt": "single", "max_tokens": 1},
    ]) + "\n")
    result, seen = run(["--workload", str(path), "--concurrency", "2", "--output-dir", str(tmp_path / "out"),
                        "--no-plots"])
    m = result["runs"][0]["metrics"]
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_output_tokens"] == 5 + 2 + 1
    assert m["total_input_tokens"] == 3 + 10 + 1  # the fake server counts words
    assert list(m["errors"].values()) == [1] and "HTTP 500" in next(iter(m["errors"]))
    by_index = {r["index"]: r for r in result["runs"][0]["requests"]}
    assert by_index[2]["ok"] is False and by_index[2]["status"] == 500
    assert by_index[3]["tpot"] is None and by_index[3]["ok"]  # one token: no TPOT
    assert m["tpot_ms"]["median"] is not None  # from the other two
    assert sorted(s["body"]["max_tokens"] for s in seen) == [1, 2, 3, 5]
    assert not list((tmp_path / "out").glob("*.png"))
    # --num-requests larger than the file cycles it
    result, seen = run(["--workload", str(path), "--num-requests", "6", "--concurrency", "6"])
    assert result["runs"][0]["metrics"]["completed"] == 5 and len(seen) == 6  # records 0,1,2(FAIL),3,0,1


def test_workloads_are_seeded_and_scaled():
    a = bench.build_workload("mix", 8, "completions", 0.5, seed=1)
    b = bench.build_workload("mix", 8, "completions", 0.5, seed=1)
    c = bench.build_workload("mix", 8, "completions", 0.5, seed=2)
    assert [s.prompt for s in a] == [s.prompt for s in b] != [s.prompt for s in c]
    assert sorted(s.kind for s in a) == sorted(list(bench.WORKLOADS) * 2)  # the four, evenly
    for s in a:
        in_len, out_len = (round(x * 0.5) for x in bench.WORKLOADS[s.kind])
        assert len(s.prompt.split()) == in_len and s.max_tokens == out_len
    chat = bench.build_workload("long-short", 2, "chat", 1.0, seed=0)
    assert chat[0].prompt is None and chat[0].messages[0]["role"] == "user"
    assert bench.endpoint_url("http://h:1/v1/", "chat") == "http://h:1/v1/chat/completions"
    assert bench.endpoint_url("http://h:1", "completions") == "http://h:1/v1/completions"


def _sentences_of(text: str) -> list[str]:
    """``text`` as the workload sentences it is made of (StopIteration: it is not)."""
    out = []
    while text:
        out.append(next(s for s in workloads._SENTENCES if text.startswith(s)))
        text = text[len(out[-1]):].removeprefix(" ")
    return out


def _copied_text(spec: bench.RequestSpec) -> str:
    """The passage a copy-workload request asks to repeat (or to fix), checking the instruction around it."""
    if spec.messages is not None:
        assert spec.prompt is None and [m["role"] for m in spec.messages] == ["user"]
        instruction, text = spec.messages[0]["content"].split("\n\n", 1)
        assert instruction == {"copy": "Repeat the following text exactly:", "edit": "Fix the typos in the "
                               "following text and return the full corrected text:"}[spec.kind]
        return text
    label, rest = spec.prompt.split("\n", 1)
    text, tail = rest.split("\n\n", 1)
    assert (label, tail.split("\n")[0]) == {"copy": ("Original:", "Exact copy:"),
                                             "edit": ("Draft (with typos):", "Final version (typos fixed):")}[spec.kind]
    head = tail.split("\n", 1)[1]  # the copy has begun: the passage's first words
    assert len(head.split()) == 4 and text.startswith(head + " ")
    return text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_copy_workload_asks_to_repeat_its_passage(endpoint):
    a = bench.build_workload("copy", 8, endpoint, 1.0, seed=1)
    assert a == bench.build_workload("copy", 8, endpoint, 1.0, seed=1)
    assert [_copied_text(s) for s in a] != [_copied_text(s) for s in bench.build_workload("copy", 8, endpoint, 1.0, 2)]
    assert sorted(s.kind for s in a) == ["copy"] * 4 + ["edit"] * 4
    vocabulary = {w for s in workloads._SENTENCES for w in s.split()}
    for s in a:
        text = _copied_text(s)
        assert s.max_tokens == workloads.COPY_OUT == 192
        # about as long as the output: the model copies until max_tokens (SmolLM2: ~1.1 tokens a word)
        assert s.max_tokens + 16 <= 1.1 * len(text.split()) <= s.max_tokens + 16 + 25
        assert s.input_len == len((s.prompt or s.messages[0]["content"]).split())
        if s.kind == "copy":
            assert len(_sentences_of(text)) >= 8
        else:  # a few words with two letters swapped, the rest as written
            typos = [w for w in text.split() if w not in vocabulary]
            assert len(typos) == 3  # one per 64 output tokens
            assert all(any(sorted(t) == sorted(w) for w in vocabulary if len(w) == len(t)) for t in typos)
    # --scale and --num-requests
    assert len(bench.build_workload("copy", None, endpoint, 1.0, 0)) == 64
    for scale in (0.25, 3.0):  # 3.0: longer than all the sentences, which then repeat in a new order
        (s,) = bench.build_workload("copy", 1, endpoint, scale, seed=0)
        assert s.max_tokens == round(192 * scale)
        assert s.max_tokens + 16 <= 1.1 * len(_copied_text(s).split()) <= s.max_tokens + 16 + 25


def test_copy_workload_run_reports_speculation(capsys):
    """`--workload copy` against a server with jserve's speculative gauges: the run's acceptance figures."""
    result, seen = run(["--workload", "copy", "--endpoint", "chat", "--scale", "0.05", "--num-requests", "4",
                        "--concurrency", "2"], metrics=True, quiet=False)
    assert len(seen) == 4 and all(s["path"] == "/v1/chat/completions" for s in seen)
    assert sorted(s["body"]["max_tokens"] for s in seen) == [10] * 4
    a = result["runs"][0]["metrics"]["server_metrics"]
    assert a["requests"]["server"] == 4
    assert (a["spec_proposed_tokens"], a["spec_accepted_tokens"], a["spec_verify_rows"]) == (32.0, 24.0, 12.0)
    assert a["spec_acceptance_rate"] == pytest.approx(0.75) and a["spec_mean_accepted_length"] == pytest.approx(3.0)
    assert a["spec_verify_steps"] is None  # not exported by this server
    out = capsys.readouterr().out
    assert "speculative decoding: 32 draft tokens proposed, 24 accepted (75.0%), mean accepted length 3.00" in out


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert bench.percentile(xs, 50) == 3.0
    assert bench.percentile(xs, 90) == pytest.approx(4.6)
    assert bench.percentile(xs, 100) == 5.0 and bench.percentile([], 50) is None


def test_timeout_and_connection_errors_are_failures():
    async def go():
        async def slow(request):
            await asyncio.sleep(1.0)  # past the client's 0.2 s timeout; cleanup waits for it
            return web.Response()

        app = web.Application()
        app.router.add_post("/v1/completions", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            args = bench.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--quiet",
                                     "--workload", "short-short", "--num-requests", "2", "--concurrency", "2",
                                     "--request-timeout", "0.2"])
            return await bench.run_benchmark(args)
        finally:
            await runner.cleanup()

    m = asyncio.run(go())["runs"][0]["metrics"]
    assert m["completed"] == 0 and m["failed"] == 2 and "timeout" in next(iter(m["errors"]))
    assert m["ttft_ms"]["mean"] is None
    # nothing listening: a connection error, not a hang
    args = bench.parse_args(["--base-url", "http://127.0.0.1:9", "--model", "m", "--quiet",
                             "--workload", "short-short", "--num-requests", "1", "--request-timeout", "2"])
    m = asyncio.run(bench.run_benchmark(args))["runs"][0]["metrics"]
    assert m["failed"] == 1


def test_format_table_mentions_the_numbers():
    recs = [bench.RequestRecord(0, "x", 4, 4, ok=True, ttft=0.05, e2e=0.08, tpot=0.01, itl=[0.01] * 3,
                                prompt_tokens=4, output_tokens=4, queue_ms=1.0, prefill_ms=2.0, decode_ms=30.0)]
    m = bench.compute_metrics(recs, 1.0, 100.0, None)
    table = bench.format_table("concurrency=1", m)
    for needle in ("Completed requests:", "TTFT", "TPOT", "ITL", "E2E", "Goodput", "queue_ms", "50.00"):
        assert needle in table


def test_runs_without_matplotlib(tmp_path, monkeypatch, capsys):
    """matplotlib is optional (the `bench` extra): JSON is still written, plots skipped with a message."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    result, _ = run(["--workload", "short-short", "--scale", "0.125", "--num-requests", "2",
                     "--sweep-concurrency", "1,2", "--output-dir", str(tmp_path)])
    assert result["plots"] == [] and (tmp_path / "results.json").is_file()
    assert not list(tmp_path.glob("*.png"))
    assert "matplotlib is not installed" in capsys.readouterr().err


class _FakeServer:
    """A context manager serving _fake_app on a thread's event loop, as `jserve bench ab` would
    start a server; `delay` slows its first token (a slower server)."""

    def __init__(self, flags: str, timeout: float = 0.0):
        import threading

        self.flags, self.delay = flags, float(flags.split("=")[1]) if "=" in flags else TTFT_S
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        _FakeServer.started.append(flags)

    async def _start(self):
        seen: list[dict] = []
        self.runner = web.AppRunner(_fake_app(seen, metrics=True))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def __enter__(self):
        global TTFT_S
        self.thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"
        self.saved, TTFT_S = TTFT_S, self.delay  # read by the handler as it streams
        return self

    def __exit__(self, *exc):
        global TTFT_S
        TTFT_S = self.saved
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.parametrize("assignment", ["round-robin", "random"])
def test_lora_modules_name_each_requests_model(assignment, tmp_path):
    """--lora-modules: each request's body names one adapter (in turn, or at random with --seed), no
    GET /v1/models is needed, and the run's JSON counts the requests per model."""
    argv = ["--workload", "short-short", "--scale", "0.125", "--num-requests", "12", "--concurrency", "3",
            "--lora-modules", "a", "b", "c", "--lora-assignment", assignment, "--seed", "5",
            "--output-dir", str(tmp_path), "--no-plots"]
    result, seen = run(argv, model=None)
    specs = workloads.build_workload("short-short", 12, "completions", 0.125, 5)
    index = {s.prompt: i for i, s in enumerate(specs)}
    assert len(index) == 12 and len(seen) == 12 and all(s["path"] == "/v1/completions" for s in seen)
    sent = {index[s["body"]["prompt"]]: s["body"]["model"] for s in seen}
    if assignment == "round-robin":
        want = [("a", "b", "c")[i % 3] for i in range(12)]
    else:
        want = bench.client.request_models(bench.parse_args(argv), 12)
        assert want == bench.client.request_models(bench.parse_args(argv), 12)  # seeded
        assert want != bench.client.request_models(bench.parse_args([*argv, "--seed", "6"]), 12)
        assert set(want) <= {"a", "b", "c"} and len(set(want)) > 1
    assert [sent[i] for i in range(12)] == want
    (run0,) = result["runs"]
    assert [r["model"] for r in run0["requests"]] == want
    counts = {m: {"requests": want.count(m), "failed": 0} for m in sorted(set(want))}
    assert run0["models"] == counts
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["runs"][0]["models"] == counts and saved["config"]["lora_modules"] == ["a", "b", "c"]


def test_without_lora_modules_every_request_names_the_model():
    result, seen = run(["--workload", "short-short", "--scale", "0.125", "--num-requests", "3", "--concurrency", "3"])
    assert [s["body"]["model"] for s in seen] == ["fake"] * 3
    assert result["runs"][0]["models"] == {"fake": {"requests": 3, "failed": 0}}

"""Starting and comparing servers: `ServerProcess` against a stand-in process, `jserve bench ab`
against test_bench_serving's fake server, and benchmarks.serving.compare's table."""

from __future__ import annotations

import json
import math
import sys

import pytest

import jserve.bench as bench
from test_bench_serving import _FakeServer


def test_compare_servers_table_and_ratios():
    """benchmarks.serving.compare's table from fake results (the benchmark itself starts real servers)."""
    from benchmarks.serving import compare as cs

    def metrics(out_tok_s, ttft_p99):
        return {"output_throughput": out_tok_s, "total_token_throughput": 2 * out_tok_s, "completed": 4, "failed": 0,
                "ttft_ms": {"median": 10.0, "p99": ttft_p99}, "tpot_ms": {"median": 5.0}}

    results = [{"server": "jserve", "label": "jserve (fp32)", "runs": {"concurrent": metrics(300.0, 900.0),
                                                                        "single": metrics(50.0, 20.0)}},
               {"server": "llamacpp-f32", "label": "llama.cpp F32", "runs": {"concurrent": metrics(200.0, 800.0),
                                                                              "single": metrics(60.0, 15.0)}},
               {"server": "jserve-int4", "label": "jserve int4", "runs": {"concurrent": metrics(100.0, 5000.0)}},
               {"server": "llamacpp-q", "label": "llama.cpp Q4_1", "error": "boom"}]
    rows = cs.comparison(results)
    assert [(r["server"], r["run"]) for r in rows] == [("jserve", "concurrent"), ("jserve", "single"),
                                                       ("llamacpp-f32", "concurrent"), ("llamacpp-f32", "single"),
                                                       ("jserve-int4", "concurrent")]
    assert rows[0]["vs_llamacpp_f32"] == pytest.approx(1.5) and rows[0]["vs_peer"] == pytest.approx(1.5)
    assert rows[1]["vs_llamacpp_f32"] == pytest.approx(50 / 60)
    assert rows[4]["vs_llamacpp_f32"] == pytest.approx(0.5) and rows[4]["vs_peer"] is None  # its peer failed
    assert rows[0]["ttft_p99_ms"] == 900.0 and rows[0]["total_tok_s"] == 600.0
    table = cs.format_table(rows, "title")
    assert table.splitlines()[0] == "title" and "1.50" in table and "0.50" in table and "llama.cpp F32" in table
    args = cs.parse_args(["--servers", "jserve,llamacpp-q", "--num-requests", "4"])
    assert args.servers == ["jserve", "llamacpp-q"] and args.concurrency == 16
    with pytest.raises(SystemExit):
        cs.parse_args(["--servers", "vllm"])


def test_compare_servers_model_option(tmp_path, monkeypatch):
    """compare --model: the default model's commands as before; another named model's GGUF for
    llama.cpp and `--model NAME` for jserve."""
    from benchmarks.serving import compare as cs

    monkeypatch.setattr(cs, "ensure_llama_cpp", lambda cache: tmp_path / "bin")
    monkeypatch.setattr(cs, "model_gguf", lambda model: tmp_path / f"{model}.gguf")

    default = cs.parse_args([])
    assert default.model == "smollm2-135m-instruct" and default.servers == list(cs.SERVERS)
    cmd, _ = cs.server_command("jserve", default, 8190)
    assert "--model" not in cmd and cmd[cmd.index("--served-model-name") + 1] == "smollm2"
    assert cs.labels(default.model) == cs.LABELS

    args = cs.parse_args(["--model", "gemma3-270m", "--cache-dir", str(tmp_path)])
    cmd, _ = cs.server_command("jserve", args, 8190)
    assert cmd[cmd.index("--model") + 1] == "gemma3-270m" and cmd[cmd.index("--served-model-name") + 1] == "gemma3-270m"
    cmd, _ = cs.server_command("llamacpp-q", args, 8190)
    assert cmd[0] == str(tmp_path / "bin" / "llama-server")
    assert cmd[cmd.index("-m") + 1] == str(tmp_path / "gemma3-270m.gguf")
    assert cmd[cmd.index("-a") + 1] == "gemma3-270m"
    assert cs.labels("gemma3-270m")["llamacpp-q"] == "llama.cpp Q4_K_M"
    with pytest.raises(ValueError, match="unknown server"):
        cs.server_command("hf", args, 8190)


def test_bench_ab_alternates_two_servers_and_takes_b_over_a(tmp_path, capsys):
    from jserve.bench.ab import parse_ab_args, run_ab

    _FakeServer.started = []
    args = parse_ab_args(["--a", "--fake ttft=0.02", "--b", "--fake ttft=0.2", "--rounds", "3", "--workload",
                          "short-short", "--scale", "0.125", "--num-requests", "2", "--model", "fake",
                          "--output-dir", str(tmp_path)])
    result = run_ab(args, serve=_FakeServer)
    # one server up at a time, for its turn, in the order A B, B A, A B
    fast, slow = "--fake ttft=0.02", "--fake ttft=0.2"
    assert _FakeServer.started == [fast, slow, slow, fast, fast, slow]
    assert [(r["round"], r["server"]) for r in result["rows"]] == [(0, "A"), (0, "B"), (1, "B"), (1, "A"),
                                                                   (2, "A"), (2, "B")]
    assert all(r["completed"] == 2 and r["failed"] == 0 for r in result["rows"])
    a, b = result["median"]["A"], result["median"]["B"]
    assert a["ttft_p50_ms"] >= 20 and b["ttft_p50_ms"] >= 200 and b["ttft_p50_ms"] > a["ttft_p50_ms"]
    assert result["b_over_a"]["ttft_p50_ms"] == pytest.approx(b["ttft_p50_ms"] / a["ttft_p50_ms"])
    assert result["b_over_a"]["output_tok_s"] < 1  # the slower first token costs B throughput
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert saved["b_over_a"] == pytest.approx(result["b_over_a"]) and len(saved["rows"]) == 6
    out = capsys.readouterr().out
    assert "B/A" in out and "median" in out


def test_bench_ab_command_line():
    from jserve.cli import build_parser

    args = build_parser().parse_args(["bench", "ab", "--a", "--max-num-seqs 8", "--b=--enforce-eager", "--rounds", "2",
                                      "--workload", "mix", "--concurrency", "4"])
    assert (args.a, args.b, args.rounds, args.workload, args.concurrency) == ("--max-num-seqs 8", "--enforce-eager",
                                                                               2, "mix", 4)
    plain = build_parser().parse_args(["bench", "--workload", "mix"])  # `jserve bench` alone: one load, as before
    assert plain.bench_mode is None and plain.func is not args.func


_STAND_IN = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ok" if self.path == "/health" else b"# TYPE jserve_num_steps gauge\njserve_num_steps 7.0\n"
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        print("served", self.path, flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_process_waits_for_health_scrapes_and_stops(tmp_path):
    server = bench.ServerProcess(command=[sys.executable, "-c", _STAND_IN, "{port}"], log=tmp_path / "log")
    with server:
        assert server.startup_s is not None and server.url == f"http://127.0.0.1:{server.port}"
        assert server.metrics() == {"jserve_num_steps": 7.0}
        assert server.metric("jserve_num_steps") == 7.0 and math.isnan(server.metric("jserve_absent"))
        assert server.proc.poll() is None
    assert server.proc.poll() is not None  # stopped at the block's end
    assert "served /health" in (tmp_path / "log").read_text()


def test_server_process_reports_a_server_that_dies(tmp_path):
    server = bench.ServerProcess(command=[sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                                 log=tmp_path / "log")
    with pytest.raises(RuntimeError, match="exited with status 3") as e:
        server.start()
    assert "no model here" in str(e.value)


def test_versus_llamacpp_alternates_servers_and_takes_medians(tmp_path, monkeypatch):
    from benchmarks.serving import versus_llamacpp as versus

    monkeypatch.setattr(versus, "gguf_file", lambda precision, cache: tmp_path / f"m.{precision}.gguf")
    args = versus.argparse.Namespace(cache_dir=tmp_path, concurrency=16, jserve_arg=[], llama_ctx=16384, threads=2)
    assert versus.server_command("jserve", "F32", args)[-4:] == ["--max-num-seqs", "16", "--served-model-name",
                                                                 "smollm2"]
    assert versus.server_command("jserve", "Q4_1", args)[-4:] == ["--quantization", "gguf", "--quality-gate", "warn"]
    assert str(tmp_path / "m.Q8_0.gguf") in versus.server_command("llama.cpp", "Q8_0", args)
    calls = []
    speed = {("jserve", "ready"): 10.0, ("jserve", "steady"): 20.0, ("llama.cpp", "ready"): 16.0}

    def fake_run(server, precision, round_, args):
        calls.append((round_, precision, server))
        phases = ("ready", "steady") if server == "jserve" else ("ready",)
        return [{"round": round_, "precision": precision, "server": server, "phase": phase, "load_avg": [0, 0],
                 "c1_tok_s": speed[(server, phase)] + round_, "c16_tok_s": 10 * speed[(server, phase)],
                 "c1_ttft_ms": 50.0} for phase in phases]

    monkeypatch.setattr(versus, "run", fake_run)
    out = tmp_path / "v.json"
    assert versus.main(["--rounds", "2", "--precisions", "F32", "Q4_1", "--out", str(out)]) == 0
    assert calls == [(0, "F32", "llama.cpp"), (0, "F32", "jserve"), (0, "Q4_1", "jserve"), (0, "Q4_1", "llama.cpp"),
                     (1, "F32", "jserve"), (1, "F32", "llama.cpp"), (1, "Q4_1", "llama.cpp"), (1, "Q4_1", "jserve")]
    rows = json.loads(out.read_text())["rows"]
    assert [r["precision"] for r in rows] == ["F32", "Q4_1"]
    assert rows[0]["c1 jserve steady"] == 20.5 and rows[0]["c1 llama.cpp"] == 16.5
    assert rows[0]["c1 steady/llama"] == round(20.5 / 16.5, 2) and rows[0]["c16 ready/steady"] == 0.5

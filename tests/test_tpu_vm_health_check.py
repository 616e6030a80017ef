"""scripts/tpu_vm/health_check.sh against a stand-in HTTP server on 127.0.0.1 (waits, keys, models,
failures); the other TPU VM scripts: tests/test_tpu_vm_scripts.py."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "scripts" / "tpu_vm"


class _StandIn(BaseHTTPRequestHandler):
    """/health: 503 for the first `warmup` polls, then 200; the API wants Bearer `key`."""
    warmup, key, polls, bodies = 2, "k3y", 0, []

    def log_message(self, *args):
        pass

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self):
        return self.headers.get("Authorization") == f"Bearer {self.key}"

    def do_GET(self):
        cls = type(self)
        if self.path == "/health":
            cls.polls += 1
            return self._send(200, {"status": "ok"}) if cls.polls > cls.warmup else \
                self._send(503, {"status": "warming_up"})
        if self.path == "/v1/models":
            if not self._authorized():
                return self._send(401, {"error": {"message": "bad key"}})
            return self._send(200, {"object": "list", "data": [{"id": "my-model", "object": "model"}]})
        self._send(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if self.path != "/v1/completions" or not self._authorized():
            return self._send(401, {"error": {"message": "bad key"}})
        if body.get("model") != "my-model":
            return self._send(404, {"error": {"message": "no such model"}})
        self._send(200, {"choices": [{"text": " world", "index": 0}], "usage": {"completion_tokens": 1}})


@pytest.fixture
def stand_in():
    handler = type("Handler", (_StandIn,), {"polls": 0, "bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def _health(url, *args, key=None):
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k != "JSERVE_API_KEY"}
    if key is not None:
        env["JSERVE_API_KEY"] = key
    return subprocess.run(["bash", str(SCRIPTS_DIR / "health_check.sh"), "--url", url, "--interval", "0.1", *args],
                          env=env, capture_output=True, text=True, timeout=60)


needs_curl = pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v curl"], capture_output=True).returncode,
                                reason="needs curl")


@needs_curl
def test_health_check_waits_then_completes(stand_in):
    url, handler = stand_in
    p = _health(url, "--timeout", "30", key="k3y")
    assert p.returncode == 0, p.stderr
    assert handler.polls == 3 and "ok: model my-model" in p.stdout
    assert handler.bodies == [{"model": "my-model", "prompt": "Hello", "max_tokens": 1, "temperature": 0}]


@needs_curl
def test_health_check_key_from_env_file_and_explicit_model(stand_in, tmp_path):
    url, handler = stand_in
    env_file = tmp_path / "env"
    env_file.write_text("# jserve\nJSERVE_API_KEY=k3y\n")
    p = _health(url, "--env-file", str(env_file), "--model", "my-model", "--prompt", "Hi")
    assert p.returncode == 0, p.stderr
    assert handler.bodies[-1]["prompt"] == "Hi"


@needs_curl
def test_health_check_fails_on_wrong_key_and_on_timeout(stand_in):
    url, handler = stand_in
    p = _health(url, key="wrong")
    assert p.returncode == 1 and "401" in p.stderr
    handler.warmup = 10**9
    p = _health(url, "--timeout", "1", key="k3y")
    assert p.returncode == 1 and "did not answer 200" in p.stderr and "503" in p.stderr


@needs_curl
def test_health_check_fails_when_nothing_listens():
    p = _health("http://127.0.0.1:9", "--timeout", "0", key="k3y")
    assert p.returncode == 1 and "did not answer 200" in p.stderr

"""A server under benchmark as a context manager: `jserve serve FLAGS` (or any command) on a free
loopback port, waited for until GET /health answers 200, its /metrics scraped, stopped on exit
(SIGTERM, then SIGKILL). What `jserve bench ab` and the benchmarks/ package start servers with."""

from __future__ import annotations

import json
import math
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def is_warming(url: str) -> bool:
    """Whether the server at `url` is not yet at full speed: /health 503 (loading), or 200 with
    {"warming": true} (jserve compiling its smaller buckets). Any other answer, or none, is warm
    (a server without the route or that flag; one that is down fails the load instead)."""
    try:
        body = get(url.rstrip("/") + "/health", timeout=5)
    except urllib.error.HTTPError as e:
        return e.code == 503
    except OSError:
        return False
    try:
        return isinstance(parsed := json.loads(body), dict) and bool(parsed.get("warming"))
    except ValueError:
        return False


def wait_warm(url: str, timeout: float = 600.0, poll: float = 0.5,
              alive: Callable[[], bool] = lambda: True) -> tuple[float, bool]:
    """Wait until `url` is warm (`is_warming`), at most `timeout` seconds or while `alive()`:
    (seconds waited, whether warm)."""
    t0 = time.monotonic()
    while is_warming(url):
        if time.monotonic() - t0 >= timeout or not alive():
            return time.monotonic() - t0, False
        time.sleep(poll)
    return time.monotonic() - t0, True


class ServerProcess:
    """`jserve serve --port PORT *flags` (or `command`, whose "{port}" is filled in) in a child
    process; `with ServerProcess(...) as server:` returns once `server.url`/health answers 200
    (`startup_s` says after how long) and, unless `wait_warm` is None, once it is warm (`wait_warm`:
    at most that many seconds more; `warmup_s` how long, `warm` whether it is), and stops the server
    when the block ends. Its output goes to `log` (default: a temporary file, named in the error when
    the server dies before it is up)."""

    def __init__(self, flags: Sequence[str] | str = (), *, command: Sequence[str] | None = None,
                 env: dict[str, str] | None = None, log: str | Path | None = None, timeout: float = 1800.0,
                 port: int | None = None, wait_warm: float | None = 600.0):
        self.flags = shlex.split(flags) if isinstance(flags, str) else list(flags)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if command is None:
            command = [sys.executable, "-m", "jserve.cli", "serve", "--port", "{port}", *self.flags]
        self.command = [c.replace("{port}", str(self.port)) for c in command]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log = Path(log) if log else Path(tempfile.mkstemp(prefix="jserve-server-", suffix=".log")[1])
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.wait_warm = wait_warm
        self.warmup_s: float | None = None  # waited after ready until warm (None: did not wait)
        self.warm: bool | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> ServerProcess:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        t0 = time.monotonic()
        while True:
            try:
                get(self.url + "/health", timeout=5)
                self.startup_s = time.monotonic() - t0
                if self.wait_warm is not None:
                    self.warmup_s, self.warm = wait_warm(self.url, self.wait_warm,
                                                         alive=lambda: self.proc.poll() is None)
                return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() - t0 > self.timeout:
                why = (f"exited with status {self.proc.returncode}" if self.proc.poll() is not None
                       else f"not healthy after {self.timeout:.0f} s")
                self.stop()
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{shlex.join(self.command)} {why}; {self.log} ends:\n{tail}")
            time.sleep(0.25)

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of GET /metrics, by name."""
        from jserve.bench.server_metrics import parse_metrics

        return parse_metrics(get(self.url + "/metrics"))

    def metric(self, name: str) -> float:
        """One sample of /metrics (nan when the server does not export it)."""
        return self.metrics().get(name, math.nan)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

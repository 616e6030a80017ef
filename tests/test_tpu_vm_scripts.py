"""The Cloud TPU VM scripts (scripts/tpu_vm/) and guide (docs/tpu_vm.md), checked without a cloud.

Fast and offline: bash syntax, `set -euo pipefail`, usage text on -h, the exact `gcloud` command
lines (a fake `gcloud` first on PATH records them; the real one is never called), and every
`jserve <subcommand>` command line of the guide and the scripts parsed by jserve's own argparse
parser. The health check: tests/test_tpu_vm_health_check.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = ROOT / "scripts" / "tpu_vm"
DOC = ROOT / "docs" / "tpu_vm.md"
SCRIPTS = sorted(p for p in SCRIPTS_DIR.glob("*.sh") if not p.name.startswith("_"))  # _common.sh: sourced
EXPECTED = {"create_vm.sh", "install.sh", "deploy.sh", "setup_service.sh", "health_check.sh", "delete_vm.sh",
            "smoke.sh"}

# Flags of issue #7 (--mesh, --distributed, ...) were added while this guide was written; they
# have all landed, so every flag in the guide and scripts must parse. The empty sets keep the hook
# for a future guide written ahead of its flags.
FLAGS_BEING_ADDED: set[str] = set()  # all landed: every flag in the guide must now parse
FLAGS_BEING_ADDED_WITHOUT_VALUE: set[str] = set()

# Values for shell/systemd variables in the command lines.
VARIABLES = {
    "JSERVE_MODEL": "my-model", "JSERVE_HOST": "0.0.0.0", "JSERVE_PORT": "8000",
    "JSERVE_API_KEY": "k3y", "JSERVE_ARGS": "--mesh tp=4 --distributed --max-model-len 8192",
}
SUBCOMMANDS = ("serve", "generate", "convert", "plan")


def test_all_scripts_exist():
    assert {p.name for p in SCRIPTS} == EXPECTED
    assert all(". \"$(dirname \"${BASH_SOURCE[0]}\")/_common.sh\"" in p.read_text() for p in SCRIPTS)
    assert (SCRIPTS_DIR / "jserve.service").is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_syntax_strict_mode_and_executable(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert re.search(r"^set -euo pipefail$", text, re.M), "missing `set -euo pipefail`"
    assert os.stat(script).st_mode & stat.S_IXUSR, "not executable"


# ------------------------------------------------------------------------------ fake gcloud

FAKE_GCLOUD = r'''#!{python}
"""Records its arguments as one JSON line; answers the few queries the scripts make."""
import json, os, stat, sys
args = sys.argv[1:]
record = {{"args": args}}
if args[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    # what deploy.sh uploads: file names and modes of the staged folder
    for a in args:
        if os.path.isdir(a):
            record["staged"] = {{n: oct(stat.S_IMODE(os.stat(os.path.join(a, n)).st_mode))
                                 for n in sorted(os.listdir(a))}}
            key = os.path.join(a, "api_key")
            if os.path.exists(key):
                record["api_key"] = open(key).read()
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(record) + "\n")
if args[:4] == ["compute", "tpus", "queued-resources", "describe"]:
    print("ACTIVE")
'''


@pytest.fixture
def fake_gcloud(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    gcloud = bindir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
    gcloud.chmod(0o755)
    log = tmp_path / "gcloud.jsonl"
    env = {k: v for k, v in os.environ.items()
           if k not in ("TPU_NAME", "ZONE", "PROJECT_ID", "ACCELERATOR_TYPE", "RUNTIME_VERSION", "JSERVE_API_KEY")}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", FAKE_GCLOUD_LOG=str(log))

    def run(script, *args, extra_env=None, check=True):
        p = subprocess.run(["bash", str(SCRIPTS_DIR / script), *args], env={**env, **(extra_env or {})},
                           capture_output=True, text=True, timeout=60)
        if check:
            assert p.returncode == 0, p.stderr
        return p

    def calls():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    run.calls = calls
    return run


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_without_calling_gcloud(fake_gcloud, script):
    for flag in ("-h", "--help"):
        p = fake_gcloud(script.name, flag)
        assert p.stdout.startswith("usage: "), p.stdout
    assert fake_gcloud.calls() == []


@pytest.mark.parametrize("script", ["create_vm.sh", "deploy.sh", "delete_vm.sh"])
def test_missing_required_flags_fail_without_calling_gcloud(fake_gcloud, script):
    p = fake_gcloud(script, "--zone", "us-east5-b", check=False)
    assert p.returncode == 2 and "--name is required" in p.stderr
    p = fake_gcloud(script, "--name", "x", "--bogus", check=False)
    assert p.returncode == 2 and "unknown argument: --bogus" in p.stderr
    assert fake_gcloud.calls() == []


def test_create_vm_single_host(fake_gcloud):
    fake_gcloud("create_vm.sh", "--name", "my-tpu", "--zone", "us-east5-b", "--accelerator-type", "v6e-8",
                "--version", "v2-alpha-tpuv6e")
    [call] = fake_gcloud.calls()
    assert call["args"] == ["compute", "tpus", "tpu-vm", "create", "my-tpu", "--zone=us-east5-b",
                            "--accelerator-type=v6e-8", "--version=v2-alpha-tpuv6e", "--tags=jserve"]


@pytest.mark.parametrize("accel,version", [("v6e-8", "v2-alpha-tpuv6e"), ("v5litepod-8", "v2-alpha-tpuv5-lite"),
                                           ("v5p-8", "v2-alpha-tpuv5"), ("v4-8", "tpu-ubuntu2204-base")])
def test_create_vm_default_version_and_env_defaults(fake_gcloud, accel, version):
    fake_gcloud("create_vm.sh", "--tags", "", extra_env={"TPU_NAME": "t", "ZONE": "z", "ACCELERATOR_TYPE": accel,
                                                         "PROJECT_ID": "p"})
    [call] = fake_gcloud.calls()
    assert call["args"] == ["compute", "tpus", "tpu-vm", "create", "t", "--zone=z", "--project=p",
                            f"--accelerator-type={accel}", f"--version={version}"]


def test_create_vm_unknown_type_needs_version(fake_gcloud):
    p = fake_gcloud("create_vm.sh", "--name", "t", "--zone", "z", "--accelerator-type", "v9x-8", check=False)
    assert p.returncode == 2 and "--version" in p.stderr
    assert fake_gcloud.calls() == []


def test_create_vm_queued_slice_spot_wait_and_firewall(fake_gcloud):
    fake_gcloud("create_vm.sh", "--name", "slice", "--zone", "us-east5-b", "--accelerator-type", "v6e-16",
                "--queued", "--spot", "--wait", "--allow-from", "203.0.113.7/32", "--", "--description=jserve")
    calls = [c["args"] for c in fake_gcloud.calls()]
    assert calls[0] == ["compute", "tpus", "queued-resources", "create", "slice", "--zone=us-east5-b",
                        "--node-id=slice", "--accelerator-type=v6e-16", "--runtime-version=v2-alpha-tpuv6e",
                        "--tags=jserve", "--spot", "--description=jserve"]
    assert calls[1][:5] == ["compute", "tpus", "queued-resources", "describe", "slice"]
    assert calls[2] == ["compute", "firewall-rules", "create", "jserve-allow-8000", "--network=default",
                        "--direction=INGRESS", "--allow=tcp:8000", "--source-ranges=203.0.113.7/32",
                        "--target-tags=jserve"]
    assert len(calls) == 3


def test_create_vm_dry_run_calls_nothing(fake_gcloud):
    p = fake_gcloud("create_vm.sh", "--name", "t", "--zone", "z", "--dry-run")
    assert shlex.split(p.stdout) == ["gcloud", "compute", "tpus", "tpu-vm", "create", "t", "--zone=z",
                                     "--accelerator-type=v6e-8", "--version=v2-alpha-tpuv6e", "--tags=jserve"]
    assert fake_gcloud.calls() == []


def test_delete_vm(fake_gcloud):
    fake_gcloud("delete_vm.sh", "--name", "t", "--zone", "z")
    fake_gcloud("delete_vm.sh", "--name", "q", "--zone", "z", "--project", "p", "--queued", "--yes",
                "--firewall-rule", "jserve-allow-8000")
    assert [c["args"] for c in fake_gcloud.calls()] == [
        ["compute", "tpus", "tpu-vm", "delete", "t", "--zone=z"],
        ["compute", "tpus", "queued-resources", "delete", "q", "--zone=z", "--project=p", "--quiet", "--force"],
        ["compute", "firewall-rules", "delete", "jserve-allow-8000", "--project=p", "--quiet"],
    ]


def test_deploy_runs_on_all_workers_and_keeps_the_key_off_command_lines(fake_gcloud):
    fake_gcloud("deploy.sh", "--name", "slice", "--zone", "z", "--gcs-model", "gs://b/ckpt/my-model",
                "--mesh", "tp=4", "--distributed", "--", "--max-model-len", "8192",
                extra_env={"JSERVE_API_KEY": "s3cret-key"})
    calls = fake_gcloud.calls()
    scp, install, check, setup, health = calls
    assert scp["args"][:5] == ["compute", "tpus", "tpu-vm", "scp", "--recurse"]
    assert "slice:/tmp/" in scp["args"] and "--worker=all" in scp["args"]
    assert scp["staged"] == {"api_key": "0o600", "_common.sh": scp["staged"]["_common.sh"],
                             "health_check.sh": scp["staged"]["health_check.sh"],
                             "install.sh": scp["staged"]["install.sh"],
                             "jserve.service": scp["staged"]["jserve.service"],
                             "setup_service.sh": scp["staged"]["setup_service.sh"],
                             "src.tar.gz": scp["staged"]["src.tar.gz"]}
    assert scp["api_key"] == "s3cret-key\n"
    for call, worker in ((install, "all"), (check, "all"), (setup, "all"), (health, "0")):
        assert call["args"][:5] == ["compute", "tpus", "tpu-vm", "ssh", "slice"]
        assert f"--worker={worker}" in call["args"] and "--zone=z" in call["args"]
    assert all("s3cret-key" not in " ".join(c["args"]) for c in calls)
    command = lambda c: next(a for a in c["args"] if a.startswith("--command="))[len("--command="):]
    assert "install.sh --src /opt/jserve/src --venv /opt/jserve/venv --no-verify" in command(install)
    assert "--with-default-model" not in command(install)  # a --gcs-model is served instead
    assert "jax.devices()" in command(check) and "systemctl stop jserve" in command(check)
    setup_argv = shlex.split(command(setup))
    assert setup_argv[:3] == ["sudo", "bash", "/tmp/jserve-deploy/setup_service.sh"]
    opts = dict(zip(setup_argv[3::2], setup_argv[4::2]))
    assert opts["--args"] == "--mesh tp=4 --distributed --max-model-len 8192"
    assert opts["--gcs-model"] == "gs://b/ckpt/my-model" and opts["--port"] == "8000"
    assert opts["--api-key-file"] == "/tmp/jserve-deploy/api_key"
    assert "health_check.sh --url http://127.0.0.1:8000 --env-file /etc/jserve/env" in command(health)
    # what the unit will run on each worker parses (new flags aside, see FLAGS_BEING_ADDED)
    check_jserve_command(["serve", "--model", "my-model", "--host", "0.0.0.0", "--port", opts["--port"],
                          "--api-key", "k", *shlex.split(opts["--args"])], "deploy.sh")


def test_deploy_default_model_without_key_skip_install(fake_gcloud):
    fake_gcloud("deploy.sh", "--name", "t", "--zone", "z", "--no-health-check")
    calls = fake_gcloud.calls()
    assert len(calls) == 4 and "api_key" not in calls[0]["staged"] and "src.tar.gz" in calls[0]["staged"]
    assert "--with-default-model" in calls[1]["args"][-1]
    assert "--api-key-file" not in calls[3]["args"][-1]
    fake_gcloud("deploy.sh", "--name", "t", "--zone", "z", "--skip-install", "--no-health-check")
    calls = fake_gcloud.calls()[4:]
    assert len(calls) == 2 and "src.tar.gz" not in calls[0]["staged"]


def test_deploy_rejects_non_gcs_uri(fake_gcloud):
    p = fake_gcloud("deploy.sh", "--name", "t", "--zone", "z", "--gcs-model", "/local/path", check=False)
    assert p.returncode == 2 and "gs://" in p.stderr
    assert fake_gcloud.calls() == []


# ------------------------------------------------------------------------------ systemd unit

def test_unit_template():
    unit = (SCRIPTS_DIR / "jserve.service").read_text()
    for line in ("Restart=on-failure", "User=@USER@", "EnvironmentFile=/etc/jserve/env",
                 "EnvironmentFile=/etc/jserve/serve.env", "StateDirectory=jserve",
                 "Environment=JSERVE_COMPILATION_CACHE=/var/lib/jserve/compilation-cache",
                 "Environment=JSERVE_CHECKPOINTS=/var/lib/jserve/checkpoints", "WantedBy=multi-user.target"):
        assert re.search(rf"^{re.escape(line)}$", unit, re.M), line
    assert re.search(r"^ExecStart=@VENV@/bin/jserve serve ", unit, re.M)
    assert not re.search(r"^Environment=.*JSERVE_API_KEY", unit, re.M)  # the key lives in /etc/jserve/env only


@pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v systemd-analyze"], capture_output=True).returncode,
                    reason="needs systemd-analyze")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    stub = tmp_path / "venv" / "bin" / "jserve"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    unit = (SCRIPTS_DIR / "jserve.service").read_text().replace("@USER@", "root")
    unit = unit.replace("@VENV@", str(tmp_path / "venv"))
    (tmp_path / "jserve.service").write_text(unit)
    p = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "jserve.service")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "jserve.service" not in p.stderr, p.stderr


def test_setup_service_checks_before_touching_the_system(fake_gcloud):
    p = fake_gcloud("setup_service.sh", "--venv", "/nonexistent", check=False)
    assert p.returncode == 2 and "--user is required" in p.stderr


# ------------------------------------------------------------------------------ jserve command lines

def check_jserve_command(argv, where):
    """Parse `jserve ARGV` with jserve's parser; unknown flags must be ones issue #7 is adding."""
    from jserve.cli import build_parser

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            _, unknown = build_parser().parse_known_args(argv)
    except SystemExit as e:
        if e.code == 0:  # --help
            return
        raise AssertionError(f"{where}: `jserve {shlex.join(argv)}` does not parse: {err.getvalue()}") from None
    expect_value = False
    for token in unknown:
        if expect_value and not token.startswith("-"):
            expect_value = False
            continue
        flag = token.split("=", 1)[0]
        assert flag in FLAGS_BEING_ADDED, f"{where}: `jserve {shlex.join(argv)}`: unknown argument {token!r}"
        expect_value = "=" not in token and flag not in FLAGS_BEING_ADDED_WITHOUT_VALUE


def _substitute(text):
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: VARIABLES.get(m.group(1), "1"), text)


_JSERVE = re.compile(r"(?:^|(?<=[\s'\"=(]))(?:\S*/)?jserve\s+(" + "|".join(SUBCOMMANDS) + r")\b(.*)$")


def _command_lines(text, where, scripts=False):
    """`jserve <subcommand> ...` in shell text: continuation lines joined, comments skipped."""
    found = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _JSERVE.search(stripped)
        if not m or (scripts and not re.search(r"(^|/bin/)jserve\s", stripped[:m.end(1)])):
            continue
        start = m.start()
        rest = m.group(2)
        quote = stripped[start - 1] if start and stripped[start - 1] in "'\"" else None
        if quote:
            rest = rest.split(quote, 1)[0]
        rest = re.split(r"\s(?:&&|\|\||;|\||>|2>)\s", rest + " ", maxsplit=1)[0]
        argv = [m.group(1), *[t for t in shlex.split(_substitute(rest)) if t != "..."]]
        found.append((argv, f"{where}: {stripped[:100]}"))
    return found


def _doc_command_lines():
    doc = DOC.read_text()
    found = []
    for block in re.findall(r"^ *```(?:bash|sh|shell)?\n(.*?)^ *```", doc, re.M | re.S):
        found += _command_lines(block, "docs/tpu_vm.md")
    for span in re.findall(r"`(jserve (?:" + "|".join(SUBCOMMANDS) + r") [^`]+)`", doc):
        found += _command_lines(span, "docs/tpu_vm.md (inline)")
    return found


def _script_command_lines():
    found = []
    for path in sorted(SCRIPTS_DIR.iterdir()):
        found += _command_lines(path.read_text(), f"scripts/tpu_vm/{path.name}", scripts=True)
    return found


def test_the_guide_shows_the_commands_it_promises():
    subcommands = [argv[0] for argv, _ in _doc_command_lines()]
    assert {"serve", "plan", "convert"} <= set(subcommands)
    assert len(subcommands) >= 8
    doc = DOC.read_text()
    for needle in ("--worker=all", "queued-resources create", "tpu-vm create", "v5litepod-8", "v6e-8",
                   "v2-alpha-tpuv6e", "v2-alpha-tpuv5-lite", "tpu-ubuntu2204-base", "jax[tpu]",
                   "gcloud storage cp", "tpu-vm delete", "firewall-rules create", "--distributed",
                   "--coordinator-address", "JSERVE_COMPILATION_CACHE", "/etc/jserve/env", "https://"):
        assert needle in doc, needle
    assert re.search(r"^## Sources$", doc, re.M)


def test_the_unit_has_one_serve_command():
    lines = [argv for argv, where in _script_command_lines() if "jserve.service" in where]
    assert len(lines) == 1 and lines[0][0] == "serve"
    assert {"--model", "--host", "--port"} <= set(lines[0])
    assert "--api-key" not in lines[0]  # the key comes from JSERVE_API_KEY in the environment, not argv


@pytest.mark.parametrize("argv,where", _doc_command_lines() + _script_command_lines(),
                         ids=lambda x: x if isinstance(x, str) else None)
def test_jserve_command_line_parses(argv, where):
    check_jserve_command(argv, where)


def test_serve_takes_the_api_key_from_the_environment(monkeypatch):
    from jserve.cli import build_parser
    from jserve.server.cli import api_keys

    args = build_parser().parse_args(["serve"])
    monkeypatch.setenv("JSERVE_API_KEY", "k1, k2")
    assert api_keys(args) == ("k1", "k2")
    monkeypatch.setenv("JSERVE_API_KEY", "")
    assert api_keys(args) == ()  # no key: no auth
    monkeypatch.setenv("JSERVE_API_KEY", "env-key")
    assert api_keys(build_parser().parse_args(["serve", "--api-key", "flag-key"])) == ("flag-key",)

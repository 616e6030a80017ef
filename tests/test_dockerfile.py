"""deploy/Dockerfile, checked without a docker daemon: each target installs its platform's extra
and runs as a user; the base serves /health, keeps its caches on volumes, and its ENTRYPOINT parses
with jserve's own parser; every COPY source exists and passes the ignore file."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from test_deploy import DEPLOY, ROOT, console_scripts, flags, option_strings, parse_serve, serve_parser

DOCKERFILE = DEPLOY / "Dockerfile"

def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                           if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def stages() -> dict[str, list[tuple[str, str]]]:
    out, name = {}, None
    for instruction, rest in dockerfile():
        if instruction == "FROM":
            image, _, name = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I).group(1, 0, 2)
            out[name] = [("FROM", image)]
        elif name is not None:
            out[name].append((instruction, rest))
    return out


def platform_extra(platform: str) -> str:
    p = subprocess.run(["bash", "-c", '. scripts/_platform.sh; platform_extra "$1"', "_", platform], cwd=ROOT,
                       capture_output=True, text=True, timeout=30, check=True)
    return p.stdout.strip()


# ids with a prefix: a bare "tpu" id would be taken for the device marker by tests/conftest.py
@pytest.mark.parametrize("target", ["cpu", "tpu", "cuda"], ids=lambda t: f"target-{t}")
def test_dockerfile_targets_install_their_extra_and_run_as_a_user(target):
    all_stages = stages()
    steps = all_stages[target]
    assert steps[0] == ("FROM", "base")
    runs = " ".join(rest for instruction, rest in steps if instruction == "RUN")
    installs = re.findall(r"pip install (\S+)", runs)
    assert [shlex.split(a)[0] for a in installs] == ["." + platform_extra(target)], installs
    users = [rest for instruction, rest in steps if instruction == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{target} runs as root"
    base_runs = " ".join(rest for instruction, rest in all_stages["base"] if instruction == "RUN")
    assert re.search(rf"useradd .*\b{users[-1]}\b", base_runs), f"no user {users[-1]} is made"


def test_dockerfile_serves_health_caches_on_volumes_and_its_entrypoint_parses():
    base = dict(stages()["base"])  # one of each instruction there
    entrypoint = json.loads(base["ENTRYPOINT"])
    assert entrypoint[0] in console_scripts() and entrypoint[1] == "serve"
    parser, _ = serve_parser()
    assert set(flags(entrypoint[2:])) <= option_strings(parser)
    args = parse_serve(entrypoint[2:])  # no model given: the default model
    assert (args.host, args.model) == ("0.0.0.0", None)
    assert base["EXPOSE"] == str(args.port)

    health = re.fullmatch(r"(.*?)\s+CMD\s+(\[.*\])", base["HEALTHCHECK"])
    assert "--start-period" in health.group(1)
    command = json.loads(health.group(2))
    compile(command[command.index("-c") + 1], "HEALTHCHECK", "exec")  # valid Python
    assert f"http://127.0.0.1:{args.port}/health" in command[-1]

    volumes = json.loads(base["VOLUME"])
    env = dict(re.findall(r"(\w+)=(\S+)", base["ENV"]))
    for var in ("JSERVE_COMPILATION_CACHE", "HF_HOME", "JSERVE_CHECKPOINTS", "JSERVE_KERNEL_CACHE"):
        assert any(Path(v) in Path(env[var]).parents for v in volumes), f"{var}={env[var]} is on no volume"


def test_dockerfile_copies_what_exists_and_its_ignore_file_lets_it_through():
    allowed = {line[1:] for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copies = [rest.split()[:-1] for instruction, rest in dockerfile() if instruction == "COPY"]
    sources = [s for c in copies for s in c if not s.startswith("--")]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert source in allowed, f"{source} is left out of the build context by Dockerfile.dockerignore"

"""scripts/_platform.sh: which JAX build scripts/serve.sh and scripts/tpu_vm/install.sh install.

Each case lays out fake device markers under a folder given as JSERVE_DEV_ROOT (and a fake
`nvidia-smi` first on PATH), then asks the shell functions, `serve.sh --print-platform` and
`install.sh --dry-run` which platform and pip extra they choose; nothing is installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLATFORM_SH = ROOT / "scripts" / "_platform.sh"
TPU_ENV = ("JSERVE_PLATFORM", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID")


class Machine:
    """A fake machine: device files under `root`, programs in `bin`, extra environment."""

    def __init__(self, tmp_path: Path):
        self.root = tmp_path / "root"
        self.bin = tmp_path / "bin"
        self.root.mkdir()
        self.bin.mkdir()
        self.env: dict[str, str] = {}

    def add(self, *paths: str) -> "Machine":
        for p in paths:
            (self.root / p).parent.mkdir(parents=True, exist_ok=True)
            (self.root / p).touch()
        return self

    def pci(self, slot: str, vendor: str, device: str) -> "Machine":
        d = self.root / "sys/bus/pci/devices" / slot
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
        return self

    def program(self, name: str) -> "Machine":
        (self.bin / name).write_text("#!/bin/sh\nexit 0\n")
        (self.bin / name).chmod(0o755)
        return self

    def environ(self) -> dict[str, str]:
        # The real PATH without any real nvidia-smi, after the fake programs.
        path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nvidia-smi").exists()]
        env = {k: v for k, v in os.environ.items() if k not in TPU_ENV}
        env.update(PATH=os.pathsep.join([str(self.bin), *path]), JSERVE_DEV_ROOT=str(self.root), **self.env)
        return env

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.environ(), capture_output=True, text=True, timeout=60, cwd=ROOT)

    def detect(self) -> tuple[str, str]:
        """(platform, pip extra) as the sourced functions print them."""
        p = self.run("bash", "-c", f'. {PLATFORM_SH}; p="$(detect_platform)"; echo "$p"; platform_extra "$p"')
        assert p.returncode == 0, p.stderr
        platform, extra = p.stdout.split("\n")[:2]
        return platform, extra


@pytest.fixture
def machine(tmp_path):
    return Machine(tmp_path)


@pytest.mark.parametrize("layout, expected", [
    (lambda m: m, ("cpu", "")),
    (lambda m: m.add("dev/accel0"), ("tpu", "[tpu]")),
    (lambda m: m.add("dev/accel3"), ("tpu", "[tpu]")),
    (lambda m: m.add("dev/vfio/0", "dev/vfio/vfio"), ("tpu", "[tpu]")),
    (lambda m: m.add("dev/vfio/vfio"), ("cpu", "")),  # the control file alone: no device group
    (lambda m: m.pci("0000:00:04.0", "0x1ae0", "0x006f"), ("tpu", "[tpu]")),  # a v6e chip
    (lambda m: m.pci("0000:00:04.0", "0x1ae0", "0x0042"), ("cpu", "")),  # Google's gVNIC: not a TPU
    (lambda m: m.pci("0000:00:04.0", "0x10de", "0x0063"), ("cpu", "")),  # a TPU's id, another vendor
    (lambda m: m.program("nvidia-smi"), ("cuda", "[cuda]")),
    (lambda m: m.add("dev/nvidia0"), ("cuda", "[cuda]")),
    (lambda m: (m.root / "proc/driver/nvidia").mkdir(parents=True) or m, ("cuda", "[cuda]")),
    (lambda m: m.add("dev/vfio/0", "dev/nvidia0"), ("cuda", "[cuda]")),  # vfio passthrough beside a GPU
    (lambda m: m.add("dev/accel0").program("nvidia-smi"), ("tpu", "[tpu]")),
], ids=["nothing", "accel0", "accel3", "vfio-group", "vfio-control-only", "tpu-pci", "gvnic-pci",
        "other-vendor-pci", "nvidia-smi", "dev-nvidia0", "proc-driver-nvidia", "vfio-and-gpu", "tpu-and-gpu"])
def test_detects_the_platform_from_device_markers(machine, layout, expected):
    layout(machine)
    assert machine.detect() == expected


@pytest.mark.parametrize("var", ["TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID"])
def test_gke_tpu_environment_is_a_tpu(machine, var):
    machine.env[var] = "v6e-16" if var == "TPU_ACCELERATOR_TYPE" else "1"
    assert machine.detect() == ("tpu", "[tpu]")


@pytest.mark.parametrize("override, layout", [("cpu", "dev/accel0"), ("cuda", None), ("tpu", "dev/nvidia0")])
def test_jserve_platform_overrides_detection(machine, override, layout):
    if layout:
        machine.add(layout)
    machine.env["JSERVE_PLATFORM"] = override
    assert machine.detect() == (override, "" if override == "cpu" else f"[{override}]")


# ids with a prefix: a bare "gpu" or "tpu" id would be taken for the device markers by tests/conftest.py
@pytest.mark.parametrize("bad", ["gpu", "TPU", "rocm"], ids=lambda v: f"bad-{v}")
def test_unknown_platform_is_a_one_line_error_naming_it(machine, bad):
    machine.env["JSERVE_PLATFORM"] = bad
    p = machine.run("bash", "-c", f". {PLATFORM_SH}; detect_platform")
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1
    assert f"JSERVE_PLATFORM={bad}" in p.stderr and "cpu, tpu or cuda" in p.stderr


@pytest.mark.parametrize("layout, expected", [
    (None, "cpu ."), ("dev/accel0", "tpu .[tpu]"), ("dev/nvidia0", "cuda .[cuda]"),
])
def test_serve_sh_print_platform_chooses_what_it_installs(machine, layout, expected):
    if layout:
        machine.add(layout)
    p = machine.run("bash", "scripts/serve.sh", "--print-platform")
    assert p.returncode == 0, p.stderr
    assert p.stdout == expected + "\n"
    # the argument it prints is the one its pip install gets
    text = (ROOT / "scripts" / "serve.sh").read_text()
    assert 'pip install -q --disable-pip-version-check -e "$spec"' in text
    assert 'spec=".$(platform_extra "$platform")"' in text


def test_serve_sh_stops_at_a_bad_platform_before_installing(machine):
    machine.env["JSERVE_PLATFORM"] = "metal"
    p = machine.run("bash", "scripts/serve.sh")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == "serve.sh: JSERVE_PLATFORM=metal is not a platform: give cpu, tpu or cuda"


def _extras() -> tuple[str, dict[str, list[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    jax = next(d for d in project["dependencies"] if re.match(r"jax\b(?!lib)", d))
    return jax, project["optional-dependencies"]


@pytest.mark.parametrize("platform, jax_extra", [("tpu", "tpu"), ("cuda", "cuda12")])
def test_each_platform_extra_exists_with_the_pinned_jax(machine, platform, jax_extra):
    machine.env["JSERVE_PLATFORM"] = platform
    _, extra = machine.detect()
    jax, extras = _extras()
    name = extra.strip("[]")
    assert name in extras, f"pyproject.toml has no [{name}] extra"
    version = jax.removeprefix("jax")
    assert f"jax[{jax_extra}]{version}" in extras[name], (extras[name], jax)


@pytest.mark.parametrize("platform, pip_arg, jax_platform", [
    (None, "[tpu]", "tpu"), ("cuda", "[cuda]", "gpu"), ("cpu", "", "cpu"),
])
def test_tpu_vm_install_uses_the_same_extra(machine, tmp_path, platform, pip_arg, jax_platform):
    if platform:
        machine.env["JSERVE_PLATFORM"] = platform
    machine.add("dev/accel0")
    venv = tmp_path / "venv"
    p = machine.run("bash", "scripts/tpu_vm/install.sh", "--dry-run", "--python", sys.executable, "--venv", str(venv))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    pip = [line for line in lines if " -e " in line]
    assert pip == [f"{venv}/bin/python -m pip install -q --disable-pip-version-check -e "
                   + str(ROOT) + pip_arg.replace("[", "\\[").replace("]", "\\]") + " "]
    assert lines[-1].endswith(f" {jax_platform} "), lines[-1]  # the verify step checks that device
    assert "no TPU found" not in p.stderr


def test_tpu_vm_install_warns_where_no_tpu_is_seen(machine, tmp_path):
    p = machine.run("bash", "scripts/tpu_vm/install.sh", "--dry-run", "--no-verify", "--python", sys.executable,
                    "--venv", str(tmp_path / "venv"))
    assert p.returncode == 0, p.stderr
    assert "warning: no TPU found" in p.stderr
    assert any(line.endswith("\\[tpu\\] ") for line in p.stdout.splitlines())


def test_readme_says_what_each_platform_installs():
    readme = (ROOT / "README.md").read_text()
    head = readme[:readme.index("\n## ")] if "\n## " in readme else readme
    for words in ("JSERVE_PLATFORM", "jserve[tpu]", "jserve[cuda]"):
        assert words in head, f"README's opening does not mention {words}"

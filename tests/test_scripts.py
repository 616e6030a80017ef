"""Every benchmark under benchmarks/ still imports against the package and parses `--help`, and
scripts/ holds the operational shell only.

The benchmarks are not run by the suite, so a renamed function used to break them unnoticed
(the decode-step benchmark imported `jserve.runtime.runner._step` for two sessions after it moved).
One subprocess imports them all: importing Pallas registers JAX config options, which must not leak
into this process's compiled steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run inside the transformers/torch environment that benchmarks.engine.offline creates.
NEEDS_TORCH = {"benchmarks.engine.hf_generate"}

_CHECK = r'''
import contextlib, importlib, inspect, io, json, sys
results = {}
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
        main = getattr(module, "main", None)
        if main is None or not inspect.signature(main).parameters:
            results[name] = "no main(argv)"
            continue
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                main(["--help"])
                results[name] = "main(['--help']) returned instead of exiting"
                continue
            except SystemExit as e:
                if e.code not in (0, None):
                    results[name] = f"--help exited with {e.code}"
                    continue
        results[name] = "ok" if "usage:" in out.getvalue() else "--help printed no usage"
    except BaseException as e:
        results[name] = f"{type(e).__name__}: {e}"
print(json.dumps(results))
'''


def _benchmarks() -> list[str]:
    paths = sorted((ROOT / "benchmarks").glob("*/*.py"))
    names = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in paths if p.name != "__init__.py"]
    return [n for n in names if n not in NEEDS_TORCH]


def test_every_benchmark_imports_and_parses_help():
    names = _benchmarks()
    assert len(names) >= 10, names
    done = subprocess.run([sys.executable, "-c", _CHECK, *names], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == set(names)
    failed = {name: why for name, why in results.items() if why != "ok"}
    assert not failed, failed


def test_scripts_hold_the_operational_shell_only():
    assert not list((ROOT / "scripts").rglob("*.py")), "benchmarks belong in benchmarks/ (python -m benchmarks...)"
    for path in (ROOT / "scripts").glob("*.sh"):
        assert "scripts/bench_" not in path.read_text(), path


def test_alternated_rates_are_medians_with_ratios_to_the_baseline():
    import time

    from benchmarks.harness import alternated_rates

    rows = alternated_rates({"fast": lambda n: time.sleep(0.01 * n), "slow": lambda n: time.sleep(0.03 * n)},
                            (2, 1), rounds=3, tokens=10, baseline="fast", key="vs_fast")
    got = {(r["variant"], r["requests"]): r for r in rows}
    assert set(got) == {("fast", 2), ("slow", 2), ("fast", 1), ("slow", 1)}
    assert got[("fast", 1)]["vs_fast"] == 1.0
    assert 0.1 < got[("slow", 1)]["vs_fast"] < 0.6 and got[("fast", 1)]["output_tok_s"] < 1000

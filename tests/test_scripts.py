"""Every script under scripts/ still imports against the package and parses `--help`.

The benchmarks are not run by the suite, so a renamed function used to break them unnoticed
(`bench_decode_step.py` imported `jserve.runtime.runner._step` for two sessions after it moved). One
subprocess imports them all: importing Pallas registers JAX config options, which must not leak
into this process's compiled steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# Run inside the transformers/torch environment that bench_offline and compare_servers create.
NEEDS_TORCH = {"make_arch_goldens.py"}

_CHECK = r'''
import contextlib, importlib.util, io, inspect, json, sys
results = {}
for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[-1]
    try:
        spec = importlib.util.spec_from_file_location(name[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        main = getattr(module, "main", None)
        if main is not None and inspect.signature(main).parameters:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    main(["--help"])
                    results[name] = "main(['--help']) returned instead of exiting"
                    continue
                except SystemExit as e:
                    if e.code not in (0, None):
                        results[name] = f"--help exited with {e.code}"
                        continue
            if "usage:" not in out.getvalue():
                results[name] = "--help printed no usage"
                continue
        results[name] = "ok"
    except BaseException as e:
        results[name] = f"{type(e).__name__}: {e}"
print(json.dumps(results))
'''


def test_every_script_imports_and_parses_help():
    scripts = sorted(p for p in SCRIPTS.glob("*.py") if p.name not in NEEDS_TORCH)
    assert len(scripts) >= 10, scripts
    done = subprocess.run([sys.executable, "-c", _CHECK, *map(str, scripts)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {p.name for p in scripts}
    failed = {name: why for name, why in results.items() if why != "ok"}
    assert not failed, failed

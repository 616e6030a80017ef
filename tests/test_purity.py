"""The pure-Python modules (page table, request, scheduler) must not pull in jax, flax or numpy."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEAVY = ("jax", "flax", "numpy")


@pytest.mark.parametrize("module", ["jserve.page_table", "jserve.request", "jserve.scheduler"])
def test_module_imports_no_heavy_library(module):
    if not (ROOT / (module.replace(".", "/") + ".py")).exists():
        pytest.skip(f"{module} does not exist yet")
    code = (f"import sys; import {module}; "
            f"print(' '.join(name for name in {HEAVY!r} if name in sys.modules))")
    # A fresh interpreter: this test process may already have imported jax for other tests.
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"{module} imports {result.stdout.strip()}"

"""The package's layers and their direction, read from the source (every import, function-local
ones included; `if TYPE_CHECKING:` blocks excepted):

    core, text, structured  <-  model  <-  runtime  <-  engine  <-  entry points (llm, cli, server, bench)

A module may import its own layer and those below it, never one above; no import cycle exists
between modules; and the bottom layers import neither JAX, flax nor numpy (checked in a fresh
interpreter, as a user of the bookkeeping alone would run them; the text and structured layers
may use numpy).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jserve"
LAYERS = {"core": 0, "text": 0, "structured": 0, "model": 1, "runtime": 2, "engine": 3}
ENTRY = 4  # jserve/__init__, llm, cli, server/, bench/
HEAVY = ("jax", "flax", "numpy")


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], ENTRY) if len(parts) > 1 else ENTRY


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The jserve modules `path` imports, wherever in the file (`from pkg import mod` counts mod)."""
    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "jserve")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jserve":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module(p) for p in paths}
    return {_module(p): {m for m in _imports(p, modules) if m in modules} - {_module(p)} for p in paths}


def test_imports_point_down_the_layers():
    wrong = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
             for m, deps in _graph().items() for d in sorted(deps)
             if _layer(d) > _layer(m) and not d == "jserve"]
    assert not wrong, "\n".join(wrong)
    # The bottom layers import nothing above them, not even the package's lazy exports.
    assert not [m for m, deps in _graph().items() if _layer(m) < ENTRY and "jserve" in deps]


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ re-exporting its own modules is not a cycle of theirs.
    graph = {m: {d for d in deps if not (m.startswith(d + ".") and d in graph)} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_layer_test_sees_a_violation(tmp_path, monkeypatch):
    """The checker itself: a core module importing the runtime is reported."""
    fake = tmp_path / "jserve" / "core"
    fake.mkdir(parents=True)
    (tmp_path / "jserve" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "bad.py").write_text("def f():\n    from jserve.runtime import runner\n")
    (tmp_path / "jserve" / "runtime").mkdir()
    (tmp_path / "jserve" / "runtime" / "__init__.py").write_text("")
    (tmp_path / "jserve" / "runtime" / "runner.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "jserve")
    with pytest.raises(AssertionError, match="jserve.core.bad .* imports jserve.runtime.runner"):
        test_imports_point_down_the_layers()


@pytest.mark.parametrize("package,heavy", [("core", HEAVY), ("text", ("jax", "flax")),
                                                 ("structured", ("jax", "flax"))])
def test_bottom_layers_import_no_heavy_library(package, heavy):
    modules = sorted(_module(p) for p in (PACKAGE / package).rglob("*.py"))
    code = (f"import sys; import {', '.join(modules)}; "
            f"print(' '.join(name for name in {heavy!r} if name in sys.modules))")
    # A fresh interpreter: this test process may already have imported jax for other tests.
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"jserve.{package} imports {result.stdout.strip()}"



def _reach_ins(path: pathlib.Path, modules: set[str]) -> list[str]:
    """Where `path` reaches past the engine's public surface: the LLMEngine inside an
    AsyncLLMEngine (`.engine` read off anything called `engine`), a `.runner`, or a private
    (underscore) name of another jserve module, imported (`from jserve.x import _y`) or read off
    the imported module (`x._y`)."""
    tree = ast.parse(path.read_text())
    aliases = set()  # the names this file binds to jserve modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname or a.name.split(".")[0] for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            aliases.update(a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in modules)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jserve":
            found += [(node.lineno, f"{where} imports {a.name} from {node.module}") for a in node.names
                      if _private(a.name)]
        elif isinstance(node, ast.Attribute):
            value = node.value
            owner = getattr(value, "id", None) or getattr(value, "attr", None)  # a name's, an attribute's
            if node.attr == "runner":
                found.append((node.lineno, f"{where} reads .runner"))
            elif node.attr == "engine" and owner == "engine":
                found.append((node.lineno, f"{where} reads engine.engine (the LLMEngine)"))
            elif _private(node.attr) and isinstance(value, ast.Name) and value.id in aliases:
                found.append((node.lineno, f"{where} reads {value.id}.{node.attr}"))
    return [hit for _, hit in sorted(found)]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_the_server_uses_only_the_engines_public_surface():
    """jserve/server/ talks to `AsyncLLMEngine`'s methods and properties, and to other modules'
    public names; never to the LLMEngine, the runner, or another module's private helpers."""
    modules = set(_graph())
    found = [hit for path in sorted((PACKAGE / "server").rglob("*.py")) for hit in _reach_ins(path, modules)]
    assert not found, "\n".join(found)


def test_the_surface_test_sees_each_reach_in(tmp_path, monkeypatch):
    """The checker itself: each kind of reach-in is reported, and the public spellings are not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text("from jserve.server import protocol\n"
                   "from jserve.server.protocol import _show\n"
                   "import jserve.server.fields as f\n"
                   "import os\n"
                   "def attach(state, engine):\n"
                   "    engine.engine.stats()\n"
                   "    state.engine.engine.config\n"
                   "    getattr(engine, 'x').runner.records\n"
                   "    protocol._bool({}, 'x')\n"
                   "    f._CHECKS\n"
                   "    os._exit(0)\n"
                   "    state._private_but_not_a_module\n"
                   "    protocol.show(engine.step_records(), state.engine.vocab_size)\n")
    found = _reach_ins(bad, {"jserve", "jserve.server", "jserve.server.protocol", "jserve.server.fields"})
    assert [hit.split(" ", 1)[1] for hit in found] == [
        "imports _show from jserve.server.protocol", "reads engine.engine (the LLMEngine)",
        "reads engine.engine (the LLMEngine)", "reads .runner", "reads protocol._bool", "reads f._CHECKS"], found

"""The shape of the package (issue 11): no import cycles, not even through imports inside
functions, and no module so long that a reader cannot hold it (docs/design.md, "Layers")."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 80


def _cycle_finder():
    """scripts/import_cycles.py, loaded as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "import_cycles", ROOT / "scripts" / "import_cycles.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "lazy-included"])
def test_no_import_cycles(lazy):
    finder = _cycle_finder()
    graph = finder.import_graph(finder.modules(SRC), lazy)
    assert "caddtree.cli" in graph and "caddtree.serve.server" in graph  # it read the package
    assert finder.cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle_through_a_lazy_import(tmp_path):
    package = tmp_path / "caddtree"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import g\n\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from .a import f\n\n    return f\n")
    finder = _cycle_finder()
    mods = finder.modules(tmp_path)
    assert finder.cycles(finder.import_graph(mods, lazy=False)) == []
    assert finder.cycles(finder.import_graph(mods, lazy=True)) == [
        ["caddtree.a", "caddtree.b", "caddtree.a"]
    ]


def test_every_import_keeps_the_layers():
    finder = _cycle_finder()
    graph = finder.import_graph(finder.modules(SRC), lazy=True)
    parts = {finder.part(m) for m in graph}
    assert parts <= set(finder.LAYERS), f"parts the layer table does not name: {parts}"
    assert finder.layer_violations(graph, finder.LAYERS) == []


def test_the_layer_check_finds_a_wrong_way_import(tmp_path):
    """A lower layer importing a higher one (core from engine, inside a function) is caught."""
    package = tmp_path / "caddtree"
    for name in ("core", "engine"):
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "engine" / "loop.py").write_text("from ..core.tree import f\n")
    (package / "core" / "tree.py").write_text(
        "def f():\n    from ..engine.loop import g\n\n    return g\n"
    )
    finder = _cycle_finder()
    graph = finder.import_graph(finder.modules(tmp_path), lazy=True)
    assert finder.layer_violations(graph, finder.LAYERS) == [
        "caddtree.core.tree -> caddtree.engine.loop"
    ]
    # and the real package, with the same import planted in a copy of core/sampling.py
    src = tmp_path / "src"
    shutil.copytree(SRC / "caddtree", src / "caddtree")
    sampling = src / "caddtree" / "core" / "sampling.py"
    sampling.write_text(
        sampling.read_text() + "\n\ndef planted():\n    from ..engine import batching\n"
    )
    real = finder.import_graph(finder.modules(src), lazy=True)
    assert finder.layer_violations(real, finder.LAYERS) == [
        "caddtree.core.sampling -> caddtree.engine.batching"
    ]


def test_no_two_modules_share_a_file_name():
    names: dict[str, list[str]] = {}
    for path in (SRC / "caddtree").rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(SRC)))
    assert len(names) > 20
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_no_function_is_over_the_length_limit():
    import ast

    long = {}
    for path in sorted((SRC / "caddtree").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(SRC)}:{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}; split them"


def test_no_module_is_over_the_length_limit():
    lengths = {
        str(path.relative_to(SRC)): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted((SRC / "caddtree").rglob("*.py"))
    }
    assert len(lengths) > 20
    too_long = {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}; split them"


def test_lazy_re_exports_load_only_the_module_that_defines_the_name():
    """``caddtree``, ``caddtree.bench`` and ``caddtree.train`` offer their submodules' names
    through one helper (:func:`caddtree.util.lazy.lazy_exports`): a name loads only its own module."""
    code = (
        "import sys, caddtree, caddtree.bench, caddtree.train\n"
        "from caddtree.bench import load_results\n"
        "from caddtree.train import training_prompts\n"
        "assert 'load_results' in dir(caddtree.bench) and 'hf' in dir(caddtree)\n"
        "for package, name in ((caddtree, 'nothing'), (caddtree.bench, 'report_main')):\n"
        "    try:\n"
        "        getattr(package, name)\n"
        "    except AttributeError as exc:\n"
        "        assert name in str(exc)\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
        "for module in ('torch', 'caddtree.bench.report', 'caddtree.bench.results',\n"
        "               'caddtree.train.trainer', 'caddtree.train.prompts'):\n"
        "    if module in sys.modules:\n"
        "        print(module)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["caddtree.bench.results", "caddtree.train.prompts"]

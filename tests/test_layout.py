"""The shape of the package (issue 11): no import cycles, not even through imports inside
functions, and no module so long that a reader cannot hold it (docs/design.md, "Layers")."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_MODULE_LINES = 650


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

"""Print the import cycles among the ``caddtree`` modules, and the imports against the layers,
read from the source (nothing imported).

    python scripts/import_cycles.py [SRC_DIR]     # default: src next to this script

Two graphs: module-level imports only (what importing a module runs), and every import including
the ones inside functions and under ``TYPE_CHECKING`` (lazy imports). Exits 1 when either graph has
a cycle (a lazy import only postpones a cycle to the call), or when any import, lazy ones
included, goes the wrong way between the layers of docs/design.md (:data:`LAYERS`).
tests/test_layout.py runs the same checks.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(src: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under ``src/caddtree``: dotted name -> (file, is a package)."""
    found = {}
    for path in sorted((src / "caddtree").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def import_graph(mods: dict[str, tuple[Path, bool]], lazy: bool) -> dict[str, list[str]]:
    """Module -> the caddtree modules it imports (at module level, or anywhere when ``lazy``)."""
    graph = {}
    for name, (path, package) in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = ast.walk(tree) if lazy else tree.body
        deps = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = name.split(".") if package else name.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:  # `from package import module` imports the module
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in mods else target)
        graph[name] = sorted(d for d in deps if d in mods and d != name)
    return graph


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The cycles a depth-first walk of ``graph`` meets (each as a closed path)."""
    found: list[list[str]] = []
    stack: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> None:
        stack.append(node)
        for dep in graph[node]:
            if dep in stack:
                found.append(stack[stack.index(dep) :] + [dep])
            elif dep not in done:
                visit(dep)
        stack.pop()
        done.add(node)

    for node in graph:
        if node not in done:
            visit(node)
    return found


LAYERS: dict[str, float] = {
    "util": 0,
    "core": 1,
    "caddtree": 1.5,  # the package's own __init__: its version and lazy exports
    "runtime": 2,
    "models": 3,
    "engine": 4,
    "profiles": 5,
    "loading": 5,
    "api": 6,
    "arguments": 7,
    "hf": 7,
    "serve": 8,
    "bench": 8,
    "train": 9,
    "cli": 10,
}
"""The layer of each part of the package (a sub-package or a top-level module): a module may import
from its own part and from parts of a lower layer only."""


def part(module: str) -> str:
    """The part of the package ``module`` belongs to (``caddtree.engine.batching``: ``engine``)."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def layer_violations(graph: dict[str, list[str]], layers: dict[str, float]) -> list[str]:
    """The imports of ``graph`` from a part to a part of the same or a higher layer (and any
    import of a part the table does not name), as ``importer -> imported`` lines."""
    found = []
    for module, deps in graph.items():
        for dep in deps:
            a, b = part(module), part(dep)
            if a == b:
                continue
            if a not in layers or b not in layers or layers[b] >= layers[a]:
                found.append(f"{module} -> {dep}")
    return found


def main() -> int:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src"
    mods = modules(src)
    status = 0
    for lazy in (False, True):
        found = cycles(import_graph(mods, lazy))
        what = "every import (lazy ones included)" if lazy else "module-level imports"
        print(f"{what}: {len(found)} cycle(s)")
        for cycle in found:
            print("    " + " -> ".join(cycle))
        if found:
            status = 1
    wrong = layer_violations(import_graph(mods, lazy=True), LAYERS)
    print(f"imports against the layers: {len(wrong)}")
    for line in wrong:
        print("    " + line)
    return 1 if wrong else status


if __name__ == "__main__":
    sys.exit(main())

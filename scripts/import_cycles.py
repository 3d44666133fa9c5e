"""Print the import cycles among the ``caddtree`` modules, read from the source (nothing imported).

    python scripts/import_cycles.py [SRC_DIR]     # default: src next to this script

Two graphs: module-level imports only (what importing a module runs), and every import including
the ones inside functions and under ``TYPE_CHECKING`` (lazy imports). Exits 1 when either graph has
a cycle: a lazy import only postpones a cycle to the call, and the layers of docs/design.md ("Each
layer imports only from the layers above it") allow none. tests/test_layout.py runs the same check.
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
    return status


if __name__ == "__main__":
    sys.exit(main())

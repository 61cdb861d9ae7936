"""The import graph between the project's files, read with ``ast`` (nothing is imported).

Used by ``tests/test_import_layers.py``; run it directly for the counts::

    python tests/import_graph.py          # cycles (SCCs > 1) and their sizes, local imports
    python tests/import_graph.py -v       # also each cycle's files and each function-local import

An edge ``a -> b`` is any ``import``/``from ... import`` in file ``a`` that names project module
``b``, at module level or inside a function, with relative imports resolved and
``from pkg import name`` read as the submodule ``pkg.name`` when that file exists. A name that a
package's ``__init__`` exports lazily through an ``_EXPORTS = {"name": "module"}`` table (PEP 562,
as ``autotp/__init__.py`` does) resolves to the module that defines it, since that is what the
import runs. Imports under ``if TYPE_CHECKING:`` count too: they never run, but a layer that names
a higher one's types for a type checker still reaches up (and a checker reading them sees the cycle). Importing
``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``; those implicit parent edges are not
counted (as import-linter and pydeps do not).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autotp", "handwritten_plans")


@dataclass(frozen=True)
class Edge:
    """One import of project module ``target`` by ``source`` (lines ``line`` to ``end_line``),
    ``local`` when it sits inside a function."""

    source: str
    target: str
    line: int
    local: bool
    end_line: int = 0


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement in ``tree`` (``if TYPE_CHECKING:`` blocks included), and whether it is
    local (inside a function)."""

    def walk(node: ast.AST, local: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, local
            else:
                yield from walk(child, local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    yield from walk(tree, False)


def lazy_exports(path: Path) -> dict[str, str]:
    """A package ``__init__``'s ``_EXPORTS = {"name": "module", ...}`` table, or ``{}``."""
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "_EXPORTS" and isinstance(node.value, ast.Dict):
            return {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(node.value.keys, node.value.values)}
    return {}


def import_edges(root: Path = ROOT) -> list[Edge]:
    """Every import edge between the project's files."""
    modules = project_modules(root)
    exports = {name: lazy_exports(path) for name, path in modules.items() if path.name == "__init__.py"}
    edges = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, local in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    anchor = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        targets.append(submodule)
                    elif alias.name in exports.get(base, {}):
                        targets.append(exports[base][alias.name])
                    else:
                        targets.append(base)
            for target in targets:
                # ``import a.b.c`` names a.b.c; a missing leaf falls back to its nearest module.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.append(Edge(name, target, node.lineno, local, node.end_lineno or node.lineno))
    return edges


# Modules whose function-local imports need no reason each: the CLI imports inside its commands so
# that ``autotp --help`` does not load torch (its module docstring says so).
LAZY_MODULES = frozenset({"autotp.cli", "autotp.cli_text"})


def unexplained_local_imports(edges: list[Edge], root: Path = ROOT) -> list[Edge]:
    """Function-local imports of project modules, outside :data:`LAZY_MODULES`, whose statement
    carries no ``# local: <why>`` comment (start-up time, an optional heavy dependency)."""
    modules = project_modules(root)
    texts = {}
    found = []
    for edge in edges:
        if not edge.local or edge.source in LAZY_MODULES:
            continue
        if edge.source not in texts:
            texts[edge.source] = modules[edge.source].read_text().splitlines()
        statement = texts[edge.source][edge.line - 1:max(edge.line, edge.end_line)]
        if not any("# local:" in line for line in statement):
            found.append(edge)
    return found


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one file (Tarjan), largest first."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components, key=lambda c: (-len(c), c))


def describe(edges: list[Edge], verbose: bool = False) -> str:
    """The counts: cycles and their sizes, function-local imports of project modules."""
    found = cycles(edges)
    local = [e for e in edges if e.local]
    lines = [
        f"files: {len(project_modules())}, import edges: {len({(e.source, e.target) for e in edges})}",
        f"cycles (SCCs > 1): {len(found)}, sizes: {[len(c) for c in found]}",
        f"function-local imports of project modules: {len({(e.source, e.line) for e in local})} statements"
        f" ({len(local)} edges)",
    ]
    if verbose:
        for component in found:
            members = set(component)
            lines.append(f"cycle of {len(component)}:")
            for e in edges:
                if e.source in members and e.target in members:
                    lines.append(f"  {e.source}:{e.line} -> {e.target}{' (local)' if e.local else ''}")
        lines = list(dict.fromkeys(lines))  # one line per statement and target
        lines.append("function-local imports:")
        lines += list(dict.fromkeys(f"  {e.source}:{e.line} -> {e.target}" for e in local))
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe(import_edges(), verbose="-v" in sys.argv))

"""The package's files import each other without cycles (read with ``ast``; nothing is imported).

Every import counts: module level and function-local, relative, ``from pkg import submodule`` and
names ``autotp/__init__`` exports lazily, and ``if TYPE_CHECKING:`` imports (a type named from a higher
layer is a reach up too). A cycle
means some layer reaches back up (the layers: ``docs/README.md``); move what the lower layer needs
down instead of importing it inside a function.
"""

from __future__ import annotations

import pytest

from import_graph import Edge, cycles, import_edges, project_modules, unexplained_local_imports


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    """The project's import edges, parsed once (about 2 s)."""
    return import_edges()


def test_reads_both_packages_and_local_imports(edges: list[Edge]) -> None:
    """Guards the tests below: an edge reader that found nothing would pass them vacuously."""
    modules = project_modules()
    assert {"autotp.apply", "autotp.synth.graph", "handwritten_plans"} <= set(modules)
    assert any(e.local for e in edges), "no function-local import found (the CLI keeps some)"
    assert any(e.source.startswith("handwritten_plans") and e.target.startswith("autotp.styles") for e in edges)


def test_cycle_finder_finds_a_three_file_cycle() -> None:
    edges = [Edge("a", "b", 1, False), Edge("b", "c", 1, True), Edge("c", "a", 1, True), Edge("c", "d", 1, False)]
    assert cycles(edges) == [["a", "b", "c"]]


def test_no_import_cycles(edges: list[Edge]) -> None:
    found = cycles(edges)
    if found:
        lines = []
        for component in found:
            members = set(component)
            lines.append(f"cycle of {len(component)} files:")
            lines += dict.fromkeys(  # one line per statement and target
                f"  {e.source}:{e.line} -> {e.target}{' (function-local)' if e.local else ''}"
                for e in edges
                if e.source in members and e.target in members
            )
        raise AssertionError("import cycles between files:\n" + "\n".join(lines))


def test_function_local_imports_say_why(edges: list[Edge]) -> None:
    """Outside the CLI, an autotp module imported inside a function says why on that statement
    (``# local: imports transformers``); otherwise it belongs at module level, or, if that makes a
    cycle, the needed code belongs in a lower layer."""
    unexplained = unexplained_local_imports(edges)
    assert not unexplained, "function-local imports without a '# local: <why>' comment:\n" + "\n".join(
        sorted({f"  {e.source}:{e.line} -> {e.target}" for e in unexplained}))

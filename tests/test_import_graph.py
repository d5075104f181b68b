"""The import graph of `gateway`, read by grimp (the library import-linter is built on):
no cycle between packages (`gateway.<name>`), none between modules, and the production
proxy never reaches the simulator.

Imports under `if TYPE_CHECKING:` are left out: they never run, and an annotation naming a
type of the package that imports this one is not a load-order dependency. Imports inside
functions are kept (grimp reads them): a lazy import is still a dependency.
"""

from __future__ import annotations

import graphlib
from collections.abc import Mapping, Set

import grimp
import pytest


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("gateway", cache_dir=None, exclude_type_checking_imports=True)


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(edges: Mapping[str, Set[str]]) -> list[list[str]]:
    """Every cycle found by breaking, one edge at a time, the cycle graphlib reports."""
    left = {node: set(targets) for node, targets in edges.items()}
    found: list[list[str]] = []
    while True:
        try:
            graphlib.TopologicalSorter(left).prepare()
            return found
        except graphlib.CycleError as exc:
            cycle: list[str] = exc.args[1]  # [n0, n1, ..., n0], each step one edge
            found.append(cycle[:-1])
            # graphlib reads a node's set as its predecessors: the step n0 -> n1 means
            # n1 is in n0's set or n0 in n1's; drop whichever edge is there.
            a, b = cycle[0], cycle[1]
            if b in left.get(a, set()):
                left[a].discard(b)
            else:
                left[b].remove(a)  # KeyError rather than a loop that never ends


def module_edges(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def package_edges(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for importer, imported in module_edges(graph).items():
        for target in imported:
            if package(importer) != package(target):
                out.setdefault(package(importer), set()).add(package(target))
    return out


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [{"a", "b"}]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [{"a", "b", "c"}]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [{"a", "b"}, {"c", "d"}]),
    ],
)
def test_cycle_finder(edges: dict[str, set[str]], expected: list[set[str]]) -> None:
    found = sorted((set(c) for c in cycles(edges)), key=sorted)
    assert found == expected


def test_no_package_cycles(graph: grimp.ImportGraph) -> None:
    assert cycles(package_edges(graph)) == []


def test_no_module_cycles(graph: grimp.ImportGraph) -> None:
    assert cycles(module_edges(graph)) == []


def test_proxy_never_imports_the_simulator(graph: grimp.ImportGraph) -> None:
    chain = graph.find_shortest_chains("gateway.proxy", "gateway.sim", as_packages=True)
    assert chain == set()

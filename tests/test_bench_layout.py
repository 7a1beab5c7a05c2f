"""The benchmark harness's layout: its modules import each other without cycles (lazy imports inside functions
included), and each scenario is a module of ``bench.scenarios`` behind one small interface."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports anywhere in its body."""
    modules = {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                # `from bench import report` imports the module bench.report; `from bench.x import y`, bench.x.
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            graph[name] |= {t for t in targets if t in modules and t not in (name, package)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_bench_has_no_import_cycle() -> None:
    graph = import_graph("bench")
    assert graph.get("bench.runner"), "the graph is empty: the scan is broken"
    assert cycles(graph) == []


def test_one_scenario_per_module() -> None:
    from bench.scenarios import DATA, DATA_SCENARIOS, SCENARIOS
    from bench.scenarios.base import DataScenario
    from bench.scenarios.controlplane import ControlPlane

    assert SCENARIOS == ("throughput", "latency", "connrate", "memory", "controlplane")  # the CLI's names, in order
    assert SCENARIOS[:-1] == DATA_SCENARIOS
    for cls in DATA:
        assert issubclass(cls, DataScenario) and not getattr(cls, "__abstractmethods__", None), cls
        assert cls.__module__ == f"bench.scenarios.{cls.name}", cls
    assert ControlPlane.__module__ == f"bench.scenarios.{ControlPlane.name}"
    # The orchestrator knows the interface, not the scenarios: no scenario's name in its code.
    runner = (ROOT / "bench" / "runner.py").read_text(encoding="utf-8")
    code = "\n".join(line for line in runner.splitlines() if not line.lstrip().startswith("#"))
    body = code.split('"""', 2)[2]  # after the module docstring, which describes a repetition
    body = re.sub(r'"op": "\w+"', "", body)  # a client command (the warm-up is 50 latency round trips)
    assert not [name for name in DATA_SCENARIOS if f'"{name}"' in body]

"""The shape of ``ztunnel/proxy/``'s import graph (issue 15, item 2): no cycles, no sideways imports between the
listener modules, nothing above the proxy layer imported from inside it, and the admin server independent of it.

Every import counts, including those under ``TYPE_CHECKING`` and inside functions: a cycle hidden behind either is
still a cycle for the reader. The graph is read from the source (``ast``), not from ``sys.modules``, so it does not
depend on what the test run imported before.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ztunnel"
# One module per listener, named as upstream's: none may import another (what two share lives below them).
LISTENERS = ("outbound", "inbound", "inbound_passthrough", "socks5")
# What the proxy layer is built into; importing any of it from ztunnel/proxy would be an upward import.
ABOVE_PROXY = ("ztunnel.proxyfactory", "ztunnel.app", "ztunnel.admin", "ztunnel.inpod", "ztunnel.__main__")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, name: str, known: dict[str, Path]) -> Iterator[str]:
    """The project modules ``path`` imports, resolved to modules (``from pkg import sub`` is ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield sub
                elif base in known:
                    yield base


def graph(prefix: str) -> dict[str, set[str]]:
    known = all_modules()
    out: dict[str, set[str]] = {}
    for name, path in known.items():
        if name == prefix or name.startswith(prefix + "."):
            out[name] = {dep for dep in imports_of(path, name, known) if dep != name}
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_proxy_has_no_import_cycles() -> None:
    # A submodule importing its own package (``from ztunnel.proxy import X``) closes a cycle through __init__.
    assert cycles(graph("ztunnel.proxy")) == []


@pytest.mark.parametrize("listener", LISTENERS)
def test_listeners_do_not_import_each_other(listener: str) -> None:
    deps = graph("ztunnel.proxy")[f"ztunnel.proxy.{listener}"]
    assert sorted(deps & {f"ztunnel.proxy.{other}" for other in LISTENERS}) == []


def test_proxy_imports_nothing_above_it() -> None:
    upward = {
        f"{mod} -> {dep}"
        for mod, deps in graph("ztunnel.proxy").items()
        for dep in deps
        if any(dep == top or dep.startswith(top + ".") for top in ABOVE_PROXY)
    }
    assert sorted(upward) == []


def test_admin_does_not_import_the_proxy() -> None:
    # The admin server shows connections as plain data the app hands it; it knows nothing of the data plane.
    deps = graph("ztunnel.admin")["ztunnel.admin"]
    assert sorted(d for d in deps if d == "ztunnel.proxy" or d.startswith("ztunnel.proxy.")) == []


def test_the_graph_reader_sees_imports() -> None:
    """The checks above are only as good as the reader: it must see the imports that are known to exist."""
    g = graph("ztunnel.proxy")
    assert "ztunnel.proxy.relay" in g["ztunnel.proxy.outbound"]
    assert "ztunnel.proxy.hbone.core" in g["ztunnel.proxy.hbone.connection"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

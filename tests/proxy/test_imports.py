"""The shape of ``ztunnel/proxy/``'s import graph (issue 15, item 2): no cycles, no sideways imports between the
listener modules, nothing above the proxy layer imported from inside it, and the admin server independent of it.

Every import counts, including those under ``TYPE_CHECKING`` and inside functions: a cycle hidden behind either is
still a cycle for the reader. The graph is read from the source (``ast``), not from ``sys.modules``, so it does not
depend on what the test run imported before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import importcheck
from tests.importcheck import cycles

ROOT = Path(__file__).resolve().parents[2]
# One module per listener, named as upstream's: none may import another (what two share lives below them).
LISTENERS = ("outbound", "inbound", "inbound_passthrough", "socks5")
# What the proxy layer is built into; importing any of it from ztunnel/proxy would be an upward import.
ABOVE_PROXY = ("ztunnel.proxyfactory", "ztunnel.app", "ztunnel.admin", "ztunnel.inpod", "ztunnel.__main__")


def graph(prefix: str) -> dict[str, set[str]]:
    return importcheck.graph(ROOT, "ztunnel", prefix)


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

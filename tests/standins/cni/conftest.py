"""Fixtures of the node agent's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.standins.cni.helpers import Ztunnel
from ztunnel.testing import netns
from ztunnel.testing.netns import Topology


@pytest.fixture
def netns_files(tmp_path: Path) -> dict[str, Path]:
    """Stand-ins for pod namespaces: the server opens and sends whatever file the pod names."""
    files = {}
    for name in ("a", "b", "c"):
        files[name] = tmp_path / f"netns-{name}"
        files[name].write_text(name)
    return files


@pytest.fixture
def clients() -> Iterator[list[Ztunnel]]:
    made: list[Ztunnel] = []
    yield made
    for c in made:
        c.close()


@pytest.fixture
def topo() -> Iterator[Topology]:
    with netns.topology(iptables=True) as t:
        yield t

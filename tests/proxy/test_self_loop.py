"""Outbound self-loop (dedicated mode): a connection to the node's own address on 15001 would be passed through to
that address, where ztunnel's own outbound listener takes it again, and again, until the fd limit (upstream's
loopback-only guard has the same gap). It is refused at the first hop, with a log line that says why.

A dedicated-mode ztunnel runs in a node network namespace (172.172.0.<n> on a bridge, root only), its listeners on
the node's own (non-loopback) address; the client connects to that address's 15001 from inside the node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from ztunnel.testing import netns as tn
from ztunnel.testing import node_env, running_app


@pytest.fixture
def topo() -> Iterator[tn.Topology]:
    with tn.topology() as t:
        yield t


async def test_connection_to_own_node_address_on_15001_is_refused(
    topo: tn.Topology, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = topo.node("n1")
    env = node_env("node-a", node.ip, "default/client/client", tmp_path / "ca")

    async def scenario() -> bytes:
        async with running_app(env):
            reader, writer = await asyncio.open_connection(node.ip, 15001)
            writer.write(b"hello")
            # Refused: closed (or reset: the bytes were never read) at once. Looping: the bytes go round through
            # ever more connections and the client never hears an end.
            try:
                got = await asyncio.wait_for(reader.read(), 10)
            except ConnectionResetError:
                got = b""
            writer.close()
            return got

    caplog.set_level(logging.INFO)
    with node.loop_thread() as lt:
        got = await lt.run(scenario())
    assert got == b""
    errors = [str(getattr(r, "fields", {}).get("error", "")) for r in caplog.records if r.name == "access"]
    refusals = [e for e in errors if "recursive call to ourselves" in e]
    # One hop, one line: it names the address so an operator sees what looped.
    assert len(refusals) == 1 == len(errors), errors
    assert f"{node.ip}:15001 is this proxy's own address" in refusals[0], refusals

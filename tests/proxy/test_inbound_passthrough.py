"""Inbound plaintext (15006): the local workload is waited for (upstream waits up to 5 s for xDS), and the
destination service is reported as upstream guesses it (the destination's services, by target port).

SO_ORIGINAL_DST is stood in for (no iptables here): each connection is treated as captured on its way to the echo
app; the namespaced tests cover real capture.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ztunnel import sockets
from ztunnel.state import StateUpdate
from ztunnel.state.workload import IPAddress
from ztunnel.testing import EchoServer, TwoNodeMesh, access_fields, eventually, running_app, scrape

SERVER_UID = "Kubernetes//v1/Pod/default/server"
ECHO_HOST = "echo.default.svc.cluster.local"


@pytest.fixture
async def node_b(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[TwoNodeMesh, Any, EchoServer]]:
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    target: tuple[IPAddress, int] = (ipaddress.ip_address(m.server_app[0]), m.server_app[1])
    monkeypatch.setattr(sockets, "accepted_destination", lambda transport, cfg: target)
    async with running_app(m.env_b()) as app:
        b: Any = app
        b.state.apply(StateUpdate(removed_policies=["default/allow-client"]))  # plaintext has no principal
        yield m, b, echo
    await echo.stop()


async def test_waits_for_the_local_workload(node_b: tuple[TwoNodeMesh, Any, EchoServer]) -> None:
    """The pod's workload is not in xDS yet when a connection arrives: it is held until the workload appears."""
    m, b, echo = node_b
    server = b.state.workloads.find_uid(SERVER_UID)
    b.state.apply(StateUpdate(removed_workloads=[SERVER_UID]))
    reader, writer = await asyncio.open_connection(m.node_b, 15006)
    writer.write(b"early")
    writer.write_eof()
    # The connection is being handled (waiting), not closed.
    assert await eventually(lambda: len(b.proxy.pi.tasks) == 1)
    b.state.apply(StateUpdate(workloads=[server]))
    try:
        got = await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        got = b""
    writer.close()
    assert got == b"early"
    assert echo.connections == 1


async def test_reports_destination_service(
    node_b: tuple[TwoNodeMesh, Any, EchoServer], caplog: pytest.LogCaptureFixture
) -> None:
    m, _, _ = node_b
    caplog.set_level(logging.INFO, logger="access")
    reader, writer = await asyncio.open_connection(m.node_b, 15006)
    writer.write(b"x")
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b"x"
    writer.close()
    lines = await eventually(lambda: access_fields(caplog.records))
    assert [f.get("dst.service") for f in lines] == [ECHO_HOST], lines
    opened = [
        labels
        for name, labels, _ in await scrape(m.node_b)
        if name == "istio_tcp_connections_opened_total" and labels.get("reporter") == "destination"
    ]
    assert [(s["destination_service"], s["destination_service_name"]) for s in opened] == [(ECHO_HOST, "echo")]
    assert opened[0]["connection_security_policy"] == "unknown"

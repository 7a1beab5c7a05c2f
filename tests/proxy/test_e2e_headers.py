"""What node B actually receives on CONNECT, and what node A gets back in the 200, between two in-process ztunnels.

The CONNECT is observed at node B's inbound (its ``ConnectRequested`` events, by wrapping ``Inbound._on_request`` on
that one instance) and the response at node A's streams (``HboneStream.on_response``); product code is unchanged.
Formats are upstream's (ztunnel-facts.md §3.2): ``baggage`` of the source workload, ``forwarded`` with the
downstream address (and ``host=`` when service-addressed), a random W3C ``traceparent``, nothing else; no
``:scheme``/``:path``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import ConnectRequested
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.testing import EchoServer, TwoNodeMesh, running_app

TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00")
CLIENT_BAGGAGE = (
    "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=client,service.name=client,"
    "service.version=v1"
)
SERVER_BAGGAGE = (
    "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=server,service.name=echo,"
    "service.version=v1"
)


class Capture:
    def __init__(self) -> None:
        self.requests: list[ConnectRequested] = []
        self.responses: list[tuple[int, dict[str, str]]] = []


@contextlib.asynccontextmanager
async def start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env_b: str
) -> AsyncIterator[tuple[TwoNodeMesh, Capture]]:
    m = TwoNodeMesh(tmp_path)
    cap = Capture()
    echo = await EchoServer().start(*m.server_app)
    original = HboneStream.on_response

    def on_response(self: HboneStream, status: int, headers: dict[str, str]) -> None:
        cap.responses.append((status, dict(headers)))
        original(self, status, headers)

    monkeypatch.setattr(HboneStream, "on_response", on_response)  # only client-role streams get responses
    try:
        async with running_app(m.env_a()), running_app(m.env_b(**env_b)) as b:
            inbound: Any = b.proxy.inbound  # type: ignore[attr-defined]
            on_request = inbound._on_request

            def record(conn: HboneTransport, stream: HboneStream, ev: ConnectRequested) -> None:
                cap.requests.append(ev)
                on_request(conn, stream, ev)

            monkeypatch.setattr(inbound, "_on_request", record)  # this one node B only
            yield m, cap
    finally:
        await echo.stop()


@pytest.fixture
async def mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[TwoNodeMesh, Capture]]:
    async with start(tmp_path, monkeypatch) as v:
        yield v


async def echo_once(m: TwoNodeMesh, host: str, port: int) -> tuple[str, int]:
    """One echoed message through node A's SOCKS5; returns the client's own address (what ``forwarded`` names)."""
    reader, writer = await m.socks5(host, port)
    src = writer.get_extra_info("sockname")
    writer.write(b"ping")
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b"ping"
    writer.close()
    return str(src[0]), int(src[1])


async def test_service_addressed_connect_headers(mesh: tuple[TwoNodeMesh, Capture]) -> None:
    m, cap = mesh
    src = await echo_once(m, *m.vip)
    (ev,) = cap.requests
    assert ev.method == "CONNECT"
    assert ev.authority == f"{m.node_b}:8080"  # the chosen endpoint and target port, not the VIP
    # Exactly these three headers: no :scheme or :path (RFC 7540 CONNECT), no x-forwarded-network (single HBONE).
    assert set(ev.headers) == {"baggage", "forwarded", "traceparent"}, ev.headers
    assert ev.headers["baggage"] == CLIENT_BAGGAGE
    assert ev.headers["forwarded"] == f'for="{src[0]}:{src[1]}";host=echo.default.svc.cluster.local'
    assert TRACEPARENT.fullmatch(ev.headers["traceparent"]), ev.headers["traceparent"]
    # The 200 node A got carries the destination workload's baggage.
    assert cap.responses == [(200, {"baggage": SERVER_BAGGAGE})]


async def test_workload_addressed_connect_has_no_host_and_new_traceparent(mesh: tuple[TwoNodeMesh, Capture]) -> None:
    m, cap = mesh
    first = await echo_once(m, *m.server_app)
    second = await echo_once(m, *m.server_app)
    assert [ev.authority for ev in cap.requests] == [f"{m.node_b}:8080"] * 2
    assert [ev.headers["forwarded"] for ev in cap.requests] == [f'for="{a}:{p}"' for a, p in (first, second)]
    assert all(ev.headers["baggage"] == CLIENT_BAGGAGE for ev in cap.requests)
    t1, t2 = (ev.headers["traceparent"] for ev in cap.requests)
    assert TRACEPARENT.fullmatch(t1) and TRACEPARENT.fullmatch(t2)
    assert t1[3:35] != t2[3:35]  # a new trace id per connection, even on one pooled HBONE connection
    assert [s for s, _ in cap.responses] == [200, 200]


async def test_no_response_baggage_when_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with start(tmp_path, monkeypatch, ENABLE_RESPONSE_BAGGAGE="false") as (m, cap):
        await echo_once(m, *m.vip)
        assert cap.requests[0].headers["baggage"] == CLIENT_BAGGAGE  # the client still sends its own
        assert cap.responses == [(200, {})]

"""The source side's ``response_flags`` when the HBONE server fails our CONNECT after the connection was made.

Upstream counts an HTTP/2 error on its CONNECT (the stream reset, or the connection gone before the answer) as
``H2_HANDSHAKE_FAILURE`` (``proxy/metrics.rs`` maps ``Error::H2``; seen on its binary against a server that resets the
stream and one that closes the connection). Node A is a real ztunnel; "node B" is our HTTP/2 core over TLS on B's
15008 with the server's certificate from the mesh CA, which answers each CONNECT by resetting it or by closing.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from pathlib import Path

import pytest

from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.core import ConnectRequested, ErrorCode, HboneConnection
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.testing import TwoNodeMesh, running_app, scrape


async def failed_at_source(node_ip: str) -> list[str]:
    return [
        labels["response_flags"]
        for name, labels, value in await scrape(node_ip)
        if name == "istio_tcp_connections_failed_total" and value and labels["reporter"] == "source"
    ]


@pytest.mark.parametrize("answer", ["reset", "close"])
async def test_a_connect_the_server_resets_or_drops_is_an_h2_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, answer: str
) -> None:
    m = TwoNodeMesh(tmp_path)
    caplog.set_level(logging.INFO, logger="access")
    requests: list[str] = []

    def on_connect(t: HboneTransport, stream: HboneStream, ev: ConnectRequested) -> None:
        requests.append(ev.authority)
        if answer == "reset":
            stream.reset(ErrorCode.REFUSED_STREAM)
        else:
            t.abort("fake node B drops the connection")

    async with running_app(m.env_a()):
        ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")  # node A has created the mesh CA by now
        cert = ca.issue(Identity("cluster.local", "default", "server"), timedelta(hours=1))
        ctx = tls.server_context(cert)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: HboneTransport(
                HboneConnection(False), ctx, on_handshake=lambda t: None, on_connect_request=on_connect
            ),
            m.node_b,
            15008,
        )
        async with server:
            with pytest.raises(ConnectionError):
                await m.socks5()
            flags: list[str] = []
            for _ in range(100):  # the record lands a moment after the client saw the refusal
                flags = await failed_at_source(m.node_a)
                if flags:
                    break
                await asyncio.sleep(0.02)
    errors = [str(getattr(r, "fields", {}).get("error", "")) for r in caplog.records]
    assert len(requests) == 1  # the CONNECT reached the server: the failure is HTTP/2's, after the handshake
    assert flags == ["H2_HANDSHAKE_FAILURE"], errors
    assert any("HBONE stream failed" in e for e in errors), errors

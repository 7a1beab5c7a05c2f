"""The source side's ``response_flags`` for failed outbound HBONE connections, this project against upstream
(``make interop-upstream``).

The client's ztunnel (ours, then upstream's) dials a fake server on the server node's 15008: TLS with a certificate
of the wrong identity or from another root, or an HTTP/2 server (the h2 library) that resets the CONNECT or drops
the connection. Each failure must carry the same flag at the source in both implementations (upstream: CONNECT for
a failed handshake, H2_HANDSHAKE_FAILURE for an HTTP/2 error).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest

from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.testing.interop import APP_PORT, Impl, InteropMesh, Mode, require_upstream

pytestmark = pytest.mark.root

SERVER = Identity("cluster.local", "default", "server")
OTHER = Identity("cluster.local", "default", "other")
SCENARIOS = ["wrong-identity", "other-root", "reset", "dropped"]


async def _serve(sock: object, ctx: ssl.SSLContext, scenario: str) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        try:
            writer.write(conn.data_to_send())
            while data := await reader.read(65536):
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.RequestReceived):
                        if scenario == "reset":
                            conn.reset_stream(ev.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                        else:
                            writer.transport.abort()
                            return
                writer.write(conn.data_to_send())
        except (OSError, ssl.SSLError, h2.exceptions.ProtocolError):
            pass  # the client refused our certificate: what the wrong-identity and other-root cases want
        finally:
            writer.close()

    return await asyncio.start_server(handle, sock=sock, ssl=ctx)


async def _close(server: asyncio.Server) -> None:
    server.close()
    await server.wait_closed()


def _flags_at_source(mesh: InteropMesh, scenario: str, work: Path) -> list[str]:
    """Node1's failed-connection flags after one attempt to the fake server of ``scenario``."""
    mesh.ztunnels.pop("node2").stop()  # its 15008 is the fake's now
    ca_dir = mesh.ca_dir if scenario != "other-root" else work / "other-ca"
    cert = LocalCA.load_or_create(ca_dir, "cluster.local").issue(
        OTHER if scenario == "wrong-identity" else SERVER, timedelta(hours=1)
    )
    (work / "cert.pem").write_text(cert.chain_pem())
    (work / "key.pem").write_text(cert.key_pem())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(work / "cert.pem", work / "key.pem")
    ctx.load_verify_locations(mesh.ca_dir / "root-cert.pem")
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    listener = mesh.nodes["node2"].listen_tcp(mesh.server_ip, 15008)
    server = mesh.apps.call(_serve(listener, ctx, scenario))
    try:
        outcome = mesh.attempt(mesh.server_ip, APP_PORT)
        assert outcome != "connected", outcome
        flags: list[str] = []
        deadline = time.monotonic() + 10
        while not flags and time.monotonic() < deadline:  # the record lands a moment after the client saw the end
            flags = [
                s.labels["response_flags"]
                for s in mesh.scrape("node1")
                if s.name == "istio_tcp_connections_failed_total" and s.value and s.labels["reporter"] == "source"
            ]
            time.sleep(0.05)
        return flags
    finally:
        with contextlib.suppress(Exception):
            mesh.apps.call(_close(server))
        listener.close()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InteropMesh]:
    upstream = require_upstream()
    m = InteropMesh(Mode.DEDICATED, tmp_path_factory.mktemp("flags"), upstream)
    try:
        yield m
    finally:
        m.close()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_failed_outbound_connections_carry_upstreams_flags(
    mesh: InteropMesh, tmp_path: Path, scenario: str, request: pytest.FixtureRequest
) -> None:
    seen: dict[Impl, list[str]] = {}
    for impl in (Impl.UPSTREAM, Impl.OURS):
        work = tmp_path / str(impl)
        work.mkdir()
        mesh.start(impl, Impl.OURS)
        try:
            seen[impl] = _flags_at_source(mesh, scenario, work)
        finally:
            request.node.add_report_section("call", f"node1 ({impl}) log", mesh.log_text("node1"))
            mesh.stop()
    assert seen[Impl.UPSTREAM], "upstream counted no failure"
    assert seen[Impl.OURS] == seen[Impl.UPSTREAM], seen

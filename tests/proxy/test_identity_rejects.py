"""Identities that must not get in: each is refused, the reason is logged, and metrics carry the response flag.

Node B (inbound) faces raw HBONE clients holding bad certificates; node A (outbound) faces a node B that presents
the wrong identity. Real TLS handshakes against real ztunnels; certificates are built to deviate in one way each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from tests.identity.certs import build_leaf
from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity
from ztunnel.testing import EchoServer, TwoNodeMesh, hbone_dial, hbone_request, node_env, running_app, scrape

CLIENT = Identity("cluster.local", "default", "client")
OTHER = Identity("cluster.local", "default", "someone-else")


async def failed(node_ip: str) -> list[dict[str, str]]:
    """Label sets of the istio_tcp_connections_failed_total samples on a node's stats port."""
    return [
        labels
        for name, labels, value in await scrape(node_ip)
        if name == "istio_tcp_connections_failed_total" and value
    ]


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[tuple[TwoNodeMesh, LocalCA, EchoServer]]:
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    async with running_app(m.env_a()), running_app(m.env_b()):
        yield m, LocalCA.load_or_create(m.ca_dir, "cluster.local"), echo
    await echo.stop()


def expired(ca: LocalCA) -> WorkloadCertificate:
    return ca.issue(CLIENT, timedelta(hours=1), now=datetime.now(UTC) - timedelta(days=2))


def not_yet_valid(ca: LocalCA) -> WorkloadCertificate:
    return ca.issue(CLIENT, timedelta(hours=1), now=datetime.now(UTC) + timedelta(days=2))


def other_trust_domain(ca: LocalCA) -> WorkloadCertificate:
    return ca.issue(Identity("evil.example", "default", "client"), timedelta(hours=1))


def two_sans(ca: LocalCA) -> WorkloadCertificate:
    return build_leaf(ca, uris=[str(OTHER), str(CLIENT)])


def unknown_root(ca: LocalCA) -> WorkloadCertificate:
    stranger = LocalCA.generate("cluster.local")  # same trust domain, different root: the chain does not verify
    cert = stranger.issue(CLIENT, timedelta(hours=1))
    # Trust the mesh's root for the server, so only the *server's* check of our chain can fail.
    return WorkloadCertificate(
        cert=cert.cert, intermediates=cert.intermediates, roots=(ca.root_cert,), private_key=cert.private_key
    )


def ca_leaf(ca: LocalCA) -> WorkloadCertificate:
    """A CA certificate (basicConstraints CA:TRUE) carrying the client's identity: webpki's CaUsedAsEndEntity."""
    return build_leaf(ca, uris=[str(CLIENT)], basic_constraints=x509.BasicConstraints(ca=True, path_length=None))


CASES = {
    "expired": (expired, "TLS_FAILURE", "expired"),
    "not yet valid": (not_yet_valid, "TLS_FAILURE", "not yet valid"),
    "unknown root": (unknown_root, "TLS_FAILURE", "unable to get local issuer certificate"),
    "other trust domain": (other_trust_domain, "IDENTITY_ERROR", "not in trust domain"),
    "two SPIFFE SANs": (two_sans, "IDENTITY_ERROR", "2 SPIFFE identities"),
    "CA certificate as leaf": (ca_leaf, "TLS_FAILURE", "CA certificate (basicConstraints CA:TRUE)"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_bad_client_certificate_is_refused(
    mesh: tuple[TwoNodeMesh, LocalCA, EchoServer], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    m, ca, echo = mesh
    make, flag, reason = CASES[case]
    caplog.set_level(logging.INFO, logger="access")
    with pytest.raises(ConnectionError):
        conn: Any = await hbone_dial((m.node_b, 15008), make(ca))
        await hbone_request(conn, f"{m.server_app[0]}:{m.server_app[1]}")
    await asyncio.sleep(0.1)
    assert echo.connections == 0
    lines = [
        str(getattr(r, "fields", {}).get("error", ""))
        for r in caplog.records
        if r.getMessage() in ("connection failed", "connection complete")
    ]
    assert any(reason.lower() in line.lower() for line in lines), lines
    samples = await failed(m.node_b)
    flags = [s["response_flags"] for s in samples if s["reporter"] == "destination"]
    assert flags == [flag], samples


@pytest.mark.parametrize("case", ["other trust domain", "unknown root"])
async def test_failed_handshake_from_a_workload_ip_is_not_that_workload(
    mesh: tuple[TwoNodeMesh, LocalCA, EchoServer], case: str
) -> None:
    """A handshake refused from the client workload's own IP (a certificate of another trust domain, or one that
    does not verify) proves nothing about who the peer is: the failed connection's source labels are unknown, never
    the workload that owns the IP (as for an accepted peer whose certificate is not that workload's)."""
    m, ca, _ = mesh
    make, flag, _ = CASES[case]
    with pytest.raises(ConnectionError):
        conn: Any = await hbone_dial((m.node_b, 15008), make(ca), local_addr=(m.node_a, 0))
        await hbone_request(conn, f"{m.server_app[0]}:{m.server_app[1]}")
    await asyncio.sleep(0.1)
    (sample,) = [s for s in await failed(m.node_b) if s["reporter"] == "destination"]
    assert sample["response_flags"] == flag
    for label in ("source_workload", "source_workload_namespace", "source_canonical_service", "source_principal"):
        assert sample[label] == "unknown", (label, sample)


async def test_pod_presenting_another_pods_certificate(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With ZTUNNEL_VERIFY_SOURCE_IDENTITY=true: from the client workload's own IP, with a valid certificate of another
    identity: 401, IDENTITY_ERROR. (By default it is accepted as upstream does, without the IP's workload:
    tests/proxy/test_inbound_source.py.)"""
    m = TwoNodeMesh(tmp_path)
    caplog.set_level(logging.INFO, logger="access")
    echo = await EchoServer().start(*m.server_app)
    try:
        async with running_app(m.env_a()), running_app(m.env_b(ZTUNNEL_VERIFY_SOURCE_IDENTITY="true")):
            ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
            conn: Any = await hbone_dial(
                (m.node_b, 15008), ca.issue(OTHER, timedelta(hours=1)), local_addr=(m.node_a, 0)
            )
            status, _ = await hbone_request(conn, f"{m.server_app[0]}:{m.server_app[1]}")
            conn.close("test done")
            assert status == 401
            assert echo.connections == 0
            errors = [str(getattr(r, "fields", {}).get("error", "")) for r in caplog.records]
            assert any("identity mismatch" in e and str(OTHER) in e and "default/client" in e for e in errors), errors
            flags = [s["response_flags"] for s in await failed(m.node_b) if s["reporter"] == "destination"]
            assert flags == ["IDENTITY_ERROR"]
            # The control: the same IP with its own identity gets through.
            conn = await hbone_dial((m.node_b, 15008), ca.issue(CLIENT, timedelta(hours=1)), local_addr=(m.node_a, 0))
            status, _ = await hbone_request(conn, f"{m.server_app[0]}:{m.server_app[1]}")
            conn.close("test done")
            assert status == 200
    finally:
        await echo.stop()


async def test_server_presenting_the_wrong_identity(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Outbound: node B serves a certificate for an identity node A does not expect: refused, counted CONNECT at the
    source as upstream does (its client handshake fails as an I/O error), the reason in the log."""
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    caplog.set_level(logging.INFO, logger="access")
    # Node B believes the server runs as "impostor" and serves that certificate; node A expects "server".
    impostor = tmp_path / "impostor.yaml"
    impostor.write_text(m.config.read_text().replace("serviceAccount: server", "serviceAccount: impostor"))
    env_b = node_env("node-b", m.node_b, "default/server/impostor", m.ca_dir, impostor)
    async with running_app(m.env_a()), running_app(env_b):
        with pytest.raises(ConnectionError):
            await m.socks5()
        await asyncio.sleep(0.1)
        flags = [s["response_flags"] for s in await failed(m.node_a) if s["reporter"] == "source"]
    await echo.stop()
    errors = [str(getattr(r, "fields", {}).get("error", "")) for r in caplog.records]
    assert flags == ["CONNECT"], errors
    assert echo.connections == 0
    assert any("do not match the expected identities" in e for e in errors), errors


async def test_server_presenting_a_ca_certificate(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Outbound: "node B" is a TLS server on B's 15008 whose leaf, for the right identity and from the mesh CA, is
    a CA certificate (CA:TRUE). Node A refuses it as webpki does (CaUsedAsEndEntity): counted CONNECT at the source
    as upstream does, the reason in the log, nothing sent."""
    m = TwoNodeMesh(tmp_path)
    caplog.set_level(logging.INFO, logger="access")
    received: list[bytes] = []

    async def fake_node_b(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read(65536))  # the HTTP/2 preface would arrive here if A went on
        writer.close()

    async with running_app(m.env_a()):
        ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")  # node A has created the mesh CA by now
        leaf = build_leaf(
            ca,
            uris=[str(Identity("cluster.local", "default", "server"))],
            basic_constraints=x509.BasicConstraints(ca=True, path_length=None),
        )
        server = await asyncio.start_server(fake_node_b, m.node_b, 15008, ssl=tls.server_context(leaf))
        async with server:
            with pytest.raises(ConnectionError):
                await m.socks5()
            await asyncio.sleep(0.1)
            flags = [s["response_flags"] for s in await failed(m.node_a) if s["reporter"] == "source"]
    errors = [str(getattr(r, "fields", {}).get("error", "")) for r in caplog.records]
    assert flags == ["CONNECT"], errors
    assert any("CA certificate (basicConstraints CA:TRUE)" in e and "CaUsedAsEndEntity" in e for e in errors), errors
    assert received in ([], [b""]), received  # A closed without sending a byte of HTTP/2

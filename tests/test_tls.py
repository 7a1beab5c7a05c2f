"""Real mTLS handshakes over loopback between contexts built by :mod:`ztunnel.tls`.

Clients use asyncio's own TLS (``open_connection(ssl=client_ctx)``). The server side of :func:`connect` drives an
``ssl.SSLObject`` over memory BIOs on a plain TCP stream (:func:`accept_tls`) instead of
``start_server(ssl=...)``: same OpenSSL handshake, but the server's handshake exception reaches the test
(asyncio only logs it), so each test can assert *why* the server refused. One test also runs asyncio's own
TLS server to cover that path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.identity.certs import build_crl, build_intermediate, build_leaf
from ztunnel.crl import CrlSet, parse_crls
from ztunnel.identity import Identity, LocalCA, WorkloadCertificate
from ztunnel.tls import (
    TLS12_CIPHERS,
    TLS13_CIPHERSUITES,
    AlpnMismatch,
    CaUsedAsEndEntity,
    CertificateRevoked,
    HandshakeFailed,
    IdentityMismatch,
    MissingPeerCertificate,
    MultipleIdentities,
    TlsConfigError,
    TrustDomainMismatch,
    client_context,
    handshake_error,
    peer_chain,
    server_context,
    set_tls13_ciphersuites,
    verify_client_identity,
    verify_server_identity,
)

TD = "cluster.local"
SERVER_ID = Identity(TD, "default", "server")
CLIENT_ID = Identity(TD, "default", "client")
HOUR = timedelta(hours=1)

# X509_V_ERR_* codes
CERT_HAS_EXPIRED = 10
SELF_SIGNED_CERT_IN_CHAIN = 19
UNABLE_TO_GET_ISSUER_CERT_LOCALLY = 20
INVALID_PURPOSE = 26


@pytest.fixture(scope="module")
def ca() -> LocalCA:
    return LocalCA.generate(TD)


@pytest.fixture(scope="module")
def server_cert(ca: LocalCA) -> WorkloadCertificate:
    return ca.issue(SERVER_ID, HOUR)


@pytest.fixture(scope="module")
def client_cert(ca: LocalCA) -> WorkloadCertificate:
    return ca.issue(CLIENT_ID, HOUR)


@dataclass
class Outcome:
    """What each side of one connection saw."""

    server_identity: Identity | None = None
    server_error: BaseException | None = None
    client_identity: Identity | None = None
    client_error: BaseException | None = None
    client_received: bytes = b""
    version: str | None = None
    cipher: str | None = None
    alpn: str | None = None
    client_has_ticket: bool | None = None

    def assert_ok(self) -> None:
        assert self.server_error is None, repr(self.server_error)
        assert self.client_error is None, repr(self.client_error)


@dataclass
class ServerTls:
    """The server end of :func:`connect`: an ``SSLObject`` over memory BIOs on a plain TCP stream."""

    obj: ssl.SSLObject
    incoming: ssl.MemoryBIO
    outgoing: ssl.MemoryBIO
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def send(self, data: bytes) -> None:
        self.obj.write(data)
        self.writer.write(self.outgoing.read())

    async def wait_closed_by_client(self) -> None:
        """Discard data until the client's close_notify, answer it (asyncio's client waits for it), or EOF."""
        while True:
            try:
                while self.obj.read(65536):
                    pass
            except ssl.SSLWantReadError:
                # Records may already be buffered from the handshake's last read, hence read() before recv.
                data = await self.reader.read(65536)
                if not data:
                    return
                self.incoming.write(data)
                continue
            # read() returned b"": the client's close_notify arrived.
            with contextlib.suppress(ssl.SSLError):
                self.obj.unwrap()
            self.writer.write(self.outgoing.read())
            return


async def accept_tls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ctx: ssl.SSLContext) -> ServerTls:
    """Server-side handshake; raises the ``ssl`` error after sending any alert to the client."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_side=True)
    try:
        while True:
            try:
                obj.do_handshake()
                return ServerTls(obj, incoming, outgoing, reader, writer)
            except ssl.SSLWantReadError:
                pass
            writer.write(outgoing.read())
            data = await reader.read(65536)
            if data:
                incoming.write(data)
            else:
                incoming.write_eof()
    finally:
        writer.write(outgoing.read())  # our last flight, an alert, or post-handshake tickets


async def connect(
    server_ctx: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    *,
    server_trust_domain: str = TD,
    expected: Collection[Identity] = (SERVER_ID,),
) -> Outcome:
    """One HBONE-style TLS connection: handshake, post-handshake checks, server sends the client identity."""
    out = Outcome()
    server_done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            tls = await accept_tls(reader, writer, server_ctx)
            out.server_identity = verify_client_identity(tls.obj, server_trust_domain)
            tls.send(f"{out.server_identity}\n".encode())
            await writer.drain()
            await tls.wait_closed_by_client()
        except Exception as e:
            out.server_error = e
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            server_done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, asyncio.timeout(10):
        try:
            # server_hostname="": asyncio would otherwise default it to the host; "" means no SNI at all.
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx, server_hostname="")
        except Exception as e:
            out.client_error = e
        else:
            try:
                ssl_obj = writer.get_extra_info("ssl_object")
                out.version, out.alpn = ssl_obj.version(), ssl_obj.selected_alpn_protocol()
                out.cipher = ssl_obj.cipher()[0]
                out.client_identity = verify_server_identity(ssl_obj, expected)
                out.client_received = await reader.readline()
                if not out.client_received:
                    raise ConnectionResetError("server closed the connection")
                out.client_has_ticket = ssl_obj.session.has_ticket
            except Exception as e:
                out.client_error = e
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        await server_done.wait()
    return out


def bare_client_context(roots: WorkloadCertificate) -> ssl.SSLContext:
    """A client trusting our roots and offering h2 but presenting no certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=roots.roots_pem())
    ctx.set_alpn_protocols(["h2"])
    return ctx


# --- success ------------------------------------------------------------------------------------------------------


async def test_mutual_tls_between_workloads_of_one_ca(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    out = await connect(server_context(server_cert), client_context(client_cert))
    out.assert_ok()
    assert out.server_identity == CLIENT_ID
    assert out.client_identity == SERVER_ID
    assert out.client_received == f"{CLIENT_ID}\n".encode()
    assert out.version == "TLSv1.3"
    assert out.cipher in TLS13_CIPHERSUITES
    assert out.alpn == "h2"


async def test_asyncio_tls_server(server_cert: WorkloadCertificate, client_cert: WorkloadCertificate) -> None:
    # The product's listener path: asyncio's own TLS server with our context, checks in the connection callback.
    seen: list[Identity] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        identity = verify_client_identity(writer.get_extra_info("ssl_object"), TD)
        seen.append(identity)
        writer.write(f"{identity}\n".encode())
        await reader.read()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context(server_cert))
    port = server.sockets[0].getsockname()[1]
    async with server, asyncio.timeout(10):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_context(client_cert), server_hostname=""
        )
        assert verify_server_identity(writer.get_extra_info("ssl_object"), [SERVER_ID]) == SERVER_ID
        assert await reader.readline() == f"{CLIENT_ID}\n".encode()
        writer.close()
        await writer.wait_closed()
    assert seen == [CLIENT_ID]


async def test_chain_with_intermediate(ca: LocalCA) -> None:
    inter = build_intermediate(ca)

    def via_intermediate(identity: Identity) -> WorkloadCertificate:
        leaf = inter.issue(identity, HOUR)
        return WorkloadCertificate(
            cert=leaf.cert, intermediates=[inter.root_cert], roots=[ca.root_cert], private_key=leaf.private_key
        )

    out = await connect(server_context(via_intermediate(SERVER_ID)), client_context(via_intermediate(CLIENT_ID)))
    out.assert_ok()
    assert out.server_identity == CLIENT_ID


async def test_multi_root_bundle_trusts_both_roots(ca: LocalCA) -> None:
    other = LocalCA.generate(TD)
    # istiod's shape: the last cert_chain element is the root bundle, here two concatenated roots.
    bundle = ca.root_pem() + other.root_pem()

    def with_bundle(wc: WorkloadCertificate) -> WorkloadCertificate:
        return WorkloadCertificate.from_pem_chain([wc.chain_pem(), bundle], wc.key_pem())

    server = with_bundle(ca.issue(SERVER_ID, HOUR))
    client = with_bundle(other.issue(CLIENT_ID, HOUR))  # signed by the second root
    out = await connect(server_context(server), client_context(client))
    out.assert_ok()


async def test_peer_with_two_spiffe_sans_is_refused(
    ca: LocalCA, server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    # Upstream would accept this (one SAN in our trust domain) and use the *other* one as the peer identity: the
    # ambiguity is why a certificate naming two identities is refused here (tls._single_identity).
    client = build_leaf(ca, uris=["spiffe://other.domain/ns/default/sa/client", str(CLIENT_ID)])
    out = await connect(server_context(server_cert), client_context(client))
    assert isinstance(out.server_error, MultipleIdentities)
    assert "2 SPIFFE identities" in str(out.server_error)
    # The same on the client side: a server certificate naming two identities is refused even if one is expected.
    server = build_leaf(ca, uris=[str(SERVER_ID), "spiffe://cluster.local/ns/default/sa/other"])
    out = await connect(server_context(server), client_context(client_cert), expected={SERVER_ID})
    assert isinstance(out.client_error, MultipleIdentities)


async def test_one_spiffe_san_among_other_uris_is_fine(ca: LocalCA, server_cert: WorkloadCertificate) -> None:
    client = build_leaf(ca, uris=["https://example.com/not-an-identity", str(CLIENT_ID)])
    out = await connect(server_context(server_cert), client_context(client))
    out.assert_ok()
    assert out.server_identity == CLIENT_ID


# --- context settings ---------------------------------------------------------------------------------------------


def test_context_settings(server_cert: WorkloadCertificate) -> None:
    for make in (server_context, client_context):
        ctx = make(server_cert)
        names = [c["name"] for c in ctx.get_ciphers()]
        assert sorted(c["name"] for c in ctx.get_ciphers() if c["protocol"] == "TLSv1.3") == sorted(TLS13_CIPHERSUITES)
        assert set(names) <= set(TLS13_CIPHERSUITES) | set(TLS12_CIPHERS)
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.check_hostname is False
        assert ctx.options & ssl.OP_NO_TICKET
        assert ctx.cert_store_stats()["x509_ca"] == 1  # our root only, no system roots
        assert make(server_cert, tls12_enabled=True).minimum_version == ssl.TLSVersion.TLSv1_2
    assert server_context(server_cert).num_tickets == 0


def test_building_contexts_leaks_no_file_descriptors(server_cert: WorkloadCertificate) -> None:
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(20):
        server_context(server_cert)
        client_context(server_cert)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_unknown_tls13_suite_is_refused(server_cert: WorkloadCertificate) -> None:
    ctx = client_context(server_cert)
    with pytest.raises(TlsConfigError, match="TLS_NOT_A_SUITE"):
        set_tls13_ciphersuites(ctx, ["TLS_NOT_A_SUITE"])


# --- rejections ---------------------------------------------------------------------------------------------------


async def test_client_without_certificate_is_rejected(server_cert: WorkloadCertificate) -> None:
    out = await connect(server_context(server_cert), bare_client_context(server_cert))
    assert isinstance(out.server_error, ssl.SSLError)
    assert out.server_error.reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE"
    assert "sent no certificate" in str(handshake_error(out.server_error))
    assert out.client_received == b""
    # TLS 1.3: the client finishes first and learns of the rejection from the alert on its first read.
    assert isinstance(out.client_error, ssl.SSLError)
    assert "client certificate" in str(handshake_error(out.client_error))


async def test_missing_certificate_is_caught_after_handshake_too(server_cert: WorkloadCertificate) -> None:
    # Defence in depth: even if a caller relaxed verify_mode, the identity check refuses an anonymous client.
    ctx = server_context(server_cert)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    out = await connect(ctx, bare_client_context(server_cert))
    assert isinstance(out.server_error, MissingPeerCertificate)


async def test_client_from_another_trust_domain_is_rejected(ca: LocalCA, server_cert: WorkloadCertificate) -> None:
    client = ca.issue(Identity("other.domain", "default", "client"), HOUR)  # same root, other trust domain
    out = await connect(server_context(server_cert), client_context(client))
    assert isinstance(out.server_error, TrustDomainMismatch)
    message = str(out.server_error)
    assert "spiffe://other.domain/ns/default/sa/client" in message and "'cluster.local'" in message
    assert out.server_identity is None


async def test_client_without_spiffe_san_is_rejected(ca: LocalCA, server_cert: WorkloadCertificate) -> None:
    client = build_leaf(ca, dns=["client.example.com"])
    out = await connect(server_context(server_cert), client_context(client))
    assert isinstance(out.server_error, TrustDomainMismatch)
    assert "no SPIFFE identity" in str(out.server_error)


@pytest.mark.parametrize("side", ["client", "server"])
async def test_expired_certificate_is_rejected(
    ca: LocalCA, server_cert: WorkloadCertificate, client_cert: WorkloadCertificate, side: str
) -> None:
    past = datetime.now(UTC) - timedelta(days=2)
    if side == "client":
        out = await connect(server_context(server_cert), client_context(ca.issue(CLIENT_ID, HOUR, now=past)))
        verify_error = out.server_error
    else:
        out = await connect(server_context(ca.issue(SERVER_ID, HOUR, now=past)), client_context(client_cert))
        verify_error = out.client_error
    assert isinstance(verify_error, ssl.SSLCertVerificationError)
    assert verify_error.verify_code == CERT_HAS_EXPIRED
    assert "has expired" in str(handshake_error(verify_error))
    assert out.client_received == b""


async def test_server_identity_not_expected(server_cert: WorkloadCertificate, client_cert: WorkloadCertificate) -> None:
    wanted = Identity(TD, "default", "reviews")
    out = await connect(server_context(server_cert), client_context(client_cert), expected={wanted})
    assert isinstance(out.client_error, IdentityMismatch)
    assert str(SERVER_ID) in str(out.client_error) and str(wanted) in str(out.client_error)
    assert out.client_received == b""


@pytest.mark.parametrize("side", ["client", "server"])
async def test_certificate_from_another_root_is_rejected(
    ca: LocalCA, server_cert: WorkloadCertificate, client_cert: WorkloadCertificate, side: str
) -> None:
    # Same trust domain and even the same root subject name, different root key: like two clusters that each
    # generated their own self-signed istiod CA. The stranger's leaf is paired with *our* roots so that only
    # the peer's verification can fail.
    stranger = LocalCA.generate(TD)

    def stranger_leaf(identity: Identity) -> WorkloadCertificate:
        leaf = stranger.issue(identity, HOUR)
        return WorkloadCertificate(leaf.cert, (), [ca.root_cert], leaf.private_key)

    if side == "client":
        out = await connect(server_context(server_cert), client_context(stranger_leaf(CLIENT_ID)))
        verify_error = out.server_error
    else:
        out = await connect(server_context(stranger_leaf(SERVER_ID)), client_context(client_cert))
        verify_error = out.client_error
    assert isinstance(verify_error, ssl.SSLCertVerificationError)
    # OpenSSL finds our root by (equal) name, then the signature check fails: "self-signed certificate in
    # certificate chain" (19); with a differently named root it is "unable to get local issuer" (20).
    assert verify_error.verify_code in (SELF_SIGNED_CERT_IN_CHAIN, UNABLE_TO_GET_ISSUER_CERT_LOCALLY)
    assert "same mesh CA" in str(handshake_error(verify_error))
    assert out.client_received == b""


async def test_openssl_checks_client_auth_eku_on_the_server(ca: LocalCA, server_cert: WorkloadCertificate) -> None:
    client = build_leaf(ca, uris=[str(CLIENT_ID)], eku=[ExtendedKeyUsageOID.SERVER_AUTH])
    out = await connect(server_context(server_cert), client_context(client))
    assert isinstance(out.server_error, ssl.SSLCertVerificationError)
    assert out.server_error.verify_code == INVALID_PURPOSE
    assert "extended key usage" in str(handshake_error(out.server_error))


async def test_openssl_checks_server_auth_eku_on_the_client(ca: LocalCA, client_cert: WorkloadCertificate) -> None:
    server = build_leaf(ca, uris=[str(SERVER_ID)], eku=[ExtendedKeyUsageOID.CLIENT_AUTH])
    out = await connect(server_context(server), client_context(client_cert))
    assert isinstance(out.client_error, ssl.SSLCertVerificationError)
    assert out.client_error.verify_code == INVALID_PURPOSE


async def test_alpn_other_than_h2_is_rejected(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    client = client_context(client_cert)
    client.set_alpn_protocols(["http/1.1"])
    out = await connect(server_context(server_cert), client)
    # OpenSSL completes the handshake without ALPN when there is no overlap; the post-handshake check catches it.
    assert isinstance(out.server_error, AlpnMismatch)
    assert isinstance(out.client_error, AlpnMismatch)
    assert "None" in str(out.server_error)


# webpki's rule for the end entity (verify_cert.rs check_basic_constraints, Role::EndEntity): basicConstraints
# cA=TRUE is refused (CaUsedAsEndEntity); an absent extension reads as cA=FALSE and is accepted, with or without a
# pathLenConstraint. OpenSSL accepts all of these, so the check runs after the handshake.
CA_LEAF = x509.BasicConstraints(ca=True, path_length=None)
ACCEPTED_LEAVES = {
    "CA:FALSE": x509.BasicConstraints(ca=False, path_length=None),
    "no basicConstraints": None,
}


async def test_client_certificate_with_ca_true_is_refused(ca: LocalCA, server_cert: WorkloadCertificate) -> None:
    client = build_leaf(ca, uris=[str(CLIENT_ID)], basic_constraints=CA_LEAF)
    out = await connect(server_context(server_cert), client_context(client))
    assert isinstance(out.server_error, CaUsedAsEndEntity), repr(out.server_error)
    assert isinstance(out.server_error, HandshakeFailed)  # a TLS failure (TLS_FAILURE), as webpki's is
    assert "CA certificate" in str(out.server_error) and "CaUsedAsEndEntity" in str(out.server_error)
    assert out.server_identity is None


async def test_server_certificate_with_ca_true_is_refused(ca: LocalCA, client_cert: WorkloadCertificate) -> None:
    server = build_leaf(ca, uris=[str(SERVER_ID)], basic_constraints=CA_LEAF)
    out = await connect(server_context(server), client_context(client_cert))
    assert isinstance(out.client_error, CaUsedAsEndEntity), repr(out.client_error)
    assert out.client_identity is None and out.client_received == b""


@pytest.mark.parametrize("kind", list(ACCEPTED_LEAVES))
async def test_leaf_without_ca_flag_is_accepted_both_ways(
    ca: LocalCA, server_cert: WorkloadCertificate, client_cert: WorkloadCertificate, kind: str
) -> None:
    constraints = ACCEPTED_LEAVES[kind]
    client = build_leaf(ca, uris=[str(CLIENT_ID)], basic_constraints=constraints)
    out = await connect(server_context(server_cert), client_context(client))
    out.assert_ok()
    assert out.server_identity == CLIENT_ID
    server = build_leaf(ca, uris=[str(SERVER_ID)], basic_constraints=constraints)
    out = await connect(server_context(server), client_context(client_cert))
    out.assert_ok()
    assert out.client_identity == SERVER_ID


# --- versions and cipher suites -----------------------------------------------------------------------------------


async def test_tls12_client_needs_tls12_enabled(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    client = client_context(client_cert, tls12_enabled=True)
    client.maximum_version = ssl.TLSVersion.TLSv1_2

    refused = await connect(server_context(server_cert), client)
    assert isinstance(refused.server_error, ssl.SSLError)
    assert refused.server_error.reason == "UNSUPPORTED_PROTOCOL"
    assert "TLS12_ENABLED" in str(handshake_error(refused.server_error))

    accepted = await connect(server_context(server_cert, tls12_enabled=True), client)
    accepted.assert_ok()
    assert accepted.version == "TLSv1.2"
    assert accepted.cipher == "ECDHE-ECDSA-AES256-GCM-SHA384"
    assert accepted.server_identity == CLIENT_ID


async def test_chacha20_only_client_is_rejected(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    client = client_context(client_cert)
    set_tls13_ciphersuites(client, ["TLS_CHACHA20_POLY1305_SHA256"])

    out = await connect(server_context(server_cert), client)
    assert isinstance(out.server_error, ssl.SSLError)
    assert out.server_error.reason == "NO_SHARED_CIPHER"
    assert "TLS_AES_256_GCM_SHA384" in str(handshake_error(out.server_error))

    # Control: the same client succeeds once the server allows ChaCha20, so the restriction is what refused it.
    permissive = server_context(server_cert)
    set_tls13_ciphersuites(permissive, [*TLS13_CIPHERSUITES, "TLS_CHACHA20_POLY1305_SHA256"])
    control = await connect(permissive, client)
    control.assert_ok()
    assert control.cipher == "TLS_CHACHA20_POLY1305_SHA256"


# --- SNI and resumption -------------------------------------------------------------------------------------------


async def test_client_sends_no_sni(server_cert: WorkloadCertificate, client_cert: WorkloadCertificate) -> None:
    seen: list[str | None] = []
    server = server_context(server_cert)
    server.sni_callback = lambda _obj, name, _ctx: seen.append(name)
    (await connect(server, client_context(client_cert))).assert_ok()
    assert seen == [None]


async def test_server_issues_no_session_ticket(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    out = await connect(server_context(server_cert), client_context(client_cert))
    out.assert_ok()
    assert out.client_has_ticket is False

    # Control: with tickets re-enabled the same harness does see one.
    ticketing = server_context(server_cert)
    ticketing.num_tickets = 2
    control = await connect(ticketing, client_context(client_cert))
    control.assert_ok()
    assert control.client_has_ticket is True


def session_resumed_in_memory(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, session: ssl.SSLSession | None
) -> tuple[bool, ssl.SSLSession]:
    """One connection between two SSLObjects over memory BIOs, offering ``session``; closed cleanly.

    Returns whether the session was resumed, and the session to offer next time. The orderly shutdown matters:
    OpenSSL drops a session from the server cache when a connection is freed without one.
    """
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=None, session=session)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)

    def drive(step: str) -> None:
        pending = {client, server}
        for _ in range(10):
            for obj in (client, server):
                if obj in pending:
                    with contextlib.suppress(ssl.SSLWantReadError):
                        getattr(obj, step)()
                        pending.discard(obj)
            s_in.write(c_out.read())
            c_in.write(s_out.read())
        assert not pending, f"{step} did not complete"

    drive("do_handshake")
    resumed = client.session_reused
    next_session = client.session
    assert next_session is not None
    drive("unwrap")
    return resumed, next_session


def test_tls12_session_id_resumption_is_refused(
    tmp_path: Path, server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    # The client never offers a session itself; this shows the server would refuse one anyway.
    client = client_context(client_cert, tls12_enabled=True)
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    server = server_context(server_cert, tls12_enabled=True)
    _, session = session_resumed_in_memory(server, client, None)
    resumed, _ = session_resumed_in_memory(server, client, session)
    assert resumed is False

    # Control: a stock stdlib server with the same certificates does resume, so the check above can fail.
    chain = tmp_path / "chain.pem"
    chain.write_text(server_cert.chain_pem() + server_cert.key_pem())
    stock = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    stock.load_cert_chain(chain)
    stock.load_verify_locations(cadata=server_cert.roots_pem())
    stock.verify_mode = ssl.CERT_REQUIRED
    _, session = session_resumed_in_memory(stock, client, None)
    resumed, _ = session_resumed_in_memory(stock, client, session)
    assert resumed is True


# --- error translation --------------------------------------------------------------------------------------------


def test_handshake_error_translation() -> None:
    assert isinstance(handshake_error(ConnectionResetError()), HandshakeFailed)
    assert "15008" in str(handshake_error(ConnectionResetError()))
    already = IdentityMismatch("x")
    assert handshake_error(already) is already


# --- certificate revocation (CRL_PATH) ----------------------------------------------------------------------------


def crl_set(*crls: x509.CertificateRevocationList) -> CrlSet:
    from cryptography.hazmat.primitives.serialization import Encoding

    return parse_crls(b"".join(c.public_bytes(Encoding.PEM) for c in crls))


async def test_revoked_client_certificate_fails_the_handshake_on_the_server(
    ca: LocalCA, server_cert: WorkloadCertificate
) -> None:
    revoked = ca.issue(CLIENT_ID, HOUR)
    fresh = ca.issue(CLIENT_ID, HOUR)  # same identity, another serial: passes
    crls = crl_set(build_crl(ca.root_cert, ca.root_key, [revoked.cert.serial_number]))  # type: ignore[arg-type]
    server = server_context(server_cert, crls=crls)
    out = await connect(server, client_context(revoked))
    assert isinstance(out.server_error, ssl.SSLCertVerificationError)
    assert out.server_error.verify_code == 23  # X509_V_ERR_CERT_REVOKED
    err = handshake_error(out.server_error)
    assert isinstance(err, CertificateRevoked) and "revoked" in str(err)
    assert out.client_error is not None  # the server's alert ends the client's connection
    (await connect(server, client_context(fresh))).assert_ok()


async def test_revoked_server_certificate_fails_the_handshake_on_the_client(
    ca: LocalCA, client_cert: WorkloadCertificate
) -> None:
    revoked = ca.issue(SERVER_ID, HOUR)
    crls = crl_set(build_crl(ca.root_cert, ca.root_key, [revoked.cert.serial_number]))  # type: ignore[arg-type]
    out = await connect(server_context(revoked), client_context(client_cert, crls=crls))
    assert isinstance(out.client_error, ssl.SSLCertVerificationError)
    assert isinstance(handshake_error(out.client_error), CertificateRevoked)
    (await connect(server_context(ca.issue(SERVER_ID, HOUR)), client_context(client_cert, crls=crls))).assert_ok()


async def test_revoked_intermediate_fails_the_whole_chain(ca: LocalCA, server_cert: WorkloadCertificate) -> None:
    """webpki checks the whole chain (RevocationCheckDepth::Chain): the root's CRL revoking the intermediate refuses
    a leaf the intermediate issued, though the intermediate published no CRL of its own (unknown = allowed)."""
    inter = build_intermediate(ca)
    leaf = inter.issue(CLIENT_ID, HOUR)
    client = WorkloadCertificate(
        cert=leaf.cert, intermediates=[inter.root_cert], roots=[ca.root_cert], private_key=leaf.private_key
    )
    ok = crl_set(build_crl(ca.root_cert, ca.root_key, [12345]))  # type: ignore[arg-type]
    (await connect(server_context(server_cert, crls=ok), client_context(client))).assert_ok()
    bad = crl_set(build_crl(ca.root_cert, ca.root_key, [inter.root_cert.serial_number]))  # type: ignore[arg-type]
    out = await connect(server_context(server_cert, crls=bad), client_context(client))
    assert isinstance(handshake_error(out.server_error or Exception()), CertificateRevoked)


async def test_unknown_or_expired_revocation_status_is_allowed(ca: LocalCA, server_cert: WorkloadCertificate) -> None:
    """Upstream's UnknownStatusPolicy::Allow and ExpirationPolicy::Ignore: a CRL from another CA says nothing about
    ours (no CRL from our issuer), and a CRL past its nextUpdate still revokes what it lists."""
    other = LocalCA.generate(TD)
    unrelated = crl_set(build_crl(other.root_cert, other.root_key, [1, 2, 3]))  # type: ignore[arg-type]
    (await connect(server_context(server_cert, crls=unrelated), client_context(ca.issue(CLIENT_ID, HOUR)))).assert_ok()
    revoked = ca.issue(CLIENT_ID, HOUR)
    stale = build_crl(
        ca.root_cert,
        ca.root_key,  # type: ignore[arg-type]
        [revoked.cert.serial_number],
        next_update=timedelta(seconds=-30),
    )
    out = await connect(server_context(server_cert, crls=crl_set(stale)), client_context(revoked))
    assert isinstance(handshake_error(out.server_error or Exception()), CertificateRevoked)


async def test_crl_signed_by_another_key_revokes_nothing(ca: LocalCA, server_cert: WorkloadCertificate) -> None:
    """A CRL naming our CA as issuer but signed by another key is refused by OpenSSL (a bad CRL signature), so the
    handshake fails rather than trusting or ignoring it; the re-check of open connections ignores it too."""
    forger = LocalCA.generate(TD)
    victim = ca.issue(CLIENT_ID, HOUR)
    forged = build_crl(ca.root_cert, forger.root_key, [victim.cert.serial_number])  # type: ignore[arg-type]
    out = await connect(server_context(server_cert, crls=crl_set(forged)), client_context(victim))
    assert isinstance(out.server_error, ssl.SSLCertVerificationError)
    assert out.server_error.verify_code == 8  # X509_V_ERR_CRL_SIGNATURE_FAILURE
    assert crl_set(forged).revoked([victim.cert, ca.root_cert]) is None


async def test_peer_chain_is_the_verified_chain(ca: LocalCA, client_cert: WorkloadCertificate) -> None:
    inter = build_intermediate(ca)
    leaf = inter.issue(SERVER_ID, HOUR)
    server = WorkloadCertificate(
        cert=leaf.cert, intermediates=[inter.root_cert], roots=[ca.root_cert], private_key=leaf.private_key
    )
    seen: list[list[bytes] | None] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context(server))
    port = srv.sockets[0].getsockname()[1]
    async with srv:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_context(client_cert), server_hostname=""
        )
        seen.append(peer_chain(writer.get_extra_info("ssl_object")))
        writer.close()
    from cryptography.hazmat.primitives.serialization import Encoding

    assert seen[0] == [c.public_bytes(Encoding.DER) for c in (leaf.cert, inter.root_cert, ca.root_cert)]


# --- COMPLIANCE_POLICY=pqc ----------------------------------------------------------------------------------------


def test_pqc_refusal_states_what_was_checked() -> None:
    """The ssl module's OpenSSL is asked for the X25519MLKEM768 group (SSL_CTX_set1_groups_list); it accepts the
    classical groups, so the probe itself works, and the refusal names both OpenSSLs and the reason."""
    from cryptography.hazmat.backends.openssl import backend

    from ztunnel.config import PQC_GROUP, ConfigError, from_env, pqc_refusal
    from ztunnel.tls import key_exchange_group_supported

    assert key_exchange_group_supported("X25519") and key_exchange_group_supported("P-256")
    assert not key_exchange_group_supported("no-such-group")
    supported = key_exchange_group_supported(PQC_GROUP)
    assert supported == (ssl.OPENSSL_VERSION_INFO >= (3, 5))
    message = pqc_refusal()
    assert ssl.OPENSSL_VERSION in message
    if not supported:
        assert "does not know the X25519MLKEM768 group" in message
        assert backend.openssl_version_text() in message and "pyOpenSSL cannot set" in message
    with pytest.raises(ConfigError) as e:
        from_env({"COMPLIANCE_POLICY": "pqc"}, cpu_count=2)
    assert str(e.value) == message

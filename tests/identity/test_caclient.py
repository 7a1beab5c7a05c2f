"""The Istio CA client against the local control plane's CreateCertificate (real gRPC, real TLS)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from xds.istio.v1.auth import ca_pb2, ca_pb2_grpc
from ztunnel.config import AuthSource, RootCertSource, from_env
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.caclient import CaClient, CaClientError, generate_csr
from ztunnel.identity.spiffe import Identity
from ztunnel.standins.istiod.server import XdsServer, issue_server_certificate
from ztunnel.testing.control_plane import control_plane

TD = "cluster.local"
CLIENT = Identity(TD, "default", "client")
SERVER = Identity(TD, "default", "server")
NODE = Identity(TD, "istio-system", "ztunnel")
CONFIG = """
workloads:
- {uid: c//v1/Pod/default/client, name: client, namespace: default, serviceAccount: client, workloadIps: ["10.0.0.1"]}
"""


def client_for(server: XdsServer, *, token: str | None = None, impersonate: bool = False, ttl: int = 3600) -> CaClient:
    assert server.root_cert_path is not None
    return CaClient(
        server.url,
        RootCertSource.parse(str(server.root_cert_path)),
        auth=AuthSource(token),
        cluster_id="c1",
        headers=[("x-ca-extra", "1")],
        impersonate=impersonate,
        secret_ttl=ttl,
    )


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[XdsServer]:
    async with control_plane(tmp_path, CONFIG, tokens={"t-client": CLIENT, "t-node": NODE}) as server:
        yield server


def test_csr_is_p256_with_empty_subject_and_one_critical_uri_san() -> None:
    csr_pem, key_pem = generate_csr(CLIENT)
    csr = x509.load_pem_x509_csr(csr_pem.encode())
    assert csr.is_signature_valid
    assert csr.subject == x509.Name([])
    public = csr.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1"
    assert csr.signature_hash_algorithm is not None and csr.signature_hash_algorithm.name == "sha256"
    (ext,) = list(csr.extensions)
    assert ext.critical and isinstance(ext.value, x509.SubjectAlternativeName)
    assert list(ext.value) == [x509.UniformResourceIdentifier(str(CLIENT))]
    key = serialization.load_pem_private_key(key_pem, None)
    assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert isinstance(key, ec.EllipticCurvePrivateKey)


async def test_fetch_dedicated_mode(cp: XdsServer) -> None:
    client = client_for(cp, token="t-client", ttl=7200)
    try:
        cert = await client.fetch_certificate(CLIENT)
    finally:
        await client.close()
    assert cert.identity == CLIENT
    assert cert.roots == (cp.ca.root_cert,) and cert.intermediates == ()
    assert cert.not_after - datetime.now(UTC) > timedelta(seconds=7100)
    (rec,) = cp.ca_requests
    assert rec.request.validity_duration == 7200
    assert not rec.request.HasField("metadata")  # no impersonation outside shared mode
    assert rec.metadata["authorization"] == "Bearer t-client"
    assert rec.metadata["clusterid"] == "c1"
    assert rec.metadata["x-ca-extra"] == "1"


async def test_fetch_impersonating_as_node(cp: XdsServer) -> None:
    client = client_for(cp, token="t-node", impersonate=True)
    try:
        cert = await client.fetch_certificate(CLIENT)
        with pytest.raises(CaClientError, match=r"PERMISSION_DENIED: cannot impersonate .*/sa/server: no served"):
            await client.fetch_certificate(SERVER)
    finally:
        await client.close()
    assert cert.identity == CLIENT
    md = cp.ca_requests[0].request.metadata.fields
    assert md["ImpersonatedIdentity"].string_value == str(CLIENT)


@pytest.mark.parametrize(
    ("token", "identity", "expected"),
    [
        ("nope", CLIENT, r"UNAUTHENTICATED: authentication failure: unknown token"),
        (None, CLIENT, r"UNAUTHENTICATED: authentication failure: no bearer token"),
        ("t-client", SERVER, r"PERMISSION_DENIED: caller .*/sa/client may not request a certificate for .*/sa/server"),
    ],
)
async def test_refusals_are_reported(cp: XdsServer, token: str | None, identity: Identity, expected: str) -> None:
    client = client_for(cp, token=token)
    try:
        with pytest.raises(CaClientError, match=rf"CreateCertificate for {identity} at https://.* failed: {expected}"):
            await client.fetch_certificate(identity)
    finally:
        await client.close()


async def test_ca_down_is_an_error(tmp_path: Path) -> None:
    async with control_plane(tmp_path, CONFIG) as server:
        client = client_for(server)
    try:
        with pytest.raises(CaClientError, match="UNAVAILABLE"):
            await client.fetch_certificate(CLIENT)
    finally:
        await client.close()


class _RogueCa(ca_pb2_grpc.IstioCertificateServiceServicer):
    """Signs whatever is asked with the identity it chooses: the client must refuse the result."""

    def __init__(self, ca: LocalCA, identity: Identity, chain_len: int = 2) -> None:
        self.ca = ca
        self.identity = identity
        self.chain_len = chain_len

    async def CreateCertificate(self, request: Any, context: Any) -> Any:
        csr = x509.load_pem_x509_csr(request.csr.encode())
        leaf = self.ca._sign_leaf(csr.public_key(), self.identity, timedelta(hours=1), None)  # type: ignore[arg-type]
        return ca_pb2.IstioCertificateResponse(cert_chain=self.ca.cert_chain(leaf)[: self.chain_len])


@pytest.mark.parametrize(
    ("identity", "chain_len", "impersonate", "expected"),
    [
        (SERVER, 2, True, r"issued a certificate for .*/sa/server, but .*/sa/client was requested"),
        (CLIENT, 1, False, r"unusable certificate .* certificate chain has 1 element"),
        (CLIENT, 0, False, r"returned an empty certificate chain"),
    ],
)
async def test_bad_responses_are_refused(
    tmp_path: Path, identity: Identity, chain_len: int, impersonate: bool, expected: str
) -> None:
    # A real TLS gRPC server with the control plane's certificate, but a CA that misbehaves.
    server = XdsServer.from_ca_dir(tmp_path / "ca", listen="127.0.0.1:0")
    await server.start()
    port = server.port
    await server.stop()
    rogue = grpc.aio.server()
    ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(_RogueCa(server.ca, identity, chain_len), rogue)
    chain, key = issue_server_certificate(server.ca, ["localhost"], ["127.0.0.1"], NODE)
    rogue.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials([(key, chain)]))
    await rogue.start()
    client = client_for(server, impersonate=impersonate)
    try:
        with pytest.raises(CaClientError, match=expected):
            await client.fetch_certificate(CLIENT)
    finally:
        await client.close()
        await rogue.stop(None)


async def test_root_file_change_rebuilds_the_channel(tmp_path: Path) -> None:
    # The client trusts a root file; the CA is replaced by one with a new root, and the file is updated.
    root = tmp_path / "root.pem"
    async with control_plane(tmp_path / "a", CONFIG) as first:
        assert first.root_cert_path is not None
        shutil.copy(first.root_cert_path, root)
        client = CaClient(
            first.url, RootCertSource.parse(str(root)), auth=AuthSource(None), cluster_id="c1", secret_ttl=3600
        )
        assert (await client.fetch_certificate(CLIENT)).roots == (first.ca.root_cert,)
        port = first.port
    try:
        async with control_plane(tmp_path / "b", CONFIG, listen=f"127.0.0.1:{port}") as second:
            with pytest.raises(CaClientError, match="UNAVAILABLE"):  # old root: the new server is not trusted
                await client.fetch_certificate(CLIENT)
            assert second.root_cert_path is not None
            shutil.copy(second.root_cert_path, root)
            cert = await client.fetch_certificate(CLIENT)
            assert cert.roots == (second.ca.root_cert,)
    finally:
        await client.close()


def test_from_config() -> None:
    cfg = from_env(
        {
            "CA_ADDRESS": "ca.example:15012",
            "XDS_ADDRESS": "",
            "SECRET_TTL": "12h",
            "CA_HEADER_X_A": "b",
            "ALT_CA_HOSTNAME": "istiod.example",
            "CLUSTER_ID": "c7",
        }
    )
    c = CaClient.from_config(cfg)
    assert c.address == "https://ca.example:15012"
    assert c.secret_ttl == 43200 and c.impersonate  # shared mode by default
    assert c.headers == (("x_a", "b"),) and c.alt_hostname == "istiod.example" and c.cluster_id == "c7"

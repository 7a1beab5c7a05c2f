"""Istio CA client (upstream ``identity/caclient.rs`` and ``tls/csr.rs``): one CSR, one certificate.

``CreateCertificate`` on ``istio.v1.auth.IstioCertificateService`` at ``CA_ADDRESS``:

* the CSR is ECDSA P-256 / SHA-256 with an empty subject and exactly one SAN, the SPIFFE URI of the identity,
  marked critical (RFC 5280 §4.2.1.6 requires it when the subject is empty); the private key never leaves memory;
* ``validity_duration`` is ``SECRET_TTL`` in whole seconds;
* in shared (node proxy) mode the request carries ``metadata = {"ImpersonatedIdentity": "<spiffe id>"}``: the
  node's ztunnel asks for certificates of the workloads it serves, which istiod allows only for trusted node
  accounts;
* headers: ``authorization: Bearer <token>`` and ``clusterid`` (re-read per call, see :mod:`ztunnel.control`),
  then ``CA_HEADER_*``;
* the answer's ``cert_chain`` is leaf, intermediates, root bundle last (:meth:`WorkloadCertificate.from_pem_chain`);
  in impersonation mode the leaf must carry the requested identity, else the certificate is refused, as upstream.

The channel is built once and rebuilt when the ``CA_ROOT_CA`` file changes (upstream watches the file's directory;
here its modification time is checked before each request, which costs one ``stat``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf.struct_pb2 import Struct

from xds.istio.v1.auth import ca_pb2, ca_pb2_grpc
from ztunnel.config import AuthSource, Config, ProxyMode, RootCertSource
from ztunnel.control import (
    ControlPlaneError,
    auth_metadata,
    grpc_target,
    load_root_pem,
    root_cert_file,
    secure_channel,
)
from ztunnel.errors import ZtunnelError
from ztunnel.identity.certificate import CertificateError, WorkloadCertificate
from ztunnel.identity.spiffe import Identity

__all__ = ["IMPERSONATED_IDENTITY", "CaClient", "CaClientError", "generate_csr"]

log = logging.getLogger("ztunnel.identity")

IMPERSONATED_IDENTITY = "ImpersonatedIdentity"
# No upstream deadline; one keeps a wedged CA from holding one of the 8 fetch slots forever.
REQUEST_TIMEOUT = 30.0


class CaClientError(ZtunnelError):
    """A certificate could not be obtained from the CA; the message says why and what to check."""


def generate_csr(identity: Identity) -> tuple[str, bytes]:
    """A PEM CSR for ``identity`` and its PKCS#8 PEM private key (P-256, empty subject, critical URI SAN)."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(str(identity))]), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode("ascii"), key_pem


class CaClient:
    """Requests workload certificates from an Istio CA over gRPC with TLS."""

    def __init__(
        self,
        address: str,
        root_cert: RootCertSource,
        *,
        auth: AuthSource,
        cluster_id: str,
        alt_hostname: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
        impersonate: bool = False,
        secret_ttl: int = 86400,
    ) -> None:
        grpc_target(address, "CA_ADDRESS")  # raises ControlPlaneError for a malformed address, at startup
        self.address = address
        self.root_cert = root_cert
        self.auth = auth
        self.cluster_id = cluster_id
        self.alt_hostname = alt_hostname
        self.headers = tuple(headers)
        self.impersonate = impersonate
        self.secret_ttl = secret_ttl
        self._channel: Any = None
        self._root_stamp: tuple[int, int, int] | None = None

    @classmethod
    def from_config(cls, config: Config) -> CaClient:
        """The client ztunnel uses: ``CA_ADDRESS``, ``CA_ROOT_CA``, impersonation in shared mode, ``SECRET_TTL``."""
        if config.ca_address is None:
            raise ControlPlaneError("CA_ADDRESS is empty (or FAKE_CA=true): no Istio CA to request certificates from")
        return cls(
            config.ca_address,
            config.ca_root_cert,
            auth=config.auth,
            cluster_id=config.cluster_id,
            alt_hostname=config.alt_ca_hostname,
            headers=config.ca_headers,
            impersonate=config.proxy_mode is ProxyMode.SHARED,
            secret_ttl=max(1, int(config.secret_ttl)),
        )

    def _stamp(self) -> tuple[int, int, int] | None:
        path = root_cert_file(self.root_cert)
        if path is None:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    async def _get_channel(self) -> Any:
        stamp = self._stamp()
        if self._channel is not None and stamp == self._root_stamp:
            return self._channel
        try:
            root = load_root_pem(self.root_cert, "CA_ROOT_CA")
        except ControlPlaneError as e:
            if self._channel is not None:
                log.warning("failed to reload CA root certificate (%s); keeping the current channel", e)
                return self._channel
            raise CaClientError(str(e)) from None
        old, self._channel, self._root_stamp = self._channel, None, stamp
        if old is not None:
            log.info("CA root certificate changed; rebuilding the CA channel")
            await old.close()
        try:
            self._channel = secure_channel(self.address, root, self.alt_hostname, "CA_ADDRESS")
        except ControlPlaneError as e:
            raise CaClientError(str(e)) from None
        return self._channel

    async def close(self) -> None:
        """Close the channel (idempotent)."""
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        """Generate a key and CSR for ``identity``, have the CA sign it, and return the certificate."""
        channel = await self._get_channel()
        try:
            metadata = [*auth_metadata(self.auth, self.cluster_id), *self.headers]
        except ControlPlaneError as e:
            raise CaClientError(str(e)) from None
        csr, key_pem = generate_csr(identity)
        request = ca_pb2.IstioCertificateRequest(csr=csr, validity_duration=self.secret_ttl)
        if self.impersonate:
            meta = Struct()
            meta.update({IMPERSONATED_IDENTITY: str(identity)})
            request.metadata.CopyFrom(meta)
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            response = await stub.CreateCertificate(request, metadata=metadata, timeout=REQUEST_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            raise CaClientError(
                f"CreateCertificate for {identity} at {self.address} failed: {e.code().name}: {e.details()}"
            ) from None
        chain = list(response.cert_chain)
        if not chain:
            raise CaClientError(f"CA at {self.address} returned an empty certificate chain for {identity}")
        try:
            cert = WorkloadCertificate.from_pem_chain(chain, key_pem)
        except CertificateError as e:
            raise CaClientError(f"CA at {self.address} returned an unusable certificate for {identity}: {e}") from None
        if self.impersonate and cert.identity != identity:
            raise CaClientError(
                f"CA at {self.address} issued a certificate for {cert.identity}, but {identity} was requested"
            )
        return cert

"""The local control plane's certificate authority: who may have which certificate (istiod's CA server, simplified).

Authentication is by bearer token. Each configured token stands for one identity: ``--token T`` for the trusted
node identity (``spiffe://<td>/ns/istio-system/sa/ztunnel`` by default, what a node's ztunnel runs as), or
``--token T=<spiffe id>`` for any other. With no token configured the server is open: every caller is accepted,
anonymous, and may request any identity of the trust domain (fine on a laptop, never on a network).

A ``CreateCertificate`` request is signed when all of this holds (else it is refused with the gRPC code in
brackets and a message saying which rule failed):

1. the caller presented a known token, if tokens are configured [UNAUTHENTICATED];
2. the CSR parses, is signed by the key it carries, and its only SAN is the URI of the requested identity, a SPIFFE
   id of this trust domain [INVALID_ARGUMENT / PERMISSION_DENIED];
3. the requested identity is the ``ImpersonatedIdentity`` metadata when present, else the CSR's SAN. Impersonation
   is for node proxies: the caller must be a trusted node identity, and the impersonated identity must be the
   identity of some workload the control plane currently serves (istiod further checks that the workload runs on
   the caller's node; this control plane does not know which node a caller is on) [PERMISSION_DENIED];
4. without impersonation the requested identity must be the caller's own [PERMISSION_DENIED];
5. ``validity_duration`` is at most ``max_ttl`` (90 days by default, istiod's default maximum); 0 or less asks for
   the default, 24 h [INVALID_ARGUMENT].

The answer is istiod's shape for ztunnel: ``[leaf PEM, root PEM]``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
from cryptography import x509

from xds.istio.v1.auth import ca_pb2
from ztunnel.errors import ZtunnelError
from ztunnel.identity.ca import CsrRejected, LocalCA
from ztunnel.identity.spiffe import Identity

__all__ = ["DEFAULT_MAX_TTL", "DEFAULT_TTL", "CaPolicy", "CaRefused", "node_identity"]

IMPERSONATED_IDENTITY = "ImpersonatedIdentity"
DEFAULT_TTL = timedelta(hours=24)
DEFAULT_MAX_TTL = timedelta(days=90)


def node_identity(trust_domain: str) -> Identity:
    """The identity a node's ztunnel runs as in a default Istio install."""
    return Identity(trust_domain, "istio-system", "ztunnel")


class CaRefused(ZtunnelError):
    """A request the CA will not sign; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class CaPolicy:
    """Authenticates callers and decides what the CA signs (rules in the module docstring)."""

    ca: LocalCA
    trust_domain: str
    tokens: Mapping[str, Identity] = field(default_factory=dict)
    trusted_nodes: Collection[Identity] = ()
    max_ttl: timedelta = DEFAULT_MAX_TTL
    # Identities of the workloads currently served; impersonation is limited to these.
    served_identities: Callable[[], Collection[Identity]] = lambda: ()

    @property
    def open(self) -> bool:
        """No tokens: anyone may connect and request any identity of the trust domain."""
        return not self.tokens

    def authenticate(self, metadata: Mapping[str, str]) -> Identity | None:
        """The caller's identity from its bearer token (``None`` for an open server); raises :class:`CaRefused`."""
        if self.open:
            return None
        header = metadata.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise CaRefused(grpc.StatusCode.UNAUTHENTICATED, "authentication failure: no bearer token")
        identity = self.tokens.get(token.strip())
        if identity is None:
            raise CaRefused(grpc.StatusCode.UNAUTHENTICATED, "authentication failure: unknown token")
        return identity

    def sign(self, request: ca_pb2.IstioCertificateRequest, caller: Identity | None) -> list[str]:
        """Check ``request`` against the rules and return ``[leaf PEM, root PEM]``; raises :class:`CaRefused`."""
        san = self._csr_identity(request.csr)
        impersonated: Identity | None = None
        if request.HasField("metadata") and IMPERSONATED_IDENTITY in request.metadata.fields:
            raw = request.metadata.fields[IMPERSONATED_IDENTITY].string_value
            impersonated = Identity.try_parse(raw)
            if impersonated is None:
                raise CaRefused(grpc.StatusCode.INVALID_ARGUMENT, f"ImpersonatedIdentity {raw!r} is not a SPIFFE id")
        requested = impersonated or san
        if requested.trust_domain != self.trust_domain:
            raise CaRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"identity {requested} is outside this CA's trust domain {self.trust_domain!r}",
            )
        if not self.open:
            if impersonated is not None:
                if caller not in self.trusted_nodes:
                    raise CaRefused(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"caller {caller} may not impersonate {impersonated}: only trusted node identities may",
                    )
                if impersonated not in set(self.served_identities()):
                    raise CaRefused(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"cannot impersonate {impersonated}: no served workload has that identity",
                    )
            elif requested != caller:
                raise CaRefused(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"caller {caller} may not request a certificate for {requested}",
                )
        ttl = timedelta(seconds=request.validity_duration) if request.validity_duration > 0 else DEFAULT_TTL
        if ttl > self.max_ttl:
            raise CaRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"requested TTL {ttl} is greater than the max allowed TTL {self.max_ttl}",
            )
        try:
            leaf = self.ca.sign_csr(request.csr, requested, ttl)
        except CsrRejected as e:
            raise CaRefused(grpc.StatusCode.INVALID_ARGUMENT, f"CSR rejected: {e}") from None
        return self.ca.cert_chain(leaf)

    @staticmethod
    def _csr_identity(csr_pem: str) -> Identity:
        try:
            csr = x509.load_pem_x509_csr(csr_pem.encode())
        except ValueError as e:
            raise CaRefused(grpc.StatusCode.INVALID_ARGUMENT, f"CSR rejected: cannot parse CSR as PEM: {e}") from None
        try:
            uris = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.UniformResourceIdentifier
            )
        except x509.ExtensionNotFound:
            uris = []
        if len(uris) != 1:
            raise CaRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"CSR rejected: expected exactly one URI SAN (the SPIFFE id), got {len(uris)}",
            )
        identity = Identity.try_parse(uris[0])
        if identity is None:
            raise CaRefused(grpc.StatusCode.INVALID_ARGUMENT, f"CSR rejected: SAN {uris[0]!r} is not a SPIFFE id")
        return identity

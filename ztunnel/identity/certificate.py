"""Workload certificates: a leaf, its intermediates, the trust roots and the private key.

A :class:`WorkloadCertificate` is what a certificate provider hands to the TLS layer
(``ztunnel.tls.server_context`` / ``client_context``). It mirrors upstream's
``tls/certificate.rs::WorkloadCertificate``:

* the *leaf* carries the workload's SPIFFE identity as a URI SAN;
* the *intermediates* are sent in the handshake after the leaf; the *roots* are never sent, they are the
  trust store used to verify peers (both directions);
* it should be refreshed at half-life, ``not_before + (not_after - not_before) / 2``.

istiod's ``CreateCertificate`` answers with ``cert_chain: repeated string`` where element 0 is the leaf, the
middle elements are intermediates (one per element) and the *last* element is the root bundle, which may hold
several concatenated PEM roots (e.g. during a root rotation). :meth:`WorkloadCertificate.from_pem_chain` parses
exactly that shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ztunnel.errors import ZtunnelError
from ztunnel.identity.spiffe import Identity

__all__ = [
    "CertificateError",
    "WorkloadCertificate",
    "identities_from_cert",
    "identity_from_cert",
]


class CertificateError(ZtunnelError, ValueError):
    """A certificate, chain or key that cannot be used as a workload certificate."""


def identities_from_cert(cert: x509.Certificate) -> list[Identity]:
    """All URI SANs of ``cert`` that parse as Istio identities, in certificate order.

    Other SAN types, and URIs that are not ``spiffe://<td>/ns/<ns>/sa/<sa>``, are skipped, as upstream's
    ``tls::certificate::identities`` does.
    """
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    found: list[Identity] = []
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        parsed = Identity.try_parse(uri)
        if parsed is not None:
            found.append(parsed)
    return found


def identity_from_cert(cert: x509.Certificate) -> Identity | None:
    """The peer identity used for policy and telemetry: the first URI SAN that parses as an Istio identity."""
    ids = identities_from_cert(cert)
    return ids[0] if ids else None


def _public_key_der(key: ec.EllipticCurvePublicKey | x509.Certificate) -> bytes:
    public = key.public_key() if isinstance(key, x509.Certificate) else key
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _pem(certs: Iterable[x509.Certificate]) -> str:
    return "".join(c.public_bytes(serialization.Encoding.PEM).decode("ascii") for c in certs)


@dataclass(frozen=True, slots=True)
class WorkloadCertificate:
    """A leaf certificate with its intermediates, trust roots and private key.

    ``intermediates`` and ``roots`` accept any sequence and are stored as tuples, so instances are immutable
    and can be shared between connections. Construction checks that the key belongs to the leaf and that at
    least one root is present; it does not verify the chain (the TLS peer does that on every handshake).
    """

    cert: x509.Certificate
    intermediates: Sequence[x509.Certificate]
    roots: Sequence[x509.Certificate]
    # Not compared: key objects compare by identity, and construction guarantees the key matches the leaf.
    private_key: ec.EllipticCurvePrivateKey = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "intermediates", tuple(self.intermediates))
        object.__setattr__(self, "roots", tuple(self.roots))
        if not self.roots:
            raise CertificateError("workload certificate has no root certificate: the trust store would be empty")
        if not isinstance(self.private_key, ec.EllipticCurvePrivateKey):
            raise CertificateError(f"workload private key must be an EC key, got {type(self.private_key).__name__}")
        if _public_key_der(self.private_key.public_key()) != _public_key_der(self.cert):
            raise CertificateError(
                f"private key does not match the leaf certificate (serial {self.cert.serial_number:x}); "
                "check that the key and the certificate come from the same CSR"
            )

    @classmethod
    def from_pem_chain(cls, cert_chain: Sequence[str], key_pem: str | bytes) -> WorkloadCertificate:
        """Build from istiod's ``CreateCertificate`` response shape and the PKCS#8 key of the CSR.

        ``cert_chain[0]`` is the leaf, ``cert_chain[1:-1]`` are intermediates (one per element) and
        ``cert_chain[-1]`` is the root bundle, which may contain several concatenated PEM certificates.
        """
        if len(cert_chain) < 2:
            raise CertificateError(
                f"certificate chain has {len(cert_chain)} element(s); expected the leaf, optional intermediates "
                "and a root bundle as the last element (is the CA returning the root?)"
            )
        try:
            leaf = x509.load_pem_x509_certificate(cert_chain[0].encode())
        except ValueError as e:
            raise CertificateError(f"cannot parse leaf certificate (cert_chain[0]): {e}") from e
        intermediates: list[x509.Certificate] = []
        for i, pem in enumerate(cert_chain[1:-1], start=1):
            try:
                intermediates.append(x509.load_pem_x509_certificate(pem.encode()))
            except ValueError as e:
                raise CertificateError(f"cannot parse intermediate certificate (cert_chain[{i}]): {e}") from e
        try:
            roots = x509.load_pem_x509_certificates(cert_chain[-1].encode())
        except ValueError as e:
            raise CertificateError(f"cannot parse root bundle (cert_chain[{len(cert_chain) - 1}]): {e}") from e
        try:
            key = serialization.load_pem_private_key(key_pem.encode() if isinstance(key_pem, str) else key_pem, None)
        except (ValueError, TypeError) as e:
            raise CertificateError(f"cannot parse private key: {e}") from e
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise CertificateError(f"workload private key must be an EC key, got {type(key).__name__}")
        return cls(cert=leaf, intermediates=intermediates, roots=roots, private_key=key)

    @property
    def identity(self) -> Identity | None:
        """This certificate's identity: the first URI SAN that parses as an Istio identity."""
        return identity_from_cert(self.cert)

    @property
    def not_before(self) -> datetime:
        """Start of validity of the leaf (aware, UTC)."""
        return self.cert.not_valid_before_utc

    @property
    def not_after(self) -> datetime:
        """End of validity of the leaf (aware, UTC)."""
        return self.cert.not_valid_after_utc

    @property
    def refresh_at(self) -> datetime:
        """When to fetch a replacement: half-life, as upstream (``not_after`` if the validity is inverted)."""
        if self.not_after <= self.not_before:
            return self.not_after
        return self.not_before + (self.not_after - self.not_before) / 2

    def is_expired(self, now: datetime | None = None) -> bool:
        """Whether ``now`` (default: the current time) is past ``not_after``."""
        return (now if now is not None else datetime.now(UTC)) > self.not_after

    def chain_pem(self) -> str:
        """Leaf then intermediates, concatenated PEM: what is presented in the handshake (roots are not sent)."""
        return _pem([self.cert, *self.intermediates])

    def key_pem(self) -> str:
        """The private key as unencrypted PKCS#8 PEM."""
        return self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode("ascii")

    def roots_pem(self) -> str:
        """The trust roots, concatenated PEM."""
        return _pem(self.roots)

    def full_chain_and_roots(self) -> list[str]:
        """The inverse of :meth:`from_pem_chain`: leaf, each intermediate, then the root bundle (config dump)."""
        return [_pem([c]) for c in (self.cert, *self.intermediates)] + [self.roots_pem()]

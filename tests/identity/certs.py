"""Certificate builders for tests that need certificates :class:`LocalCA` would never issue.

Odd EKUs, several SANs, intermediates: each is signed by a real :class:`LocalCA` root so the TLS tests exercise
exactly one deviation at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ztunnel.identity import LocalCA, WorkloadCertificate

TD = "cluster.local"
NOT_A_CA = x509.BasicConstraints(ca=False, path_length=None)


def build_leaf(
    ca: LocalCA,
    *,
    uris: Sequence[str] = (),
    dns: Sequence[str] = (),
    eku: Sequence[x509.ObjectIdentifier] | None = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
    ttl: timedelta = timedelta(hours=1),
    basic_constraints: x509.BasicConstraints | None = NOT_A_CA,
) -> WorkloadCertificate:
    """A leaf signed by ``ca`` with the given URI/DNS SANs and EKUs (``eku=None``: no EKU extension) and basic
    constraints (``None``: no basicConstraints extension; ``ca=True``: a CA certificate used as a leaf)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, TD)]))
        .issuer_name(ca.root_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + ttl)
    )
    if basic_constraints is not None:
        builder = builder.add_extension(basic_constraints, critical=True)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    names += [x509.DNSName(d) for d in dns]
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if eku is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(eku)), critical=False)
    cert = builder.sign(ca.root_key, hashes.SHA256())
    return WorkloadCertificate(cert=cert, intermediates=(), roots=(ca.root_cert,), private_key=key)


def build_intermediate(root: LocalCA, trust_domain: str = TD) -> LocalCA:
    """An intermediate CA signed by ``root``, usable as a :class:`LocalCA` to issue leaves."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "intermediate")]))
        .issuer_name(root.root_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(root.root_key, hashes.SHA256())
    )
    return LocalCA(root_cert=cert, root_key=key, trust_domain=trust_domain)


def build_crl(
    issuer_cert: x509.Certificate,
    issuer_key: ec.EllipticCurvePrivateKey,
    revoked: Sequence[int] = (),
    *,
    number: int = 1,
    next_update: timedelta = timedelta(days=1),
) -> x509.CertificateRevocationList:
    """A CRL signed by ``issuer_key`` listing the serials ``revoked``, with the CRL Number and Authority Key
    Identifier extensions upstream's webpki loader requires."""
    now = datetime.now(UTC)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer_cert.subject)
        .last_update(now - timedelta(minutes=1))
        .next_update(now + next_update)
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    )
    for serial in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now - timedelta(seconds=30)).build()
        )
    return builder.sign(issuer_key, hashes.SHA256())

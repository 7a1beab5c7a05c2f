"""A local certificate authority: the fake CA for tests and for running without istiod.

Upstream's ``FAKE_CA`` (``tls/mock.rs``) signs workload certificates with a fixed test root compiled into the
binary. Here the root is generated on first use and persisted, so every ztunnel started against the same
directory (and every test peer) trusts the same root:

* ``root-cert.pem``: ECDSA P-256 self-signed root, ``CA:true``, keyCertSign + cRLSign,
  subject ``O=<trust domain>, CN=ztunnel local CA``;
* ``ca-key.pem``: its PKCS#8 key, mode 0600, in a directory created with mode 0700.

Leaves look like upstream's fake certificates: subject ``O=<trust domain>``, exactly one URI SAN (the SPIFFE id),
digitalSignature + keyEncipherment, EKU serverAuth + clientAuth, ``CA:false``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ztunnel.errors import ZtunnelError
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity

__all__ = ["CA_KEY_FILE", "ROOT_CERT_FILE", "CaError", "CaFileError", "CsrRejected", "LocalCA"]

log = logging.getLogger(__name__)

ROOT_CERT_FILE = "root-cert.pem"
CA_KEY_FILE = "ca-key.pem"
_LOCK_FILE = ".lock"
ROOT_COMMON_NAME = "ztunnel local CA"

# Ten years: the fake root must outlive any test run or dev cluster; it is not a production CA.
ROOT_VALIDITY = timedelta(days=3650)
# Backdate leaves so a peer whose clock is slightly behind ours does not reject a fresh certificate as
# "not yet valid".
CLOCK_SKEW_ALLOWANCE = timedelta(minutes=1)

# Keys the CA can sign with. Generated roots are always P-256; RSA is accepted for operator-provided roots.
CaKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


class CaError(ZtunnelError):
    """Base class for local CA failures."""


class CaFileError(CaError):
    """The CA directory or one of its files cannot be created, read or used; the message names the path."""


class CsrRejected(CaError):
    """A CSR that the CA refuses to sign; the message says why."""


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _whole_seconds(now: datetime | None) -> datetime:
    # X.509 times have one-second resolution; truncating up front makes not_before/not_after exactly what the
    # caller asked for instead of silently floored by the encoder.
    if now is None:
        now = _utcnow()
    elif now.tzinfo is None:
        raise ValueError("now must be timezone-aware (UTC)")
    return now.astimezone(UTC).replace(microsecond=0)


def _public_der(key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True, slots=True)
class LocalCA:
    """A root certificate and key that sign workload certificates.

    Build with :meth:`generate` (in memory) or :meth:`load_or_create` (persisted). ``trust_domain`` is only
    used for the subject ``O=``; the CA signs identities of any trust domain, as istiod does with trust
    domain aliases.
    """

    root_cert: x509.Certificate
    root_key: CaKey
    trust_domain: str

    @classmethod
    def generate(cls, trust_domain: str, *, now: datetime | None = None) -> LocalCA:
        """A fresh self-signed ECDSA P-256 root, valid for :data:`ROOT_VALIDITY` from ``now``."""
        now = _whole_seconds(now)
        key = ec.generate_private_key(ec.SECP256R1())
        # The CN keeps the root's name distinct from the leaves' (O=<trust domain> only): OpenSSL treats a
        # certificate whose issuer equals its subject as self-issued and would reject such a leaf.
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain),
                x509.NameAttribute(NameOID.COMMON_NAME, ROOT_COMMON_NAME),
            ]
        )
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW_ALLOWANCE)
            .not_valid_after(now + ROOT_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(root_cert=cert, root_key=key, trust_domain=trust_domain)

    @classmethod
    def load_or_create(cls, directory: Path, trust_domain: str) -> LocalCA:
        """Load ``root-cert.pem`` + ``ca-key.pem`` from ``directory``, creating them on first use.

        Safe against concurrent starts: all loaders serialise on an ``flock`` of ``<directory>/.lock`` and each
        file is published by an atomic rename of a fully written temporary (created ``O_EXCL``), so two
        processes starting at once end up with one valid pair and a crash never leaves a half-written file.
        Raises :class:`CaFileError` naming the path on unreadable, corrupt or mismatched files.
        """
        directory = Path(directory)
        _ensure_private_dir(directory)
        cert_path, key_path = directory / ROOT_CERT_FILE, directory / CA_KEY_FILE
        with _locked(directory / _LOCK_FILE):
            have_cert, have_key = cert_path.exists(), key_path.exists()
            if have_cert and have_key:
                return cls._load(cert_path, key_path, trust_domain)
            if have_cert != have_key:
                present, missing = (cert_path, key_path) if have_cert else (key_path, cert_path)
                raise CaFileError(
                    f"{present} exists but {missing} is missing; restore the missing file, or remove {present} "
                    "to generate a new root (every workload certificate signed by the old root becomes untrusted)"
                )
            ca = cls.generate(trust_domain)
            # Key first: a crash between the two renames leaves a key without a certificate, which the check
            # above reports, rather than a certificate whose key is lost.
            _write_atomically(key_path, ca._key_pem(), mode=0o600)
            _write_atomically(cert_path, ca.root_pem().encode("ascii"), mode=0o644)
            log.info("created local CA root %s (trust domain %s)", cert_path, trust_domain)
            return ca

    @classmethod
    def _load(cls, cert_path: Path, key_path: Path, trust_domain: str) -> LocalCA:
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except (OSError, ValueError) as e:
            raise CaFileError(f"cannot load CA root certificate {cert_path}: {e}") from e
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as e:
            raise CaFileError(f"cannot load CA private key {key_path} (expected unencrypted PEM): {e}") from e
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise CaFileError(f"CA private key {key_path} is a {type(key).__name__}; only EC and RSA are supported")
        cert_public = cert.public_key()
        if not isinstance(cert_public, ec.EllipticCurvePublicKey | rsa.RSAPublicKey) or _public_der(
            cert_public
        ) != _public_der(key.public_key()):
            raise CaFileError(f"CA private key {key_path} does not match the root certificate {cert_path}")
        try:
            is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise CaFileError(f"{cert_path} is not a CA certificate (basicConstraints CA:true is missing)")
        if key_path.stat().st_mode & 0o077:
            log.warning("CA private key %s is readable by group/others; it should be mode 0600", key_path)
        return cls(root_cert=cert, root_key=key, trust_domain=trust_domain)

    def root_pem(self) -> str:
        """The root certificate as PEM."""
        return self.root_cert.public_bytes(serialization.Encoding.PEM).decode("ascii")

    def _key_pem(self) -> bytes:
        return self.root_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def issue(self, identity: Identity, ttl: timedelta, now: datetime | None = None) -> WorkloadCertificate:
        """A new workload certificate for ``identity`` with a fresh P-256 key, valid until ``now + ttl``.

        ``not_before`` is backdated by :data:`CLOCK_SKEW_ALLOWANCE`. Pass ``now`` (aware) to issue
        certificates in the past or future, e.g. already-expired ones for tests.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = self._sign_leaf(key.public_key(), identity, ttl, now)
        return WorkloadCertificate(cert=leaf, intermediates=(), roots=(self.root_cert,), private_key=key)

    def sign_csr(
        self, csr_pem: str | bytes, identity: Identity, ttl: timedelta, now: datetime | None = None
    ) -> x509.Certificate:
        """Sign a CSR for ``identity`` (the fake Istio CA server's path).

        The CSR must be correctly self-signed and its only SAN must be the URI ``str(identity)``, which is what
        ztunnel's own CSRs carry; its subject is ignored (ztunnel's is empty) and the leaf is built exactly as
        :meth:`issue` builds it. Raises :class:`CsrRejected` otherwise.
        """
        try:
            csr = x509.load_pem_x509_csr(csr_pem.encode() if isinstance(csr_pem, str) else csr_pem)
        except ValueError as e:
            raise CsrRejected(f"cannot parse CSR as PEM: {e}") from e
        if not csr.is_signature_valid:
            raise CsrRejected("CSR signature is invalid: the CSR was not signed by the key it carries")
        public = csr.public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey | rsa.RSAPublicKey):
            raise CsrRejected(f"CSR key type {type(public).__name__} is not supported; use ECDSA P-256 (or RSA)")
        try:
            names = list(csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
        except x509.ExtensionNotFound:
            names = []
        want = x509.UniformResourceIdentifier(str(identity))
        if names != [want]:
            got = ", ".join(str(getattr(n, "value", n)) for n in names) or "none"
            raise CsrRejected(f"CSR must carry exactly one SAN, the URI {identity}; got {got}")
        return self._sign_leaf(public, identity, ttl, now)

    def cert_chain(self, leaf: x509.Certificate) -> list[str]:
        """``leaf`` in istiod's ``CreateCertificate`` response shape: ``[leaf PEM, root bundle PEM]``."""
        return [leaf.public_bytes(serialization.Encoding.PEM).decode("ascii"), self.root_pem()]

    def _sign_leaf(
        self,
        public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey,
        identity: Identity,
        ttl: timedelta,
        now: datetime | None,
    ) -> x509.Certificate:
        if ttl <= timedelta(0):
            raise ValueError(f"certificate ttl must be positive, got {ttl}")
        now = _whole_seconds(now)
        ca_ski = x509.SubjectKeyIdentifier.from_public_key(self.root_key.public_key())
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, self.trust_domain)]))
            .issuer_name(self.root_cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW_ALLOWANCE)
            .not_valid_after(now + ttl)
            # istiod marks the SAN critical only when the subject is empty (RFC 5280 4.2.1.6); ours is not.
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(str(identity))]), critical=False)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .sign(self.root_key, hashes.SHA256())
        )


def _ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` with mode 0700. An existing directory is used as is (it may be shared, e.g. /tmp)."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700)
    except FileExistsError:
        if not directory.is_dir():
            raise CaFileError(f"CA directory {directory} exists and is not a directory") from None
        return
    except OSError as e:
        raise CaFileError(f"cannot create CA directory {directory}: {e}") from e
    # mkdir's mode is filtered by the umask; set it explicitly.
    os.chmod(directory, 0o700)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise CaFileError(f"cannot open CA lock file {path}: {e}") from e
    try:
        # flock belongs to the open file description: it serialises processes and also threads that opened the
        # file separately, and is released by the kernel if the holder dies.
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes, *, mode: int) -> None:
    """Write ``data`` to a new ``O_EXCL`` temporary beside ``path``, fsync it, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        # Callers hold the directory lock, so any temporary already here is debris from a crashed writer.
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # O_CREAT's mode is filtered by the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CaFileError(f"cannot write {path}: {e}") from e

"""Certificate revocation lists (``CRL_PATH``): upstream ``tls/crl.rs`` and ``tls/revocation.rs``.

What it does, as upstream:

* The file holds one DER CRL, or PEM with any number of ``X509 CRL`` blocks (other blocks are skipped); an empty
  file, or PEM without a CRL block, is an empty set (nothing revoked). A missing file is an empty set too (the
  ConfigMap may be mounted later) and is picked up when it appears.
* New handshakes, both roles: the CRLs are loaded into every TLS context (:mod:`ztunnel.tls`), and OpenSSL checks
  every certificate of the peer chain against them (webpki's ``RevocationCheckDepth::Chain``). A certificate with
  no CRL from its issuer, or whose CRL is past ``nextUpdate``, is accepted (``UnknownStatusPolicy::Allow``,
  ``ExpirationPolicy::Ignore``). A revoked peer fails the handshake and counts in
  ``istio_crl_policy_rejections_total{reporter}`` (``destination`` inbound, ``source`` outbound).
* Established tunnels: each HBONE connection is tracked with its verified peer chain while it is open; when a new
  CRL set is loaded, every tracked chain is checked again and a revoked one is closed at once, its streams reported
  with the response flag ``CERT_REVOKED`` (and counted in ``istio_crl_policy_rejections_total``). A connection whose
  chain cannot be read is counted in ``istio_crl_untracked_connections_total`` and stays open, as upstream.

Watching: the file is polled every :data:`POLL_INTERVAL` seconds (stat of the path, following symlinks, so a
ConfigMap update, an atomic ``..data`` symlink swap, is seen like an in-place write); upstream debounces inotify
events for 2 s, so both see a change within about 2 s. A file that stops parsing (or that OpenSSL refuses, or that
is removed) keeps the previous set (an error is logged once per change), rather than dropping all revocations.

Worker processes: each worker runs its own :class:`CrlManager` watching the file. The file is on a local volume
every worker can read; the TLS contexts and the tunnels to close live in the workers, so pushing the CRL from the
control process would only add a message carrying the same bytes (and a CRL can be megabytes) for no gain in
consistency: both ways the workers see a change within one poll interval.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPublicKeyTypes
from cryptography.hazmat.primitives.serialization import Encoding

from ztunnel.errors import ZtunnelError

__all__ = [
    "POLL_INTERVAL",
    "REPORTER_INBOUND",
    "REPORTER_OUTBOUND",
    "CrlCounters",
    "CrlError",
    "CrlManager",
    "CrlSet",
    "Tracked",
    "chain_links",
    "load_crl_file",
    "parse_crls",
]

log = logging.getLogger("ztunnel.crl")

# Upstream's debouncer waits 2 s after the last event; a 1 s poll sees a change no later than that.
POLL_INTERVAL: Final = 1.0
_PEM_BEGIN: Final = b"-----BEGIN"
_CRL_BEGIN: Final = b"-----BEGIN X509 CRL-----"
_CRL_END: Final = b"-----END X509 CRL-----"

REPORTER_INBOUND: Final = "destination"
REPORTER_OUTBOUND: Final = "source"


class CrlError(ZtunnelError):
    """The CRL file cannot be read or parsed; the message names the file and the block."""


@dataclass(frozen=True)
class _Crl:
    crl: x509.CertificateRevocationList
    issuer: bytes  # DER of the issuer name, compared with a certificate's issuer
    serials: frozenset[int]


@dataclass(frozen=True)
class CrlSet:
    """The CRLs of one load of the file: ``pem`` for OpenSSL, and by issuer for re-checking open connections."""

    crls: tuple[_Crl, ...] = ()
    pem: bytes = b""

    @property
    def empty(self) -> bool:
        return not self.crls

    def revoked(
        self, chain: Sequence[x509.Certificate], links: Sequence[tuple[bytes, int]] | None = None
    ) -> x509.Certificate | None:
        """The first certificate of ``chain`` (leaf first, each issued by the next) that a CRL from its issuer lists,
        or None. A CRL counts only if its signature verifies with the issuer's key (the next certificate of the
        chain); the last certificate (the trust anchor) has no issuer in the chain and is not checked, as webpki.
        ``links`` is :func:`chain_links` of ``chain``, computed once per connection by the caller that has it."""
        if not self.crls:
            return None
        by_issuer = self.by_issuer
        for i, (issuer_name, serial) in enumerate(links if links is not None else chain_links(chain)):
            for c in by_issuer.get(issuer_name, ()):
                if serial in c.serials and _signed_by(c.crl, chain[i + 1]):
                    return chain[i]
        return None

    @functools.cached_property
    def by_issuer(self) -> dict[bytes, tuple[_Crl, ...]]:
        out: dict[bytes, tuple[_Crl, ...]] = {}
        for c in self.crls:
            out[c.issuer] = (*out.get(c.issuer, ()), c)
        return out


def chain_links(chain: Sequence[x509.Certificate]) -> tuple[tuple[bytes, int], ...]:
    """(issuer name DER, serial) of every certificate of ``chain`` but the last: what a CRL lookup needs. Encoding a
    name costs ~5 us; done once per connection, a reload re-checks 10,000 connections in a few ms."""
    return tuple((c.issuer.public_bytes(), c.serial_number) for c in chain[:-1])


def _signed_by(crl: x509.CertificateRevocationList, issuer: x509.Certificate) -> bool:
    try:
        key: CertificateIssuerPublicKeyTypes = issuer.public_key()  # type: ignore[assignment]
        return crl.is_signature_valid(key)
    except (TypeError, ValueError):  # a key type CRLs cannot be signed with
        return False


def parse_crls(data: bytes, where: str = "CRL_PATH") -> CrlSet:
    """Parse the file's bytes (upstream's rules: empty = none; PEM = every ``X509 CRL`` block; else one DER CRL).

    Raises :class:`CrlError` naming ``where`` and the block (1-based) that does not parse."""
    if not data.strip():
        return CrlSet()
    ders: list[bytes] = []
    if data.lstrip().startswith(_PEM_BEGIN):
        rest = data
        while (start := rest.find(_CRL_BEGIN)) >= 0:
            end = rest.find(_CRL_END, start)
            if end < 0:
                raise CrlError(f"{where}: CRL block {len(ders) + 1} has no '-----END X509 CRL-----' line")
            block = rest[start : end + len(_CRL_END)]
            try:
                ders.append(x509.load_pem_x509_crl(block).public_bytes(Encoding.DER))
            except ValueError as e:
                raise CrlError(f"{where}: CRL block {len(ders) + 1} is not a valid PEM CRL: {e}") from None
            rest = rest[end + len(_CRL_END) :]
    else:
        ders.append(data)
    crls: list[_Crl] = []
    pem: list[bytes] = []
    for i, der in enumerate(ders, 1):
        try:
            crl = x509.load_der_x509_crl(der)
            serials = frozenset(r.serial_number for r in crl)
        except ValueError as e:
            raise CrlError(f"{where}: CRL {i} is not a valid CRL (PEM or DER): {e}") from None
        crls.append(_Crl(crl, crl.issuer.public_bytes(), serials))
        pem.append(crl.public_bytes(Encoding.PEM))
    return CrlSet(tuple(crls), b"".join(pem))


def load_crl_file(path: str, *, missing_ok: bool = True) -> CrlSet:
    """Read and parse ``path``; a missing file is an empty set with ``missing_ok`` (at startup: upstream waits for
    the ConfigMap to appear), else an error (a file removed later keeps the lists in force, as upstream's reload
    fails then)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        if missing_ok:
            return CrlSet()
        raise CrlError(f"CRL_PATH={path}: the CRL file is gone") from None
    except OSError as e:
        raise CrlError(f"CRL_PATH={path}: cannot read the CRL file: {e.strerror or e}") from None
    return parse_crls(data, f"CRL_PATH={path}")


class CrlCounters(Protocol):
    """Where the CRL counters go (:class:`ztunnel.proxy.metrics.CrlMetrics`: upstream's two families)."""

    def rejected(self, reporter: str) -> None: ...

    def untracked_connection(self, reporter: str) -> None: ...


@dataclass(eq=False)
class Tracked:
    """One open HBONE connection under CRL enforcement; :meth:`CrlManager.untrack` it when it closes."""

    chain: tuple[x509.Certificate, ...]
    reporter: str
    peer: str
    on_revoked: Callable[[str], None]
    links: tuple[tuple[bytes, int], ...] = ()
    revoked: bool = False


@dataclass(eq=False)
class CrlManager:
    """The CRL set of one process, its file watch, and the connections it may have to close."""

    path: str
    metrics: CrlCounters | None = None
    # Checks a new set the way it will be used (OpenSSL loading it into a context: ztunnel.tls.check_crls), so a
    # list cryptography parses but OpenSSL refuses is refused here, never at a connection's handshake.
    validate: Callable[[CrlSet], None] | None = None
    current: CrlSet = field(default_factory=CrlSet)
    generation: int = 0  # bumped on every load that changed the set: TLS contexts are rebuilt when it moves
    _tracked: set[Tracked] = field(default_factory=set)
    _stamp: tuple[int, int, int] | None = None
    _failed_stamp: tuple[int, int, int] | None = None
    _failed: bool = False

    @classmethod
    def start(
        cls, path: str, metrics: CrlCounters | None = None, validate: Callable[[CrlSet], None] | None = None
    ) -> CrlManager:
        """Load ``path`` now (raises :class:`CrlError` if it exists and does not parse)."""
        m = cls(path, metrics, validate)
        m._stamp = m._stat()
        m.current = m._load(missing_ok=True)
        m.generation = 1
        log.info("loaded %d CRL(s) from %s", len(m.current.crls), path)
        return m

    @classmethod
    def lenient(
        cls, path: str, metrics: CrlCounters | None = None, validate: Callable[[CrlSet], None] | None = None
    ) -> CrlManager:
        """Like :meth:`start`, but a file that does not parse is logged and retried at each change."""
        m = cls(path, metrics, validate)
        m.generation = 1
        m.check()
        return m

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    async def poll(self) -> None:
        """Watch the file until cancelled: run it as a task of the process's owner (``crl watch``)."""
        while True:
            await asyncio.sleep(POLL_INTERVAL)
            self.check()

    def _load(self, *, missing_ok: bool) -> CrlSet:
        new = load_crl_file(self.path, missing_ok=missing_ok)
        if self.validate is not None and not new.empty:
            try:
                self.validate(new)
            except Exception as e:
                raise CrlError(f"CRL_PATH={self.path}: {e}") from None
        return new

    def check(self) -> bool:
        """Reload if the file changed since the last look; True if a new set was loaded. A file that does not
        parse, or is gone, keeps the lists in force (logged once per change of the file)."""
        stamp = self._stat()
        if stamp == self._stamp or (self._failed and stamp == self._failed_stamp):
            return False
        try:
            new = self._load(missing_ok=False)
        except CrlError as e:
            self._failed, self._failed_stamp = True, stamp
            log.error("%s; keeping the %d CRL(s) loaded before", e, len(self.current.crls))
            return False
        self._stamp, self._failed, self._failed_stamp = stamp, False, None
        self.reload(new)
        return True

    def reload(self, new: CrlSet) -> None:
        """Use ``new`` from now on: new handshakes see it, and open connections it revokes are closed."""
        self.current = new
        self.generation += 1
        log.info("loaded %d CRL(s) from %s", len(new.crls), self.path)
        for t in list(self._tracked):
            self._check(t)

    def track(
        self, chain: Sequence[bytes] | None, reporter: str, peer: str, on_revoked: Callable[[str], None]
    ) -> Tracked | None:
        """Track an open connection whose verified peer chain (DER, leaf first, ending at the trust anchor) is
        ``chain``. Checked at once too: a CRL loaded between the handshake and now must not miss it. None (and
        counted untracked) when the chain is unknown or does not parse."""
        try:
            certs = tuple(x509.load_der_x509_certificate(d) for d in chain or ())
        except ValueError:
            certs = ()
        if not certs:
            log.warning("peer %s: its certificate chain could not be read; not tracked for CRL enforcement", peer)
            if self.metrics is not None:
                self.metrics.untracked_connection(reporter)
            return None
        t = Tracked(certs, reporter, peer, on_revoked, chain_links(certs))
        self._tracked.add(t)
        self._check(t)
        return t

    def untrack(self, t: Tracked | None) -> None:
        if t is not None:
            self._tracked.discard(t)

    def _check(self, t: Tracked) -> None:
        if t.revoked:
            return
        cert = self.current.revoked(t.chain, t.links)
        if cert is None:
            return
        t.revoked = True
        self._tracked.discard(t)
        if self.metrics is not None:
            self.metrics.rejected(t.reporter)
        what = "its certificate" if cert is t.chain[0] else "a CA certificate of its chain"
        # Upstream's Error::CertificateRevoked text, then which certificate a CRL update revoked.
        reason = (
            f"connection closed: peer certificate revoked by CRL ({what}, serial {cert.serial_number:x}, issuer "
            f"{cert.issuer.rfc4514_string()})"
        )
        log.warning("terminating connection with %s: %s", t.peer, reason)
        try:
            t.on_revoked(reason)
        except Exception:  # one connection failing to close must not stop the others
            log.exception("closing the revoked connection with %s failed", t.peer)

    @property
    def tracked(self) -> int:
        """How many open connections are tracked (admin, tests)."""
        return len(self._tracked)

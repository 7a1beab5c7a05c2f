"""Certificate providers: where the proxies get a :class:`WorkloadCertificate` for an identity.

The proxies only see the :class:`CertificateProvider` protocol. Two implementations are planned:

* :class:`LocalCertificateProvider` (here): signs with a :class:`~ztunnel.identity.ca.LocalCA`, for the fake CA
  mode and tests;
* the Istio CA client (later): CSRs to istiod's ``CreateCertificate`` with upstream's ``SecretManager``
  behaviour (priorities, at most 8 concurrent fetches, per-identity backoff).

Both refresh at the certificate's half-life (``WorkloadCertificate.refresh_at``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

from ztunnel.identity.ca import LocalCA
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity

__all__ = [
    "DEFAULT_CERT_TTL",
    "CertificateProvider",
    "CertificateState",
    "CertificateStatus",
    "Clock",
    "LocalCertificateProvider",
]

# Upstream's SECRET_TTL default (86400 s), also the lifetime of its fake CA certificates.
DEFAULT_CERT_TTL = timedelta(hours=24)

Clock = Callable[[], datetime]
"""Returns the current time as an aware UTC datetime; injected so tests can move time."""


def _utcnow() -> datetime:
    return datetime.now(UTC)


class CertificateProvider(Protocol):
    """Hands out the certificate for an identity, fetching or renewing it as needed."""

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        """A currently valid certificate for ``identity`` (cached until its refresh time)."""
        ...

    def forget(self, identity: Identity) -> None:
        """Drop ``identity``'s certificate, e.g. when the last local workload using it is removed."""
        ...


class CertificateStatus(enum.Enum):
    """Lifecycle of one identity's certificate, as upstream's ``CertState`` (shown in the admin config dump)."""

    INITIALIZING = "Initializing"
    AVAILABLE = "Available"
    UNAVAILABLE = "Unavailable"


@dataclass(frozen=True, slots=True)
class CertificateState:
    """Status of one identity's certificate: the certificate when available, the error when unavailable."""

    status: CertificateStatus
    certificate: WorkloadCertificate | None = None
    error: str | None = None

    @classmethod
    def initializing(cls) -> CertificateState:
        """A fetch is in progress and no certificate exists yet."""
        return cls(CertificateStatus.INITIALIZING)

    @classmethod
    def available(cls, certificate: WorkloadCertificate) -> CertificateState:
        """A certificate is cached."""
        return cls(CertificateStatus.AVAILABLE, certificate=certificate)

    @classmethod
    def unavailable(cls, error: str) -> CertificateState:
        """The last fetch failed and no certificate is cached."""
        return cls(CertificateStatus.UNAVAILABLE, error=error)


class LocalCertificateProvider:
    """A :class:`CertificateProvider` that signs locally with a :class:`LocalCA`.

    Signing is synchronous and takes about a millisecond (P-256 key generation plus one signature), so there is
    no in-flight state: a fetch either returns the cached certificate or issues a new one before returning.
    """

    def __init__(self, ca: LocalCA, ttl: timedelta = DEFAULT_CERT_TTL, *, clock: Clock = _utcnow) -> None:
        self._ca = ca
        self._ttl = ttl
        self._clock = clock
        self._states: dict[Identity, CertificateState] = {}

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        """The cached certificate if ``now`` is within ``[not_before, refresh_at)``, else a newly issued one."""
        now = self._clock()
        cached = self._states.get(identity)
        if cached is not None and cached.certificate is not None:
            cert = cached.certificate
            if cert.not_before <= now < cert.refresh_at:
                return cert
        try:
            cert = self._ca.issue(identity, self._ttl, now=now)
        except Exception as e:
            self._states[identity] = CertificateState.unavailable(f"local CA failed to sign for {identity}: {e}")
            raise
        self._states[identity] = CertificateState.available(cert)
        return cert

    def forget(self, identity: Identity) -> None:
        """Drop ``identity``'s cached certificate; the next fetch issues a new one."""
        self._states.pop(identity, None)

    def state(self, identity: Identity) -> CertificateState | None:
        """The state of ``identity``'s certificate, or ``None`` if it was never fetched (or was forgotten)."""
        return self._states.get(identity)

    def states(self) -> dict[Identity, CertificateState]:
        """A snapshot of every known identity's state, for the admin config dump."""
        return dict(self._states)

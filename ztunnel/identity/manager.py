"""Certificate providers: where the proxies get a :class:`WorkloadCertificate` for an identity.

The proxies only see the :class:`CertificateProvider` protocol. Two implementations:

* :class:`LocalCertificateProvider`: signs with a :class:`~ztunnel.identity.ca.LocalCA`, for the fake CA mode
  and tests;
* :class:`SecretManager`: upstream's ``SecretManager`` in front of the Istio CA client
  (:class:`~ztunnel.identity.caclient.CaClient`): CSRs to istiod's ``CreateCertificate`` with priorities, at
  most 8 concurrent fetches and per-identity backoff (theory of operation on the class).

Both refresh at the certificate's half-life (``WorkloadCertificate.refresh_at``).
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

from ztunnel.errors import ZtunnelError
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity
from ztunnel.tasks import TaskGroup

__all__ = [
    "DEFAULT_CERT_TTL",
    "CaClientProtocol",
    "CertificateProvider",
    "CertificateState",
    "CertificateStatus",
    "CertificateUnavailable",
    "Clock",
    "ExponentialBackoff",
    "LocalCertificateProvider",
    "PendingQueue",
    "Priority",
    "SecretManager",
]

log = logging.getLogger("ztunnel.identity")

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


# -- SecretManager: certificates from the Istio CA -------------------------------------------------------------------


class Priority(enum.IntEnum):
    """Why a certificate is being fetched; a higher priority is fetched first (upstream ``Priority``)."""

    BACKGROUND = 0  # refresh at half-life, or retry after a failure
    WARMUP = 1  # prefetch for a workload that just appeared on this node
    REALTIME = 2  # a connection is waiting for it


class CertificateUnavailable(ZtunnelError):
    """There is no certificate for the identity: its last fetch failed (the message says why) or it was forgotten.

    ``reason`` is the why alone, without the identity (the whole message when there is no more to it), for callers
    that name the identity themselves.
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


class CaClientProtocol(Protocol):
    """What :class:`SecretManager` needs from a CA client (:class:`~ztunnel.identity.caclient.CaClient`)."""

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        """Sign a new certificate for ``identity``; raise with a descriptive message on failure."""
        ...


class LocalCaClient:
    """A CA "client" that signs with a :class:`LocalCA` in-process: ``FAKE_CA=true`` behind the same
    :class:`SecretManager` as the Istio CA, so refresh, priorities and the admin view behave identically
    (upstream wraps its mock CA the same way)."""

    def __init__(self, ca: LocalCA, ttl: timedelta = DEFAULT_CERT_TTL) -> None:
        self.ca = ca
        self.ttl = ttl

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        return self.ca.issue(identity, self.ttl)


# Upstream's retry schedule after a failed fetch (``backoff`` crate settings in ``manager.rs``).
BACKOFF_INITIAL = 1.0
BACKOFF_MULTIPLIER = 2.0
BACKOFF_MAX = 150.0
BACKOFF_JITTER = 0.2
# The crate's default max_elapsed_time: after 15 minutes of failures it stops growing and returns the maximum.
BACKOFF_MAX_ELAPSED = 15 * 60.0
DEFAULT_CONCURRENCY = 8


class ExponentialBackoff:
    """Per-identity retry delays: 1 s doubling to 150 s, each randomised by ±20 %.

    ``now`` is a monotonic time in seconds; after :data:`BACKOFF_MAX_ELAPSED` since the first failure every delay
    is the maximum, as the ``backoff`` crate's ``max_elapsed_time``.
    """

    def __init__(
        self,
        now: float,
        rng: random.Random,
        initial: float = BACKOFF_INITIAL,
        maximum: float = BACKOFF_MAX,
    ) -> None:
        self.start = now
        self.current = initial
        self.maximum = maximum
        self._rng = rng

    def next(self, now: float) -> float:
        """The delay before the next attempt."""
        if now - self.start > BACKOFF_MAX_ELAPSED:
            return self.maximum
        delta = BACKOFF_JITTER * self.current
        delay = self.current - delta + self._rng.random() * 2 * delta
        self.current = min(self.current * BACKOFF_MULTIPLIER, self.maximum)
        return delay


class PendingQueue:
    """Identities waiting to be fetched, keyed by identity: highest priority first, then the earliest due time.

    ``push_increase`` only ever raises an identity's place (a higher priority, or the same priority due sooner),
    as upstream's ``push_increase`` on its keyed priority queue. A heap with lazy deletion keeps it O(log n).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Identity]] = []
        self._entries: dict[Identity, tuple[Priority, float, int]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, identity: object) -> bool:
        return identity in self._entries

    def get(self, identity: Identity) -> tuple[Priority, float] | None:
        """The queued (priority, due) of ``identity``."""
        e = self._entries.get(identity)
        return None if e is None else (e[0], e[1])

    def push_increase(self, identity: Identity, priority: Priority, due: float) -> None:
        """Queue ``identity``, or move it up if this (priority, due) ranks higher than the queued one."""
        cur = self._entries.get(identity)
        if cur is not None and (priority, -due) <= (cur[0], -cur[1]):
            return
        seq = next(self._seq)
        self._entries[identity] = (priority, due, seq)
        heapq.heappush(self._heap, (-priority, due, seq, identity))

    def remove(self, identity: Identity) -> None:
        """Drop ``identity`` (no-op when absent)."""
        self._entries.pop(identity, None)

    def peek(self) -> tuple[Identity, Priority, float] | None:
        """The first identity with its priority and due time, without removing it."""
        while self._heap:
            _, due, seq, identity = self._heap[0]
            e = self._entries.get(identity)
            if e is not None and e[2] == seq:
                return identity, e[0], due
            heapq.heappop(self._heap)  # stale: removed or superseded
        return None

    def pop(self) -> Identity:
        """Remove and return the first identity. Raises ``IndexError`` when empty."""
        top = self.peek()
        if top is None:
            raise IndexError("pop from an empty PendingQueue")
        heapq.heappop(self._heap)
        del self._entries[top[0]]
        return top[0]


class _Fetch(enum.Enum):
    PROCESSING = "processing"
    FORGETTING = "forgetting"  # forgotten while its fetch was in flight: the result is dropped


@dataclass(slots=True)
class _Entry:
    state: CertificateState
    priority: Priority | None  # while initializing: the highest priority asked for
    forgotten: bool = False
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def update(self, state: CertificateState) -> None:
        self.state = state
        if state.status is not CertificateStatus.INITIALIZING:
            self.priority = None
        self.wake()

    def wake(self) -> None:
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(None)
        self.waiters.clear()


class SecretManager:
    """Workload certificates from the Istio CA, cached per identity (upstream ``identity/manager.rs``).

    Theory of operation: there is one entry per identity, created by the first request for it. Concurrent requests
    for an identity share its one fetch. Fetches are queued by priority (a connection waiting, ``REALTIME``, before
    a prefetch, ``WARMUP``, before a refresh, ``BACKGROUND``; equal priorities by due time) and at most
    ``concurrency`` (8) run at once. A fetched certificate is served until replaced; its refresh is queued for
    its half-life. A failed fetch is retried after a per-identity backoff (1 s doubling to 150 s, ±20 % jitter);
    meanwhile a certificate that has not expired yet keeps being served, and its retry is brought forward to its
    expiry if that comes first. Only an identity with no valid certificate reports the error, to every caller,
    until a retry succeeds. :meth:`forget` drops an entry; an in-flight fetch for it is discarded on arrival.

    Time: refreshes are scheduled on the event loop's monotonic clock, so a wall-clock jump never moves them (a
    jump back causes no refresh storm, as upstream, whose ``time::Converter`` fixes the wall/monotonic offset at
    start). The wall clock (``clock``) is read where validity matters: a certificate is never handed out once it
    has expired by the wall clock (after a forward jump, or a suspend the monotonic clock did not count). Upstream
    would present it until its monotonic refresh time; here the caller waits for an immediate renewal instead, and
    gets :class:`CertificateUnavailable` if that fails. A certificate that arrives already expired is refused like
    a failed fetch (upstream would schedule its refresh "now", again and again: a loop against the CA).

    New certificates apply to new connections only: a handshake reads the certificate once, so established
    connections keep the one they were made with.
    """

    def __init__(
        self,
        client: CaClientProtocol,
        *,
        tasks: TaskGroup | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        clock: Clock = _utcnow,
        rng: random.Random | None = None,
        backoff_initial: float = BACKOFF_INITIAL,
        backoff_max: float = BACKOFF_MAX,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1, or fetches would never run")
        self.client = client
        self.concurrency = concurrency
        self._own_tasks = tasks is None
        self._tasks = tasks if tasks is not None else TaskGroup("secret-manager")
        self.clock = clock  # the wall clock (aware UTC datetimes); replaceable, for tests
        self._rng = rng if rng is not None else random.Random()
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._certs: dict[Identity, _Entry] = {}
        self._pending = PendingQueue()
        self._processing: dict[Identity, _Fetch] = {}
        self._backoffs: dict[Identity, ExponentialBackoff] = {}
        self._inflight = 0
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._watchers: list[Callable[[Identity, WorkloadCertificate | None], None]] = []
        # Counters for the admin page and tests.
        self.fetches_started = 0
        self.fetches_failed = 0
        self.max_inflight = 0

    # -- CertificateProvider -----------------------------------------------------------------------------------

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        """The certificate for ``identity``, fetching it at ``REALTIME`` priority if there is none yet."""
        return await self.fetch_certificate_pri(identity, Priority.REALTIME)

    def forget(self, identity: Identity) -> None:
        """Drop ``identity``'s entry (its last local workload left); waiters get :class:`CertificateUnavailable`."""
        entry = self._certs.pop(identity, None)
        if entry is None:
            return
        entry.forgotten = True
        entry.wake()
        self._tell(identity, None)
        self._backoffs.pop(identity, None)
        match self._processing.get(identity):
            case None:
                self._pending.remove(identity)
            case _Fetch.PROCESSING:
                self._processing[identity] = _Fetch.FORGETTING
            case _Fetch.FORGETTING:
                pass

    # -- more entry points -------------------------------------------------------------------------------------

    def watch(self, callback: Callable[[Identity, WorkloadCertificate | None], None]) -> None:
        """Call ``callback(identity, certificate)`` for each new certificate (a first fetch, a rotation) and
        ``callback(identity, None)`` when an identity is forgotten: the control process pushes these to the worker
        processes that hold the identity's certificate."""
        self._watchers.append(callback)

    def _tell(self, identity: Identity, cert: WorkloadCertificate | None) -> None:
        for callback in self._watchers:
            try:
                callback(identity, cert)
            except Exception:  # a watcher failing must not stop the manager
                log.exception("certificate watcher failed for %s", identity)

    async def fetch_certificate_pri(self, identity: Identity, priority: Priority) -> WorkloadCertificate:
        """Like :meth:`fetch_certificate` with an explicit priority."""
        entry = self._start_fetch(identity, priority)
        loop = asyncio.get_running_loop()
        while True:
            if entry.forgotten:
                raise CertificateUnavailable(f"certificate for {identity} was forgotten while being fetched")
            st = entry.state
            if st.status is CertificateStatus.AVAILABLE:
                assert st.certificate is not None
                if self.clock() < st.certificate.not_after:
                    return st.certificate
                self._renew_expired(identity, st.certificate, priority)
            if st.status is CertificateStatus.UNAVAILABLE:
                raise CertificateUnavailable(f"no certificate for {identity}: {st.error}", st.error)
            fut: asyncio.Future[None] = loop.create_future()
            entry.waiters.append(fut)
            await fut

    def prefetch(self, identity: Identity, priority: Priority = Priority.WARMUP) -> None:
        """Start fetching ``identity``'s certificate without waiting for it."""
        self._start_fetch(identity, priority)

    def state(self, identity: Identity) -> CertificateState | None:
        """The state of ``identity``'s certificate, or ``None`` if it has no entry."""
        entry = self._certs.get(identity)
        return None if entry is None else entry.state

    def states(self) -> dict[Identity, CertificateState]:
        """A snapshot of every identity's state, for the admin config dump."""
        return {identity: entry.state for identity, entry in self._certs.items()}

    @property
    def inflight(self) -> int:
        """Fetches running now."""
        return self._inflight

    async def close(self) -> None:
        """Stop the worker and in-flight fetches (when this manager owns its task group)."""
        if self._own_tasks:
            await self._tasks.cancel_all(timeout=1.0)
        elif self._worker is not None:
            self._worker.cancel()

    # -- the worker --------------------------------------------------------------------------------------------

    def _start_fetch(self, identity: Identity, priority: Priority) -> _Entry:
        entry = self._certs.get(identity)
        if entry is None:
            entry = _Entry(CertificateState.initializing(), priority)
            self._certs[identity] = entry
            self._request(identity, priority)
        elif entry.priority is not None and priority > entry.priority:
            entry.priority = priority
            self._request(identity, priority)
        return entry

    def _renew_expired(self, identity: Identity, cert: WorkloadCertificate, priority: Priority) -> None:
        """``cert`` is still cached but expired by the wall clock: fetch a new one now (once; callers then wait)."""
        if identity in self._processing:
            return
        queued = self._pending.get(identity)
        if queued is not None and queued[0] >= priority and queued[1] <= asyncio.get_running_loop().time():
            return
        log.info(
            "certificate for %s expired at %s (the wall clock says %s); renewing it before use",
            identity,
            cert.not_after.isoformat(),
            self.clock().isoformat(),
        )
        self._request(identity, priority)

    def _request(self, identity: Identity, priority: Priority) -> None:
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = self._tasks.spawn(self._run(), "secret manager")
        match self._processing.get(identity):
            case None:
                self._pending.push_increase(identity, priority, asyncio.get_running_loop().time())
            case _Fetch.FORGETTING:
                self._processing[identity] = _Fetch.PROCESSING  # wanted again: keep the in-flight result
            case _Fetch.PROCESSING:
                pass
        self._notify()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        wake = self._wake
        while True:
            wake.clear()
            delay: float | None = None
            top = self._pending.peek()
            if top is not None and self._inflight < self.concurrency:
                identity, _, due = top
                delay = due - loop.time()
                if delay <= 0:
                    self._pending.pop()
                    self._processing[identity] = _Fetch.PROCESSING
                    self._inflight += 1
                    self.max_inflight = max(self.max_inflight, self._inflight)
                    self.fetches_started += 1
                    self._tasks.spawn(self._fetch(identity), f"fetch certificate {identity}")
                    continue
            if delay is None:
                await wake.wait()
            else:
                try:
                    async with asyncio.timeout(delay):
                        await wake.wait()
                except TimeoutError:
                    pass

    async def _fetch(self, identity: Identity) -> None:
        cert: WorkloadCertificate | None = None
        error: str | None = None
        try:
            issued = await self.client.fetch_certificate(identity)
            if self.clock() >= issued.not_after:
                raise CertificateUnavailable(
                    f"the CA issued a certificate that has already expired (valid {issued.not_before.isoformat()} "
                    f"to {issued.not_after.isoformat()}); check the clocks of this node and of the CA"
                )
            cert = issued
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = str(e) or type(e).__name__
        finally:
            self._inflight -= 1
            self._notify()
        self._complete(identity, cert, error)

    def _complete(self, identity: Identity, cert: WorkloadCertificate | None, error: str | None) -> None:
        if self._processing.pop(identity, None) is _Fetch.FORGETTING:
            return
        entry = self._certs.get(identity)
        if entry is None:
            return
        now = asyncio.get_running_loop().time()
        wall = self.clock()
        if cert is not None:
            self._backoffs.pop(identity, None)
            entry.update(CertificateState.available(cert))
            self._tell(identity, cert)
            refresh_at = now + max(0.0, (cert.refresh_at - wall).total_seconds())
            log.debug("certificate fetch for %s succeeded; refresh in %.1fs", identity, refresh_at - now)
        else:
            self.fetches_failed += 1
            backoff = self._backoffs.get(identity)
            if backoff is None:
                backoff = ExponentialBackoff(now, self._rng, self._backoff_initial, self._backoff_max)
                self._backoffs[identity] = backoff
            delay = backoff.next(now)
            refresh_at = now + delay
            existing = entry.state.certificate
            if existing is not None and wall < existing.not_after:
                refresh_at = min(refresh_at, now + (existing.not_after - wall).total_seconds())
                log.info(
                    "certificate renewal for %s failed (%s); retaining the existing valid certificate until %s; "
                    "next retry in %.1fs",
                    identity,
                    error,
                    existing.not_after.isoformat(),
                    refresh_at - now,
                )
                entry.update(CertificateState.available(existing))
            else:
                log.warning(
                    "certificate fetch for %s failed (%s) and there is no valid existing certificate; "
                    "retrying in %.1fs (backoff capped at %gs)",
                    identity,
                    error,
                    delay,
                    self._backoff_max,
                )
                entry.update(CertificateState.unavailable(error or "unknown error"))
        self._pending.push_increase(identity, Priority.BACKGROUND, refresh_at)
        self._notify()

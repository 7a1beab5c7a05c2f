"""SecretManager: shared fetches, the concurrency limit, priorities, refresh at half-life, CA outages and backoff.

The integration tests run against the local control plane's CreateCertificate over real gRPC and TLS. The
scheduling tests (priorities, forgetting mid-fetch) use :class:`~ztunnel.testing.control_plane.InProcessCaClient`, a real CA client that signs in
process with a LocalCA, so the order of fetches is observable without a network in between.

Certificates from LocalCA are backdated by 60 s, so a TTL of 62 s puts the half-life 1 s from now: that is how these
tests see a refresh without waiting hours.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ztunnel.config import AuthSource, RootCertSource
from ztunnel.identity import CertificateProvider, CertificateStatus, WorkloadCertificate
from ztunnel.identity.caclient import CaClient
from ztunnel.identity.manager import (
    BACKOFF_MAX_ELAPSED,
    CertificateUnavailable,
    ExponentialBackoff,
    PendingQueue,
    Priority,
    SecretManager,
)
from ztunnel.identity.spiffe import Identity
from ztunnel.standins.istiod.server import XdsServer
from ztunnel.tasks import TaskGroup
from ztunnel.testing.control_plane import InProcessCaClient, control_plane, wait_until

TD = "cluster.local"
ID = Identity(TD, "default", "app")
HALF_LIFE_IN_1S = 62


def ident(i: int) -> Identity:
    return Identity(TD, "ns", f"sa{i}")


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[XdsServer]:
    async with control_plane(tmp_path, None) as server:
        yield server


@pytest.fixture
async def tasks() -> AsyncIterator[TaskGroup]:
    group = TaskGroup("test")
    yield group
    await group.cancel_all(timeout=2)


def ca_client(server: XdsServer, ttl: int = 3600) -> CaClient:
    assert server.root_cert_path is not None
    return CaClient(
        server.url,
        RootCertSource.parse(str(server.root_cert_path)),
        auth=AuthSource(None),
        cluster_id="Kubernetes",
        secret_ttl=ttl,
    )


@pytest.fixture
async def manager_for(tasks: TaskGroup) -> AsyncIterator[object]:
    clients: list[CaClient] = []

    def make(server: XdsServer, ttl: int = 3600, **kw: object) -> SecretManager:
        client = ca_client(server, ttl)
        clients.append(client)
        return SecretManager(client, tasks=tasks, rng=random.Random(7), **kw)  # type: ignore[arg-type]

    yield make
    await tasks.cancel_all(timeout=2)
    for c in clients:
        await c.close()


async def test_implements_the_protocol(cp: XdsServer, manager_for: object) -> None:
    m: CertificateProvider = manager_for(cp)  # type: ignore[operator]
    cert = await m.fetch_certificate(ID)
    assert cert.identity == ID


@pytest.mark.both_loops
async def test_concurrent_requests_share_one_fetch(cp: XdsServer, manager_for: object) -> None:
    m: SecretManager = manager_for(cp)  # type: ignore[operator]
    cp.ca_gate = asyncio.Event()
    waiters = [asyncio.ensure_future(m.fetch_certificate(ID)) for _ in range(10)]  # noqa: TID251
    await wait_until(lambda: len(cp.ca_requests) == 1, 2)
    assert m.state(ID) is not None and m.state(ID).status is CertificateStatus.INITIALIZING  # type: ignore[union-attr]
    cp.ca_gate.set()
    certs = await asyncio.gather(*waiters)
    assert all(c is certs[0] for c in certs)
    assert len(cp.ca_requests) == 1
    assert await m.fetch_certificate(ID) is certs[0]  # cached


async def test_at_most_eight_fetches_at_once(cp: XdsServer, manager_for: object) -> None:
    m: SecretManager = manager_for(cp)  # type: ignore[operator]
    cp.ca_gate = asyncio.Event()
    waiters = [asyncio.ensure_future(m.fetch_certificate(ident(i))) for i in range(20)]  # noqa: TID251
    await wait_until(lambda: cp.ca_inflight == 8, 2)
    await asyncio.sleep(0.1)
    assert cp.ca_inflight == 8 and m.inflight == 8 and len(cp.ca_requests) == 8
    cp.ca_gate.set()
    certs = await asyncio.gather(*waiters)
    assert [c.identity for c in certs] == [ident(i) for i in range(20)]
    assert cp.ca_max_inflight == 8 and m.max_inflight == 8
    assert m.fetches_started == 20


async def test_refresh_at_half_life(cp: XdsServer, manager_for: object) -> None:
    m: SecretManager = manager_for(cp, ttl=HALF_LIFE_IN_1S)  # type: ignore[operator]
    first = await m.fetch_certificate(ID)
    assert first.refresh_at - datetime.now(UTC) < timedelta(seconds=1.5)
    await wait_until(lambda: _cert(m) is not first, 3)
    replaced_at = datetime.now(UTC)
    # Replaced at its half-life (its refresh_at), not before and not much after.
    assert first.refresh_at - timedelta(milliseconds=50) <= replaced_at <= first.refresh_at + timedelta(seconds=1)
    second = await m.fetch_certificate(ID)
    assert second is not first and second.not_before > first.not_before
    assert len(cp.ca_requests) == 2


async def test_ca_outage_keeps_the_valid_certificate_and_renews_after(cp: XdsServer, manager_for: object) -> None:
    m: SecretManager = manager_for(cp, ttl=HALF_LIFE_IN_1S, backoff_initial=0.2)  # type: ignore[operator]
    first = await m.fetch_certificate(ID)
    await cp.stop()
    await wait_until(lambda: m.fetches_failed >= 2, 3)  # the refresh at half-life failed, and a retry
    state = m.state(ID)
    assert state is not None and state.status is CertificateStatus.AVAILABLE and state.certificate is first
    assert await m.fetch_certificate(ID) is first  # still served: valid for another minute
    await cp.start()
    await wait_until(lambda: _cert(m) is not first, 3)
    renewed = await m.fetch_certificate(ID)
    assert renewed.identity == ID and renewed.not_before > first.not_before


async def test_failures_back_off_and_are_reported(cp: XdsServer, manager_for: object) -> None:
    m: SecretManager = manager_for(cp, backoff_initial=0.1)  # type: ignore[operator]
    cp.fail_ca = "CA is down for maintenance"
    with pytest.raises(CertificateUnavailable, match=r"no certificate for .*/sa/app: .*UNAVAILABLE: CA is down"):
        await m.fetch_certificate(ID)
    await wait_until(lambda: len(cp.ca_requests) >= 4, 3)
    times = [r.at for r in cp.ca_requests[:4]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for i, gap in enumerate(gaps):
        expected = 0.1 * 2**i  # 100, 200, 400 ms, each +-20 %
        assert expected * 0.8 - 0.01 <= gap <= expected * 1.2 + 0.05, gaps
    # While unavailable, callers get the error at once instead of waiting for the next retry.
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(CertificateUnavailable):
        await m.fetch_certificate(ID)
    assert loop.time() - t0 < 0.05
    cp.fail_ca = None
    await wait_until(lambda: _cert(m) is not None, 3)
    assert (await m.fetch_certificate(ID)).identity == ID


def _cert(m: SecretManager) -> WorkloadCertificate | None:
    st = m.state(ID)
    return None if st is None else st.certificate


# -- scheduling, with an in-process CA ---------------------------------------------------------------------------


async def test_priorities_realtime_then_warmup_then_background(tasks: TaskGroup) -> None:
    ca = InProcessCaClient()
    m = SecretManager(ca, tasks=tasks, concurrency=1)
    ca.gate = asyncio.Event()
    first = asyncio.ensure_future(m.fetch_certificate(ident(0)))  # noqa: TID251
    await wait_until(lambda: ca.calls == [ident(0)], 1)
    m.prefetch(ident(1), Priority.BACKGROUND)
    m.prefetch(ident(2), Priority.WARMUP)
    m.prefetch(ident(3), Priority.WARMUP)
    realtime = asyncio.ensure_future(m.fetch_certificate(ident(4)))  # noqa: TID251
    await asyncio.sleep(0)
    m.prefetch(ident(5), Priority.WARMUP)
    upgraded = asyncio.ensure_future(m.fetch_certificate(ident(5)))  # noqa: TID251  (warmup -> realtime)
    ca.gate.set()
    await asyncio.gather(first, realtime, upgraded)
    await wait_until(lambda: len(ca.calls) == 6, 1)
    # Equal priorities run in the order they were asked for.
    assert ca.calls == [ident(0), ident(4), ident(5), ident(2), ident(3), ident(1)]


async def test_forget_during_fetch_discards_the_result(tasks: TaskGroup) -> None:
    ca = InProcessCaClient()
    m = SecretManager(ca, tasks=tasks)
    ca.gate = asyncio.Event()
    waiter = asyncio.ensure_future(m.fetch_certificate(ID))  # noqa: TID251
    await wait_until(lambda: len(ca.calls) == 1, 1)
    m.forget(ID)
    with pytest.raises(CertificateUnavailable, match="forgotten"):
        await waiter
    ca.gate.set()
    await asyncio.sleep(0.05)
    assert m.states() == {}
    assert (await m.fetch_certificate(ID)).identity == ID  # asked again: a new fetch
    assert len(ca.calls) == 2


async def test_expired_certificate_is_not_kept_through_a_failure(tasks: TaskGroup) -> None:
    # A certificate valid for another 62 s, then the wall clock jumps 70 s ahead: it has expired, so it is renewed
    # before use, and when that fails there is no valid certificate to keep: the identity becomes unavailable.
    ca = InProcessCaClient(ttl=timedelta(seconds=62))
    ahead = timedelta(0)

    def clock() -> datetime:
        return datetime.now(UTC) + ahead

    m = SecretManager(ca, tasks=tasks, clock=clock, backoff_initial=30)
    first = await m.fetch_certificate(ID)
    ca.failures = ["CA unreachable"]
    ahead = timedelta(seconds=70)
    with pytest.raises(CertificateUnavailable, match="CA unreachable"):
        await m.fetch_certificate(ID)
    assert first.identity == ID and len(ca.calls) == 2
    assert _status(m) is CertificateStatus.UNAVAILABLE


def _status(m: SecretManager) -> CertificateStatus | None:
    st = m.state(ID)
    return None if st is None else st.status


def test_pending_queue_order_and_push_increase() -> None:
    q = PendingQueue()
    q.push_increase(ident(1), Priority.BACKGROUND, 5.0)
    q.push_increase(ident(2), Priority.BACKGROUND, 3.0)
    q.push_increase(ident(3), Priority.WARMUP, 9.0)
    q.push_increase(ident(4), Priority.REALTIME, 10.0)
    q.push_increase(ident(1), Priority.BACKGROUND, 7.0)  # later: not an increase, ignored
    assert q.get(ident(1)) == (Priority.BACKGROUND, 5.0)
    q.push_increase(ident(1), Priority.BACKGROUND, 1.0)  # sooner: moves up
    q.push_increase(ident(2), Priority.REALTIME, 11.0)  # higher priority: moves up
    q.remove(ident(3))
    assert len(q) == 3 and ident(3) not in q
    assert [q.pop() for _ in range(3)] == [ident(4), ident(2), ident(1)]
    assert q.peek() is None
    with pytest.raises(IndexError):
        q.pop()


def test_backoff_schedule() -> None:
    b = ExponentialBackoff(0.0, random.Random(1))
    delays = [b.next(0.0) for _ in range(10)]
    for i, d in enumerate(delays):
        base = min(2.0**i, 150.0)
        assert base * 0.8 <= d <= base * 1.2
    assert delays[-1] >= 120  # capped at 150 s +-20 %
    assert b.next(BACKOFF_MAX_ELAPSED + 1) == 150.0  # after 15 minutes: the maximum, no jitter

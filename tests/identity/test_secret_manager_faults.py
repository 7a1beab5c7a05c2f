"""SecretManager under faults: the wall clock jumping around a certificate's expiry, and a CA answering garbage.

Refreshes are scheduled on the event loop's monotonic clock; the wall clock (``SecretManager.clock``, injected here)
only decides whether a certificate is still valid. A forward jump past expiry (or a suspend the monotonic clock did
not count) must renew before the certificate is used again, a backward jump must not make it renew at all, and an
expired certificate is never handed out. A CA that answers with something unusable is a failed fetch: the previous
certificate is kept while it is valid and the fetch is retried with backoff.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509

from xds.istio.v1.auth import ca_pb2, ca_pb2_grpc
from ztunnel.config import AuthSource, RootCertSource
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.caclient import CaClient
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.manager import CertificateStatus, CertificateUnavailable, SecretManager
from ztunnel.identity.spiffe import Identity
from ztunnel.standins.istiod.server import issue_server_certificate
from ztunnel.tasks import TaskGroup
from ztunnel.testing.control_plane import wait_until

TD = "cluster.local"
ID = Identity(TD, "default", "app")
OTHER = Identity(TD, "default", "other")
HOUR = timedelta(hours=1)


class JumpingClock:
    """The wall clock, moved by ``offset`` (the monotonic clock is not touched)."""

    def __init__(self) -> None:
        self.offset = timedelta(0)

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.offset


class ClockedCa:
    """A CA client signing in process with the same wall clock as ztunnel (a jump that happened to both, as after a
    suspend), or ``skew`` away from it; ``failure`` fails every fetch while set."""

    def __init__(self, clock: JumpingClock, ttl: timedelta = HOUR) -> None:
        self.ca = LocalCA.generate(TD)
        self.clock = clock
        self.ttl = ttl
        self.skew = timedelta(0)
        self.failure: str | None = None
        self.calls = 0

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        self.calls += 1
        if self.failure is not None:
            raise RuntimeError(self.failure)
        return self.ca.issue(identity, self.ttl, now=self.clock() + self.skew)


@pytest.fixture
async def tasks() -> AsyncIterator[TaskGroup]:
    group = TaskGroup("test")
    yield group
    await group.cancel_all(timeout=2)


@pytest.fixture
def clock() -> JumpingClock:
    return JumpingClock()


def manager(ca: Any, tasks: TaskGroup, clock: JumpingClock, backoff: float = 0.1) -> SecretManager:
    return SecretManager(ca, tasks=tasks, clock=clock, rng=random.Random(3), backoff_initial=backoff)


# -- clock jumps -------------------------------------------------------------------------------------------------


async def test_forward_jump_past_expiry_renews_before_use(
    tasks: TaskGroup, clock: JumpingClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ztunnel.identity")
    ca = ClockedCa(clock)
    m = manager(ca, tasks, clock)
    first = await m.fetch_certificate(ID)
    # Two hours later by the wall clock; the monotonic refresh (half-life, 30 minutes away) has not fired.
    clock.offset = 2 * HOUR
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    certs = await asyncio.gather(*(m.fetch_certificate(ID) for _ in range(20)))
    assert loop.time() - t0 < 0.5  # renewed at once, not at the scheduled refresh
    assert all(c is certs[0] for c in certs) and certs[0] is not first
    assert clock() < certs[0].not_after and certs[0].identity == ID
    assert ca.calls == 2  # the twenty callers shared one renewal
    assert f"certificate for {ID} expired at " in caplog.text and "renewing it before use" in caplog.text
    # The new certificate is the one served from now on, and its refresh is scheduled normally: no more fetches.
    await asyncio.sleep(0.2)
    assert await m.fetch_certificate(ID) is certs[0] and ca.calls == 2


async def test_backward_jump_causes_no_refresh_storm(tasks: TaskGroup, clock: JumpingClock) -> None:
    ca = ClockedCa(clock)
    m = manager(ca, tasks, clock)
    first = await m.fetch_certificate(ID)
    # This node's clock goes a day back (the CA's does not): the certificate, and any new one, is "not yet valid"
    # by this wall clock. Nothing is renewed for that; a renewal would not help, and one per use would be a storm.
    clock.offset = -24 * HOUR
    ca.skew = 24 * HOUR
    for _ in range(200):
        assert await asyncio.wait_for(m.fetch_certificate(ID), 1) is first
        await asyncio.sleep(0.001)
    assert ca.calls == 1 and m.fetches_started == 1
    # And back to the present: still the same certificate, still one fetch.
    clock.offset = timedelta(0)
    assert await m.fetch_certificate(ID) is first and ca.calls == 1


async def test_expired_certificate_is_never_served(
    tasks: TaskGroup, clock: JumpingClock, caplog: pytest.LogCaptureFixture
) -> None:
    ca = ClockedCa(clock)
    m = manager(ca, tasks, clock, backoff=0.2)
    await m.fetch_certificate(ID)
    # Past expiry, and the CA is down: the renewal fails, and callers get the reason, never the expired certificate.
    ca.failure = "CA unreachable"
    clock.offset = 2 * HOUR
    with pytest.raises(CertificateUnavailable, match=r"no certificate for .*/sa/app: CA unreachable"):
        await m.fetch_certificate(ID)
    assert "there is no valid existing certificate" in caplog.text
    state = m.state(ID)
    assert state is not None and state.status is CertificateStatus.UNAVAILABLE and state.certificate is None
    # Meanwhile callers fail at once and do not hammer the CA: only the backoff retries reach it.
    for _ in range(50):
        with pytest.raises(CertificateUnavailable):
            await m.fetch_certificate(ID)
    assert ca.calls == 2
    # The CA comes back: the next retry (0.2 s backoff) brings a valid certificate.
    ca.failure = None
    await wait_until(lambda: _status(m) is CertificateStatus.AVAILABLE, 2)
    renewed = await m.fetch_certificate(ID)
    assert renewed.identity == ID and clock() < renewed.not_after


def _status(m: SecretManager, identity: Identity = ID) -> CertificateStatus | None:
    st = m.state(identity)
    return None if st is None else st.status


# -- a CA answering garbage --------------------------------------------------------------------------------------


async def test_already_expired_certificates_from_the_ca_are_refused_with_backoff(
    tasks: TaskGroup, clock: JumpingClock, caplog: pytest.LogCaptureFixture
) -> None:
    ca = ClockedCa(clock)
    ca.skew = -2 * HOUR  # the CA's clock is two hours behind: what it signs has expired an hour ago
    m = manager(ca, tasks, clock, backoff=0.1)
    with pytest.raises(CertificateUnavailable, match=r"already expired .* check the clocks"):
        await asyncio.wait_for(m.fetch_certificate(ID), 1)
    # Retried with backoff (0.1, 0.2, 0.4 s ...), not in a loop: a refresh "due now" would ask again at once.
    await asyncio.sleep(0.5)
    assert 2 <= ca.calls <= 4
    ca.skew = timedelta(0)
    await wait_until(lambda: _status(m) is CertificateStatus.AVAILABLE, 2)
    assert clock() < (await m.fetch_certificate(ID)).not_after


class RogueCa(ca_pb2_grpc.IstioCertificateServiceServicer):
    """A CA over real gRPC and TLS whose answer the test chooses: ``good``, ``not-pem``, ``wrong-identity``,
    ``expired``. Records when each request arrived."""

    def __init__(self, ca: LocalCA) -> None:
        self.ca = ca
        self.mode = "good"
        self.requests: list[tuple[float, str]] = []

    async def CreateCertificate(self, request: Any, context: Any) -> Any:
        self.requests.append((asyncio.get_running_loop().time(), self.mode))
        csr = x509.load_pem_x509_csr(request.csr.encode())
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        identity = Identity.parse(san.get_values_for_type(x509.UniformResourceIdentifier)[0])
        if self.mode == "not-pem":
            return ca_pb2.IstioCertificateResponse(cert_chain=["garbage, not a certificate", "more garbage"])
        ttl, now = timedelta(seconds=61), None  # refreshed at half-life: 0.5 s from now
        if self.mode == "wrong-identity":
            identity = OTHER
        elif self.mode == "expired":
            ttl, now = HOUR, datetime.now(UTC) - 3 * HOUR
        leaf = self.ca._sign_leaf(csr.public_key(), identity, ttl, now)  # type: ignore[arg-type]
        return ca_pb2.IstioCertificateResponse(cert_chain=self.ca.cert_chain(leaf))


async def test_garbage_from_the_ca_keeps_the_previous_certificate(
    tmp_path: Path, tasks: TaskGroup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ztunnel.identity")
    ca = LocalCA.generate(TD)
    root = tmp_path / "root.pem"
    root.write_text(ca.root_pem())
    rogue = RogueCa(ca)
    server = grpc.aio.server()
    ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(rogue, server)
    chain, key = issue_server_certificate(ca, ["localhost"], ["127.0.0.1"], Identity(TD, "istio-system", "istiod"))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, chain)]))
    await server.start()
    # Impersonation (shared mode), where the identity in the answer is checked, as upstream.
    client = CaClient(
        f"https://127.0.0.1:{port}",
        RootCertSource.parse(str(root)),
        auth=AuthSource(None),
        cluster_id="Kubernetes",
        impersonate=True,
    )
    try:
        # Retries 50 ms doubling to 400 ms, so the three kinds of garbage fit in about two seconds.
        m = SecretManager(client, tasks=tasks, rng=random.Random(5), backoff_initial=0.05, backoff_max=0.4)
        first = await m.fetch_certificate(ID)
        expected = {
            "not-pem": "returned an unusable certificate",
            "wrong-identity": f"issued a certificate for {OTHER}, but {ID} was requested",
            "expired": "issued a certificate that has already expired",
        }
        for mode, reason in expected.items():
            rogue.mode = mode
            start = len(rogue.requests)
            # The refresh at half-life (or the next retry) gets garbage, and so does the retry after it.
            await wait_until(lambda: len(rogue.requests) >= start + 2, 5)  # noqa: B023 - awaited in the iteration
            assert f"certificate renewal for {ID} failed ({'' if mode != 'not-pem' else 'CA at '}" in caplog.text
            assert reason in caplog.text, caplog.text
            assert "retaining the existing valid certificate" in caplog.text
            # The previous certificate is kept and served.
            state = m.state(ID)
            assert state is not None and state.status is CertificateStatus.AVAILABLE and state.certificate is first
            assert await m.fetch_certificate(ID) is first
            caplog.clear()
        # The retries backed off: 50 ms doubling (+-20 %) up to 400 ms, never faster; at a constant 50 ms the
        # first five would take 0.2 s, not 0.6.
        times = [t for t, md in rogue.requests if md != "good"]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert len(gaps) >= 4 and all(g > 0.04 for g in gaps) and sum(gaps[:4]) > 0.55, gaps
        # A good answer again: renewed.
        rogue.mode = "good"
        await wait_until(lambda: m.state(ID).certificate is not first, 5)  # type: ignore[union-attr]
        renewed = await m.fetch_certificate(ID)
        assert renewed.identity == ID and renewed is not first
    finally:
        await client.close()
        await server.stop(None)

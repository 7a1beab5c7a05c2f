from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ztunnel.identity import (
    CertificateProvider,
    CertificateStatus,
    Identity,
    LocalCA,
    LocalCertificateProvider,
)

ID = Identity("cluster.local", "default", "app")
TTL = timedelta(hours=24)


class FakeClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2031, 1, 1, tzinfo=UTC))


@pytest.fixture
def provider(clock: FakeClock) -> LocalCertificateProvider:
    return LocalCertificateProvider(LocalCA.generate("cluster.local"), TTL, clock=clock)


async def test_implements_the_protocol(provider: LocalCertificateProvider) -> None:
    p: CertificateProvider = provider  # checked by mypy
    cert = await p.fetch_certificate(ID)
    assert cert.identity == ID


async def test_cached_until_refresh_at_then_reissued(provider: LocalCertificateProvider, clock: FakeClock) -> None:
    first = await provider.fetch_certificate(ID)
    # Issued at the injected time, not the wall clock.
    assert first.not_after == clock.now + TTL

    clock.now = first.refresh_at - timedelta(seconds=1)
    assert await provider.fetch_certificate(ID) is first

    clock.now = first.refresh_at
    second = await provider.fetch_certificate(ID)
    assert second is not first
    assert second.cert.serial_number != first.cert.serial_number
    assert second.not_after == clock.now + TTL
    assert await provider.fetch_certificate(ID) is second


async def test_reissued_when_clock_is_before_not_before(provider: LocalCertificateProvider, clock: FakeClock) -> None:
    first = await provider.fetch_certificate(ID)
    clock.now = first.not_before - timedelta(seconds=1)  # clock stepped back
    assert await provider.fetch_certificate(ID) is not first


async def test_identities_are_cached_separately(provider: LocalCertificateProvider) -> None:
    other = Identity("cluster.local", "default", "other")
    a, b = await provider.fetch_certificate(ID), await provider.fetch_certificate(other)
    assert (a.identity, b.identity) == (ID, other)
    assert await provider.fetch_certificate(ID) is a


async def test_forget_and_states(provider: LocalCertificateProvider) -> None:
    assert provider.state(ID) is None
    cert = await provider.fetch_certificate(ID)
    state = provider.state(ID)
    assert state is not None and state.status is CertificateStatus.AVAILABLE and state.certificate is cert
    assert set(provider.states()) == {ID}

    provider.forget(ID)
    assert provider.state(ID) is None
    assert await provider.fetch_certificate(ID) is not cert


async def test_signing_failure_is_recorded(clock: FakeClock) -> None:
    provider = LocalCertificateProvider(LocalCA.generate("cluster.local"), timedelta(0), clock=clock)
    with pytest.raises(ValueError, match="ttl must be positive"):
        await provider.fetch_certificate(ID)
    state = provider.state(ID)
    assert state is not None and state.status is CertificateStatus.UNAVAILABLE
    assert state.error is not None and str(ID) in state.error

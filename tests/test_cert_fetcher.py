"""CertFetcher: prefetch for this node's HBONE workloads, forget when the last one leaves (upstream cert_fetcher.rs)."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator

import pytest

from ztunnel.cert_fetcher import CertFetcher
from ztunnel.identity import CertificateStatus
from ztunnel.identity.manager import SecretManager
from ztunnel.identity.spiffe import Identity
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.workload import InboundProtocol, Workload
from ztunnel.tasks import TaskGroup
from ztunnel.testing.control_plane import InProcessCaClient, wait_until

TD = "cluster.local"


def workload(uid: str, sa: str, node: str = "n1", hbone: bool = True, native: bool = False) -> Workload:
    return Workload(
        uid=uid,
        name=uid,
        namespace="ns",
        service_account=sa,
        trust_domain=TD,
        node=node,
        workload_ips=(ipaddress.ip_address("10.0.0.1"),),
        protocol=InboundProtocol.HBONE if hbone else InboundProtocol.TCP,
        native_tunnel=native,
    )


def ident(sa: str) -> Identity:
    return Identity(TD, "ns", sa)


@pytest.fixture
async def setup() -> AsyncIterator[tuple[ProxyState, SecretManager, InProcessCaClient, CertFetcher]]:
    tasks = TaskGroup("test")
    ca = InProcessCaClient()
    manager = SecretManager(ca, tasks=tasks)
    state = ProxyState("n1")
    fetcher = CertFetcher(state, manager, "n1")
    yield state, manager, ca, fetcher
    fetcher.close()
    await tasks.cancel_all(timeout=2)


async def test_prefetches_node_local_hbone_and_native_tunnel_workloads(
    setup: tuple[ProxyState, SecretManager, InProcessCaClient, CertFetcher],
) -> None:
    state, manager, ca, fetcher = setup
    state.apply(
        StateUpdate(
            workloads=[
                workload("a", "hbone"),
                workload("b", "tcp", hbone=False),
                workload("c", "native", hbone=False, native=True),
                workload("d", "elsewhere", node="n2"),
            ]
        )
    )
    await wait_until(lambda: len(ca.calls) == 2, 1)
    assert sorted(ca.calls) == [ident("hbone"), ident("native")]
    await wait_until(lambda: all(s.status is CertificateStatus.AVAILABLE for s in manager.states().values()), 1)
    assert fetcher.identities == {ident("hbone"), ident("native")}


async def test_forgets_when_the_last_workload_of_an_identity_leaves(
    setup: tuple[ProxyState, SecretManager, InProcessCaClient, CertFetcher],
) -> None:
    state, manager, ca, _ = setup
    state.apply(StateUpdate(workloads=[workload("a1", "shared"), workload("a2", "shared"), workload("b", "solo")]))
    await wait_until(lambda: len(manager.states()) == 2, 1)
    state.apply(StateUpdate(removed_workloads=["a1", "b"]))
    assert set(manager.states()) == {ident("shared")}  # a2 still uses it
    state.apply(StateUpdate(removed_workloads=["a2"]))
    assert manager.states() == {}
    # A workload changing to plain TCP no longer needs its certificate either.
    state.apply(StateUpdate(workloads=[workload("c", "flip")]))
    assert set(manager.states()) == {ident("flip")}
    state.apply(StateUpdate(workloads=[workload("c", "flip", hbone=False)]))
    assert manager.states() == {}
    assert len(ca.calls) <= 4

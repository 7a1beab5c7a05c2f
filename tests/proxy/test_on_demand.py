"""XDS_ON_DEMAND on the proxy side, without sockets: ``ProxyInputs.fetch_address`` (upstream ``fetch_address``) and
the ADS client's ``demand`` as the outbound path uses it. The whole path over real gRPC and two ztunnel processes is
``tests/xds/test_e2e_control_plane.py::test_on_demand_vip_becomes_routable_on_first_use``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Any

import pytest

from ztunnel.config import from_env
from ztunnel.proxy import inputs as proxy_inputs
from ztunnel.proxy.inputs import ProxyInputs
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.workload import NetworkAddress, Workload
from ztunnel.tasks import TaskGroup
from ztunnel.xds.client import AdsClient, ResourceKey
from ztunnel.xds.types import ADDRESS_TYPE
from ztunnel.xds.updater import AddressHandler, AuthorizationHandler

KNOWN = NetworkAddress("", ipaddress.ip_address("10.0.0.1"))
UNKNOWN = NetworkAddress("", ipaddress.ip_address("10.96.0.1"))


def inputs(state: ProxyState, on_demand: Any) -> ProxyInputs:
    # fetch_address reads only the state and the hook; the rest of the inputs are not touched.
    unused: Any = None
    cfg = from_env({"XDS_ADDRESS": ""})
    return ProxyInputs(cfg, state, unused, unused, unused, unused, unused, unused, unused, on_demand=on_demand)


@pytest.fixture
def state() -> ProxyState:
    s = ProxyState()
    s.apply(StateUpdate(workloads=[Workload(uid="u1", name="a", namespace="ns", workload_ips=(KNOWN.address,))]))
    return s


async def test_asks_only_for_addresses_the_state_does_not_know(state: ProxyState) -> None:
    asked: list[NetworkAddress] = []

    async def on_demand(addr: NetworkAddress) -> None:
        asked.append(addr)
        # The answer lands in the state before the demand returns, as the xDS client applies it first.
        state.apply(StateUpdate(workloads=[Workload(uid="u2", name="b", namespace="ns", workload_ips=(addr.address,))]))

    pi = inputs(state, on_demand)
    await pi.fetch_address(KNOWN, "ns")
    assert asked == []
    await pi.fetch_address(UNKNOWN, "ns")
    assert asked == [UNKNOWN] and state.find_address(UNKNOWN) is not None
    await pi.fetch_address(UNKNOWN, "ns")  # known now
    assert asked == [UNKNOWN]
    await inputs(state, None).fetch_address(NetworkAddress("", ipaddress.ip_address("10.9.9.9")))  # no on-demand


async def test_unanswered_demand_is_bounded(
    state: ProxyState, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(proxy_inputs, "ON_DEMAND_TIMEOUT", 0.05)

    async def never(addr: NetworkAddress) -> None:
        await asyncio.Event().wait()

    with caplog.at_level(logging.WARNING, "ztunnel.proxy"):
        await asyncio.wait_for(inputs(state, never).fetch_address(UNKNOWN), 2)
    assert "on-demand xDS lookup of /10.96.0.1 not answered within 0.05s" in caplog.text


async def test_client_demand_is_shared_and_cancellable() -> None:
    # Not connected: demands queue for the next stream. Two callers for one name make one request; a caller that
    # gives up leaves no waiter behind, and the name stays pending (a reconnect asks again).
    cfg = from_env(
        {
            "XDS_ADDRESS": "https://127.0.0.1:1",
            "XDS_ON_DEMAND": "true",
            "ISTIO_META_DNS_CAPTURE": "false",
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": "ns/a/a",
        }
    )
    state = ProxyState()
    client = AdsClient(cfg, [AddressHandler(state), AuthorizationHandler(state)])
    tasks = TaskGroup("test")
    first = tasks.spawn(client.demand(ADDRESS_TYPE, str(UNKNOWN)), "first")
    second = tasks.spawn(client.demand(ADDRESS_TYPE, str(UNKNOWN)), "second")
    await asyncio.sleep(0)
    assert [list(r.resource_names_subscribe) for r in client._queued_demands] == [["/10.96.0.1"]]
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert len(client._demand_waiters[ResourceKey(ADDRESS_TYPE, "/10.96.0.1")]) == 1
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(second, 0.01)
    assert client._demand_waiters == {}
    assert client.core.pending_demands == {ResourceKey(ADDRESS_TYPE, "/10.96.0.1")}


async def test_inbound_waypoint_target_fetched_on_demand(state: ProxyState) -> None:
    # Inbound (upstream validate_destination): an HBONE target other than the dialled IP may be a workload or VIP
    # whose waypoint is us, which the state may not hold yet; it is fetched before the check. The dialled IP, a
    # hostname authority and an authority that does not parse ask for nothing.
    from ztunnel.proxy.inbound import Inbound

    asked: list[NetworkAddress] = []

    async def on_demand(addr: NetworkAddress) -> None:
        asked.append(addr)

    inbound = Inbound(inputs(state, on_demand), lambda conn, workload: None)
    dialled = KNOWN.address
    await inbound._fetch_target(f"{dialled}:8080", dialled)
    await inbound._fetch_target("echo.default.svc.cluster.local:80", dialled)
    await inbound._fetch_target("not an authority", dialled)
    assert asked == []
    await inbound._fetch_target(f"{UNKNOWN.address}:80", dialled)
    assert asked == [UNKNOWN]

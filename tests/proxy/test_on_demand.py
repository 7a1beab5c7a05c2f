"""XDS_ON_DEMAND on the proxy side, without sockets: ``ProxyInputs.fetch_address`` (upstream ``fetch_address``) and
the ADS client's ``demand`` as the outbound path uses it. The whole path over real gRPC and two ztunnel processes is
``tests/xds/test_e2e_control_plane.py::test_on_demand_vip_becomes_routable_on_first_use``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from typing import Any

import pytest

from ztunnel.config import from_env
from ztunnel.proxy import inputs as proxy_inputs
from ztunnel.proxy.common import ProxyError
from ztunnel.proxy.inputs import ProxyInputs
from ztunnel.proxy.outbound import OutboundProtocol, build_request, fetch_references
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import Endpoint, Service
from ztunnel.state.workload import GatewayAddress, NamespacedHostname, NetworkAddress, Workload
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
    asked: list[str] = []

    async def on_demand(name: str) -> None:
        asked.append(name)
        # The answer lands in the state before the demand returns, as the xDS client applies it first.
        ip = NetworkAddress.parse(name).address
        state.apply(StateUpdate(workloads=[Workload(uid="u2", name="b", namespace="ns", workload_ips=(ip,))]))

    pi = inputs(state, on_demand)
    await pi.fetch_address(KNOWN, "ns")
    assert asked == []
    await pi.fetch_address(UNKNOWN, "ns")
    assert asked == [str(UNKNOWN)] and state.find_address(UNKNOWN) is not None
    await pi.fetch_address(UNKNOWN, "ns")  # known now
    assert asked == [str(UNKNOWN)]
    await inputs(state, None).fetch_address(NetworkAddress("", ipaddress.ip_address("10.9.9.9")))  # no on-demand


async def test_unanswered_demand_is_bounded(
    state: ProxyState, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(proxy_inputs, "ON_DEMAND_TIMEOUT", 0.05)

    async def never(name: str) -> None:
        await asyncio.Event().wait()

    with caplog.at_level(logging.WARNING, "ztunnel.proxy"):
        await asyncio.wait_for(inputs(state, never).fetch_address(UNKNOWN), 2)
    assert "on-demand xDS lookup of /10.96.0.1 not answered within 0.05s" in caplog.text


async def test_client_demand_is_shared_and_cancellable() -> None:
    # Not connected: a demand is recorded for the next stream's initial request (no version). Two callers for one
    # name make one record; a caller that gives up leaves no waiter behind, and the name stays pending (a reconnect
    # asks again).
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
    (initial_address, _authorization) = client.core.initial_requests()
    assert dict(initial_address.initial_resource_versions) == {"/10.96.0.1": ""}
    assert client.core.pending_demands == {ResourceKey(ADDRESS_TYPE, "/10.96.0.1")}
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

    asked: list[str] = []

    async def on_demand(name: str) -> None:
        asked.append(name)

    inbound = Inbound(inputs(state, on_demand), lambda conn, workload: None)
    dialled = KNOWN.address
    await inbound._fetch_target(f"{dialled}:8080", dialled)
    await inbound._fetch_target("echo.default.svc.cluster.local:80", dialled)
    await inbound._fetch_target("not an authority", dialled)
    assert asked == []
    await inbound._fetch_target(f"{UNKNOWN.address}:80", dialled)
    assert asked == [str(UNKNOWN)]


# -- every lookup upstream makes on demand (issue 18) ----------------------------------------------------------------

CLIENT = Workload(uid="c", name="client", namespace="ns", workload_ips=(KNOWN.address,), network="net-a")
VIP = ipaddress.ip_address("10.96.0.10")


class Answers:
    """A control plane that answers names from a table (a batch of workloads/services each), recording the asks."""

    def __init__(self, state: ProxyState, table: dict[str, StateUpdate]) -> None:
        self.state, self.table, self.asked = state, table, list[str]()

    async def __call__(self, name: str) -> None:
        self.asked.append(name)
        update = self.table.get(name)
        if update is not None:
            self.state.apply(update)


def echo_service(**kw: Any) -> Service:
    return Service(
        name="echo", namespace="ns", hostname="echo.ns.svc.cluster.local", vips=(NetworkAddress("net-a", VIP),),
        ports={80: 8080}, **kw,
    )  # fmt: skip


async def test_outbound_asks_for_a_service_waypoint_by_hostname() -> None:
    state = ProxyState()
    wp_host = NamespacedHostname("ns", "waypoint.ns.svc.cluster.local")
    state.apply(StateUpdate(workloads=[CLIENT], services=[echo_service(waypoint=GatewayAddress(wp_host, 15008))]))
    waypoint = Workload(uid="w", name="waypoint", namespace="ns", workload_ips=(ipaddress.ip_address("10.0.0.9"),),
                        network="net-a", services={wp_host: {15008: 15008}})  # fmt: skip
    wp_svc = Service(name="waypoint", namespace="ns", hostname=wp_host.hostname, ports={15008: 15008})
    answers = Answers(state, {str(wp_host): StateUpdate(workloads=[waypoint], services=[wp_svc])})
    pi = inputs_on(state, answers)
    with pytest.raises(ProxyError, match="waypoint"):
        build_request(state, CLIENT, KNOWN.address, (VIP, 80), "net-a", random.Random(1))
    await fetch_references(pi, CLIENT, VIP)
    assert answers.asked == [str(wp_host)]
    req = build_request(state, CLIENT, KNOWN.address, (VIP, 80), "net-a", random.Random(1))
    assert req.actual_destination == (waypoint.workload_ips[0], 15008)
    await fetch_references(pi, CLIENT, VIP)
    assert answers.asked == [str(wp_host)]  # known now: nothing more asked


async def test_outbound_asks_for_a_network_gateway() -> None:
    state = ProxyState()
    gw_addr = NetworkAddress("net-b", ipaddress.ip_address("172.16.0.1"))
    remote = Workload(uid="r", name="remote", namespace="ns", network="net-b",
                      network_gateway=GatewayAddress(gw_addr, 15008),
                      services={NamespacedHostname("ns", "echo.ns.svc.cluster.local"): {80: 8080}})  # fmt: skip
    state.apply(StateUpdate(workloads=[CLIENT, remote], services=[echo_service()]))
    gateway = Workload(uid="g", name="ewgw", namespace="istio-system", workload_ips=(gw_addr.address,),
                       network="net-b")  # fmt: skip
    answers = Answers(state, {str(gw_addr): StateUpdate(workloads=[gateway])})
    with pytest.raises(ProxyError, match="network gateway"):
        build_request(state, CLIENT, KNOWN.address, (VIP, 80), "net-a", random.Random(1))
    await fetch_references(inputs_on(state, answers), CLIENT, VIP)
    assert answers.asked == ["net-b/172.16.0.1"]
    req = build_request(state, CLIENT, KNOWN.address, (VIP, 80), "net-a", random.Random(1))
    assert req.protocol is OutboundProtocol.DOUBLE_HBONE and req.actual_destination == (gw_addr.address, 15008)


async def test_outbound_asks_for_a_workload_waypoints_endpoints_by_uid() -> None:
    # check_from_waypoint: the destination's waypoint is a service whose endpoint workloads are fetched by UID.
    state = ProxyState()
    wp_host = NamespacedHostname("ns", "waypoint.ns.svc.cluster.local")
    server_ip = ipaddress.ip_address("10.0.0.2")
    server = Workload(uid="s", name="server", namespace="ns", workload_ips=(server_ip,), network="net-a",
                      waypoint=GatewayAddress(wp_host, 15008))  # fmt: skip
    wp_svc = Service(name="waypoint", namespace="ns", hostname=wp_host.hostname, ports={15008: 15008})
    state.apply(StateUpdate(workloads=[CLIENT, server], services=[wp_svc]))
    state.services.insert_endpoint(wp_svc.key, Endpoint("wp-uid", {15008: 15008}))  # an endpoint not known yet
    waypoint = Workload(uid="wp-uid", name="waypoint", namespace="ns", workload_ips=(ipaddress.ip_address("10.0.0.9"),),
                        network="net-a", services={wp_host: {15008: 15008}})  # fmt: skip
    answers = Answers(state, {"wp-uid": StateUpdate(workloads=[waypoint])})
    await fetch_references(inputs_on(state, answers), CLIENT, server_ip)
    assert answers.asked == ["wp-uid"]


async def test_inbound_peer_asked_for_unless_through_a_gateway() -> None:
    from ztunnel.proxy.inbound import Inbound

    state = ProxyState()
    peer = NetworkAddress("", ipaddress.ip_address("10.0.5.5"))
    client = Workload(uid="p", name="peer", namespace="ns", workload_ips=(peer.address,))
    answers = Answers(state, {str(peer): StateUpdate(workloads=[client])})
    inbound = Inbound(inputs(state, answers), lambda conn, workload: None)
    assert await inbound._workload_at_peer(peer.address, {"x-forwarded-network": "net-b"}) is None
    assert answers.asked == []  # through a gateway the IP is the gateway's: never looked up
    assert await inbound._workload_at_peer(peer.address, {}) == client
    assert answers.asked == [str(peer)]


def inputs_on(state: ProxyState, on_demand: Any) -> ProxyInputs:
    """Inputs of a ztunnel on network net-a (where the service VIP is)."""
    unused: Any = None
    cfg = from_env({"XDS_ADDRESS": "", "NETWORK": "net-a"})
    return ProxyInputs(cfg, state, unused, unused, unused, unused, unused, unused, unused, on_demand=on_demand)

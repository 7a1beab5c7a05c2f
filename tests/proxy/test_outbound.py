"""``build_request``: where an outbound connection goes, decided from xDS state alone (no sockets).

The table follows upstream's ``proxy/outbound.rs`` ``build_request_*`` tests (same addresses, same expectations,
translated to our types); upstream ``state.rs`` ``test_load_balance``, ``find_upstream_port_mappings`` and
``test_sample_weighted_waypoint`` are covered below it. Randomness comes from a seeded ``random.Random``, so every
distribution check is exact for a given seed, not statistical.
"""

from __future__ import annotations

import collections
import ipaddress
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from ztunnel.identity.spiffe import Identity
from ztunnel.net import format_addr
from ztunnel.proxy.common import ProxyError, ResponseFlag
from ztunnel.proxy.outbound import OutboundProtocol, Request, build_request
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import (
    Endpoint,
    IpFamily,
    LoadBalancer,
    LoadBalancerHealthPolicy,
    LoadBalancerMode,
    LoadBalancerScope,
    Service,
    Visibility,
    WeightedWaypoint,
)
from ztunnel.state.upstream import ResolutionMode, find_upstream, load_balance
from ztunnel.state.workload import (
    ApplicationTunnel,
    AppTunnelProtocol,
    GatewayAddress,
    HealthStatus,
    InboundProtocol,
    IPAddress,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    Workload,
)

TD = "cluster.local"
NS = "ns"
TCP = InboundProtocol.TCP
HBONE = InboundProtocol.HBONE


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def addr(text: str) -> tuple[IPAddress, int]:
    host, _, port = text.rpartition(":")
    return ip(host.strip("[]")), int(port)


def wl(
    name: str,
    *ips: str,
    ns: str = NS,
    sa: str | None = None,
    protocol: InboundProtocol = TCP,
    services: Mapping[str, Mapping[int, int]] | None = None,
    **kw: Any,
) -> Workload:
    """A pod. ``services`` maps ``"ns/hostname"`` to its port map (service port -> target port)."""
    return Workload(
        uid=f"cluster1//v1/Pod/{ns}/{name}",
        name=name,
        namespace=ns,
        workload_ips=tuple(ip(i) for i in ips),
        trust_domain=TD,
        service_account=sa if sa is not None else name,
        protocol=protocol,
        services={NamespacedHostname.parse(k): dict(v) for k, v in (services or {}).items()},
        **kw,
    )


def svc(hostname: str, *vips: str, ns: str = NS, ports: Mapping[int, int] | None = None, **kw: Any) -> Service:
    return Service(
        name=hostname.split(".", maxsplit=1)[0],
        namespace=ns,
        hostname=hostname,
        vips=tuple(NetworkAddress.parse(v if "/" in v else f"/{v}") for v in vips),
        ports=dict(ports if ports is not None else {80: 8080}),
        **kw,
    )


def gw_addr(ip_text: str, port: int = 15008, network: str = "") -> GatewayAddress:
    return GatewayAddress(NetworkAddress(network, ip(ip_text)), port)


def gw_host(hostname: str, ns: str = NS, port: int = 15008) -> GatewayAddress:
    return GatewayAddress(NamespacedHostname(ns, hostname), port)


# The fixed part of every upstream build_request test: the source (dual-stack) and two waypoint pods.
SOURCE = wl("source-workload", "127.0.0.1", "::1", sa="default", node="local-node")
WAYPOINT = wl("waypoint-workload", "127.0.0.10", sa="waypoint-sa", node="local-node")
WAYPOINT_DUAL = wl("waypoint-workload-dual", "127.0.0.11", "ff06::c5", sa="waypoint-sa", node="local-node")


def make_state(*objs: Workload | Service, base: bool = True) -> ProxyState:
    state = ProxyState("local-node")
    items = [SOURCE, WAYPOINT, WAYPOINT_DUAL, *objs] if base else list(objs)
    state.apply(
        StateUpdate(
            workloads=[o for o in items if isinstance(o, Workload)],
            services=[o for o in items if isinstance(o, Service)],
        )
    )
    return state


def run(
    objs: Sequence[Workload | Service],
    to: str,
    frm: str = "127.0.0.1",
    source: Workload = SOURCE,
    seed: int = 0,
    state: ProxyState | None = None,
) -> Request:
    st = state if state is not None else make_state(*objs)
    return build_request(st, source, ip(frm), addr(to), "", random.Random(seed))


def fmt(a: tuple[IPAddress, int] | None) -> str:
    return "" if a is None else format_addr(*a)


def summary(req: Request) -> tuple[str, str, str]:
    return req.protocol.value, fmt(req.actual_destination), req.authority or ""


# -- upstream's build_request table --------------------------------------------------------------------------------


EXAMPLE_80 = {"ns/example.com": {80: 8080}}


@dataclass
class Case:
    id: str
    objs: list[Workload | Service]
    to: str
    expect: tuple[str, str, str] | str  # (protocol, next hop, authority) or a fragment of the error
    frm: str = "127.0.0.1"
    dest_workload: str | None = field(default="?")  # "?" = not checked


CASES = [
    Case(
        "unknown_dest",
        [wl("my-pod", "127.0.0.2")],
        "1.2.3.4:80",
        ("TCP", "1.2.3.4:80", ""),
        dest_workload=None,
    ),
    Case(
        "known_dest_remote_node_tcp",
        [wl("test-tcp", "127.0.0.2", node="remote-node")],
        "127.0.0.2:80",
        ("TCP", "127.0.0.2:80", ""),
        dest_workload="test-tcp",
    ),
    Case(
        "known_dest_remote_node_hbone",
        [wl("test-hbone", "127.0.0.2", protocol=HBONE, node="remote-node")],
        "127.0.0.2:80",
        ("HBONE", "127.0.0.2:15008", "127.0.0.2:80"),
        dest_workload="test-hbone",
    ),
    Case(
        "known_dest_local_node_tcp",
        [wl("test-tcp", "127.0.0.2", node="local-node")],
        "127.0.0.2:80",
        ("TCP", "127.0.0.2:80", ""),
    ),
    Case(
        "known_dest_local_node_hbone",
        [wl("test-hbone", "127.0.0.2", protocol=HBONE, node="local-node")],
        "127.0.0.2:80",
        ("HBONE", "127.0.0.2:15008", "127.0.0.2:80"),
    ),
    Case(
        # The downstream (127.0.0.2) has a waypoint; that is not the destination's, so it is not used.
        "source_waypoint",
        [wl("my-pod", "127.0.0.2", waypoint=gw_addr("127.0.0.10"))],
        "127.0.0.1:80",
        ("TCP", "127.0.0.1:80", ""),
        frm="127.0.0.2",
        dest_workload="source-workload",
    ),
    Case(
        "destination_waypoint",
        [wl("my-pod", "127.0.0.2", waypoint=gw_addr("127.0.0.10"))],
        "127.0.0.2:80",
        ("HBONE", "127.0.0.10:15008", "127.0.0.2:80"),
        dest_workload="waypoint-workload",
    ),
    Case(
        # A v6 destination whose waypoint is known only by a v4 address: v4 to the waypoint, v6 authority.
        "destination_waypoint_mismatch_ip",
        [wl("my-pod", "127.0.0.2", "ff06::c3", waypoint=gw_addr("127.0.0.11"))],
        "[ff06::c3]:80",
        ("HBONE", "127.0.0.11:15008", "[ff06::c3]:80"),
        dest_workload="waypoint-workload-dual",
    ),
    Case(
        "destination_svc_waypoint",
        [svc("example.com", "127.0.0.3", waypoint=gw_addr("127.0.0.10"))],
        "127.0.0.3:80",
        ("HBONE", "127.0.0.10:15008", "127.0.0.3:80"),
        dest_workload="waypoint-workload",
    ),
    Case("empty_service", [svc("example.com", "127.0.0.3")], "127.0.0.3:80", "no healthy upstream for 127.0.0.3:80"),
    Case(
        # Named target ports (0 on the service): only the endpoint that defines port 80 qualifies.
        "target_port",
        [
            svc("example.com", "127.0.0.3", ports={80: 0, 8080: 0}),
            wl("matching-pod", "127.0.0.2", services={"ns/example.com": {80: 1234}}),
            wl("unmatching-pod", "127.0.0.4", services={"ns/example.com": {8080: 9999}}),
        ],
        "127.0.0.3:80",
        ("TCP", "127.0.0.2:1234", ""),
        dest_workload="matching-pod",
    ),
    Case(
        "wrong_network",
        [
            svc("example.com", "127.0.0.3"),
            wl("remote-pod", "10.0.0.2", network="remote", services=EXAMPLE_80),
        ],
        "127.0.0.3:80",
        "has no network gateway",
    ),
    Case(
        "double_hbone_gateway_by_ip",
        [
            svc("example.com", "127.0.0.3"),
            wl(
                "remote-pod",
                network="remote",
                network_gateway=gw_addr("10.22.1.1", 15009, "remote"),
                services=EXAMPLE_80,
            ),
            wl("ew-gtw", "10.22.1.1", network="remote"),
        ],
        "127.0.0.3:80",
        ("DOUBLE_HBONE", "10.22.1.1:15009", "example.com:80"),
        dest_workload="ew-gtw",
    ),
    Case(
        "double_hbone_gateway_by_hostname",
        [
            svc("example.com", "127.0.0.3"),
            svc("ew-gtw", "127.0.0.4", ports={15009: 15009}),
            wl(
                "remote-pod",
                "127.0.0.6",
                network="remote",
                network_gateway=gw_host("ew-gtw", port=15009),
                services=EXAMPLE_80,
            ),
            wl("ew-gtw", "127.0.0.5", network="remote", services={"ns/ew-gtw": {15009: 15008}}),
        ],
        "127.0.0.3:80",
        ("DOUBLE_HBONE", "127.0.0.5:15008", "example.com:80"),
        dest_workload="ew-gtw",
    ),
    Case(
        "double_hbone_remote_waypoint",
        [
            svc("example.com", "127.0.0.3", waypoint=gw_host("waypoint.com")),
            svc("waypoint.com", "127.0.0.4", ports={15008: 15008}),
            wl(
                "remote-waypoint-pod",
                network="remote",
                network_gateway=gw_addr("10.22.1.1", 15009, "remote"),
                services={"ns/waypoint.com": {15008: 15008}},
            ),
            wl("remote-ew-gtw", "10.22.1.1", network="remote"),
        ],
        "127.0.0.3:80",
        ("DOUBLE_HBONE", "10.22.1.1:15009", "example.com:80"),
        dest_workload="remote-ew-gtw",
    ),
    Case(
        "host_network_via_service",
        [
            svc("example.com", "127.0.0.3", ports={80: 80}),
            wl("pod1", "127.0.0.2", network_mode=NetworkMode.HOST_NETWORK, services={"ns/example.com": {80: 80}}),
            wl("pod2", "127.0.0.2", network_mode=NetworkMode.HOST_NETWORK),
        ],
        "127.0.0.3:80",
        ("TCP", "127.0.0.2:80", ""),
        dest_workload="pod1",
    ),
    Case(
        # Traffic to a host-network IP directly is passed through, not pinned on one of the pods sharing it.
        "host_network_direct",
        [
            svc("example.com", "127.0.0.3", ports={80: 80}),
            wl("pod1", "127.0.0.2", network_mode=NetworkMode.HOST_NETWORK, services={"ns/example.com": {80: 80}}),
            wl("pod2", "127.0.0.2", network_mode=NetworkMode.HOST_NETWORK),
        ],
        "127.0.0.2:80",
        ("TCP", "127.0.0.2:80", ""),
        dest_workload=None,
    ),
    Case(
        "multiple_address_workload_v4",
        [wl("test-tcp", "127.0.0.2", "ff06::c3", node="remote-node")],
        "127.0.0.2:80",
        ("TCP", "127.0.0.2:80", ""),
    ),
    Case(
        "multiple_address_workload_v6",
        [wl("test-tcp", "127.0.0.2", "ff06::c3", node="remote-node")],
        "[ff06::c3]:80",
        ("TCP", "[ff06::c3]:80", ""),
    ),
    Case(
        "passthrough_svc",
        [
            svc(
                "example.com",
                "1.2.3.4",
                "1.5.6.7",
                ports={80: 80},
                load_balancer=LoadBalancer(mode=LoadBalancerMode.PASSTHROUGH),
            )
        ],
        "1.2.3.4:80",
        ("TCP", "1.2.3.4:80", ""),
        dest_workload=None,
    ),
    Case(
        "passthrough_svc_with_waypoint",
        [
            svc(
                "example.com",
                "1.2.3.4",
                "1.5.6.7",
                ports={80: 80},
                waypoint=gw_addr("127.0.0.10"),
                load_balancer=LoadBalancer(mode=LoadBalancerMode.PASSTHROUGH),
            )
        ],
        "1.2.3.4:80",
        ("HBONE", "127.0.0.10:15008", "1.2.3.4:80"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_build_request_upstream_table(case: Case) -> None:
    if isinstance(case.expect, str):
        with pytest.raises(ProxyError) as err:
            run(case.objs, case.to, case.frm)
        assert case.expect in str(err.value)
        assert err.value.flag is ResponseFlag.CONNECT
        return
    req = run(case.objs, case.to, case.frm)
    assert summary(req) == case.expect
    if case.dest_workload != "?":
        got = req.actual_destination_workload.name if req.actual_destination_workload else None
        assert got == case.dest_workload
    assert req.source is SOURCE


FAILOVER_SVC = svc(
    "example.com",
    "127.0.0.3",
    load_balancer=LoadBalancer((LoadBalancerScope.NETWORK,), LoadBalancerMode.FAILOVER),
)
REMOTE_EP = wl(
    "remote-example-pod",
    network="remote",
    network_gateway=gw_addr("10.22.1.1", 15009, "remote"),
    services=EXAMPLE_80,
)
EW_GATEWAY = wl("remote-ew-gtw", "10.22.1.1", network="remote")


@pytest.mark.parametrize("seed", range(20))
def test_failover_prefers_local_network(seed: int) -> None:
    local = wl("local-example-pod", "127.0.0.2", protocol=HBONE, services=EXAMPLE_80)
    req = run([FAILOVER_SVC, EW_GATEWAY, REMOTE_EP, local], "127.0.0.3:80", seed=seed)
    assert summary(req) == ("HBONE", "127.0.0.2:15008", "127.0.0.2:8080")


def test_failover_to_remote_when_local_unhealthy() -> None:
    local = wl("local-example-pod", "127.0.0.2", protocol=HBONE, services=EXAMPLE_80, status=HealthStatus.UNHEALTHY)
    # Upstream's build_request_failover_to_remote: double HBONE through the east-west gateway.
    req = run([FAILOVER_SVC, EW_GATEWAY, REMOTE_EP, local], "127.0.0.3:80")
    assert summary(req) == ("DOUBLE_HBONE", "10.22.1.1:15009", "example.com:80")
    assert req.final_workload is REMOTE_EP and req.actual_destination_workload is EW_GATEWAY
    assert req.upstream_sans == (EW_GATEWAY.identity,)  # the outer TLS: the gateway's identity


def test_double_hbone_inner_tls_expects_the_service_sans() -> None:
    sans = ("spiffe://cluster.local/ns/ns/sa/example",)
    objs: list[Workload | Service] = [svc("example.com", "127.0.0.3", subject_alt_names=sans), EW_GATEWAY, REMOTE_EP]
    req = run(objs, "127.0.0.3:80")
    assert [str(i) for i in req.final_sans] == list(sans)
    assert req.intended_destination_service is not None and req.intended_destination_service.hostname == "example.com"


# -- request details -----------------------------------------------------------------------------------------------


def test_hbone_workload_request_fields() -> None:
    dst = wl("server", "10.0.0.2", sa="server-sa", protocol=HBONE)
    req = run([dst], "10.0.0.2:8080")
    assert req.protocol is OutboundProtocol.HBONE
    assert req.actual_destination == (ip("10.0.0.2"), 15008)
    assert req.hbone_target == (ip("10.0.0.2"), 8080)
    assert req.actual_destination_workload == dst
    assert req.intended_destination_service is None  # not service-addressed
    assert req.upstream_sans == (Identity(TD, NS, "server-sa"),)
    assert req.resolve_hostname is None


def test_hbone_port_parameter_is_the_next_hop_port() -> None:
    dst = wl("server", "10.0.0.2", protocol=HBONE)
    req = build_request(make_state(dst), SOURCE, ip("127.0.0.1"), addr("10.0.0.2:80"), "", random.Random(0), 15099)
    assert summary(req) == ("HBONE", "10.0.0.2:15099", "10.0.0.2:80")


def test_service_vip_to_hbone_endpoint_sans_are_service_sans_then_workload() -> None:
    service = svc(
        "echo.ns.svc.cluster.local",
        "10.96.0.1",
        ports={80: 8080},
        subject_alt_names=(
            "spiffe://cluster.local/ns/ns/sa/svc-a",
            "not a spiffe id",  # ignored
            "spiffe://other.td/ns/x/sa/svc-b",
        ),
    )
    ep = wl("echo-1", "10.0.0.7", sa="echo", protocol=HBONE, services={"ns/echo.ns.svc.cluster.local": {80: 8080}})
    req = run([service, ep], "10.96.0.1:80")
    assert summary(req) == ("HBONE", "10.0.0.7:15008", "10.0.0.7:8080")
    assert req.upstream_sans == (
        Identity(TD, "ns", "svc-a"),
        Identity("other.td", "x", "svc-b"),
        Identity(TD, NS, "echo"),
    )
    assert req.intended_destination_service is not None
    assert req.intended_destination_service.hostname == "echo.ns.svc.cluster.local"
    assert req.intended_destination_service.name == "echo"
    assert req.intended_destination_service.namespace == NS
    assert req.actual_destination_workload == ep


def test_expected_sans_without_duplicates() -> None:
    # The usual case: the service's SAN is the endpoint's own identity. It is expected once, not twice.
    service = svc(
        "echo",
        "10.96.0.1",
        subject_alt_names=(
            f"spiffe://{TD}/ns/{NS}/sa/echo",
            f"spiffe://{TD}/ns/{NS}/sa/a",
            f"spiffe://{TD}/ns/{NS}/sa/a",
        ),
    )
    ep = wl("echo-1", "10.0.0.7", sa="echo", protocol=HBONE, services={"ns/echo": {80: 8080}})
    req = run([service, ep], "10.96.0.1:80")
    assert req.upstream_sans == (Identity(TD, NS, "echo"), Identity(TD, NS, "a"))


def test_tcp_request_still_carries_sans_for_telemetry() -> None:
    service = svc("echo", "10.96.0.1", subject_alt_names=("spiffe://cluster.local/ns/ns/sa/a",))
    ep = wl("echo-1", "10.0.0.7", sa="echo", services={"ns/echo": {80: 8080}})
    req = run([service, ep], "10.96.0.1:80")
    assert summary(req) == ("TCP", "10.0.0.7:8080", "")
    assert req.upstream_sans == (Identity(TD, NS, "a"), Identity(TD, NS, "echo"))


def test_unknown_destination_has_no_sans_and_no_workload() -> None:
    req = run([], "192.0.2.1:443")
    assert req.protocol is OutboundProtocol.TCP
    assert req.actual_destination == (ip("192.0.2.1"), 443)
    assert req.hbone_target is None
    assert req.upstream_sans == ()
    assert req.actual_destination_workload is None
    assert req.intended_destination_service is None


def test_hostname_only_endpoint_asks_for_dns() -> None:
    service = svc("ext.example", "10.96.0.9", ports={443: 443})
    ep = wl("ext", hostname="backend.example.org", services={"ns/ext.example": {443: 443}})
    req = run([service, ep], "10.96.0.9:443")
    assert req.resolve_hostname == "backend.example.org"
    assert req.protocol is OutboundProtocol.TCP
    assert req.actual_destination[1] == 443


def test_workload_without_usable_ip_is_an_error() -> None:
    # v6-only service family, endpoint only has a v4 address and no hostname or gateway: nowhere to send it.
    service = svc("v6only", "10.96.0.2", ports={80: 80}, ip_families=IpFamily.IPV6)
    ep = wl("v4pod", "10.0.0.9", services={"ns/v6only": {80: 80}})
    with pytest.raises(ProxyError, match="no suitable workload IPs"):
        run([service, ep], "10.96.0.2:80")


# -- port mapping ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("svc_ports", "ep_ports", "app_tunnel", "expect"),
    [
        ({80: 8080}, {80: 9090}, False, "10.0.0.2:9090"),  # the endpoint's own mapping wins
        ({80: 8080}, {}, False, "10.0.0.2:8080"),  # else the service's target port
        ({80: 8080}, {81: 9090}, False, "10.0.0.2:8080"),  # a mapping for another port does not apply
        ({80: 0}, {80: 9090}, False, "10.0.0.2:9090"),  # named port resolved by the endpoint
        ({80: 0}, {}, False, "no healthy upstream"),  # named port the endpoint lacks: filtered out
        ({80: 0}, {}, True, "no healthy upstream"),  # an app tunnel only frees the port for waypoints
        ({81: 8081}, {}, False, "no healthy upstream"),  # port not on the service at all
    ],
    ids=[
        "endpoint-map",
        "service-target",
        "other-port-map",
        "named-endpoint",
        "named-missing",
        "tunnel-std",
        "no-port",
    ],
)
def test_port_mapping_precedence(
    svc_ports: dict[int, int], ep_ports: dict[int, int], app_tunnel: bool, expect: str
) -> None:
    tunnel = ApplicationTunnel(AppTunnelProtocol.PROXY, 15088) if app_tunnel else None
    objs: list[Workload | Service] = [
        svc("example.com", "10.96.0.1", ports=svc_ports),
        wl("ep", "10.0.0.2", services={"ns/example.com": ep_ports}, application_tunnel=tunnel),
    ]
    if ":" in expect:
        assert summary(run(objs, "10.96.0.1:80")) == ("TCP", expect, "")
    else:
        with pytest.raises(ProxyError, match=expect):
            run(objs, "10.96.0.1:80")


@pytest.mark.parametrize(
    ("svc_ports", "ep_ports", "app_tunnel", "mode", "port"),
    [
        ({80: 0}, {80: 9090}, False, ResolutionMode.STANDARD, 9090),
        ({80: 8080}, {}, False, ResolutionMode.STANDARD, 8080),
        ({80: 0}, {}, True, ResolutionMode.WAYPOINT, 80),
        ({}, {}, True, ResolutionMode.WAYPOINT, 80),  # not even on the service: fine with an app tunnel
        ({}, {}, False, ResolutionMode.WAYPOINT, None),
        ({80: 0}, {}, False, ResolutionMode.WAYPOINT, None),  # no tunnel, no mapping anywhere
    ],
    ids=["ep", "svc", "tunnel", "tunnel-no-svc-port", "waypoint-no-port", "waypoint-named-no-map"],
)
def test_find_upstream_port_mappings(
    svc_ports: dict[int, int], ep_ports: dict[int, int], app_tunnel: bool, mode: ResolutionMode, port: int | None
) -> None:
    """Upstream ``find_upstream_port_mappings``: endpoint map, then service target port, then the app tunnel."""
    tunnel = ApplicationTunnel(AppTunnelProtocol.PROXY, 15088) if app_tunnel else None
    ep = wl(
        "ep_no_port_mapping",
        "192.168.0.1",
        ns="default",
        application_tunnel=tunnel,
        services={"default/example.com": ep_ports},
    )
    state = make_state(svc("example.com", "10.0.0.1", ns="default", ports=svc_ports), ep, base=False)
    found = find_upstream(state, "", ep, ip("10.0.0.1"), 80, mode, random.Random(0))
    if port is None:
        assert found is None
    else:
        assert isinstance(found, tuple)
        assert found[0] == ep
        assert found[1] == port


def test_waypoint_with_app_tunnel_needs_no_service_port() -> None:
    """A waypoint service that does not list 15008 is usable when its pod has an app tunnel (Waypoint mode)."""
    wp_svc = svc("wp.ns.svc", "10.96.0.50", ports={})
    wp = wl(
        "wp-tunnel",
        "10.0.0.50",
        sa="wp",
        protocol=HBONE,
        application_tunnel=ApplicationTunnel(AppTunnelProtocol.PROXY, 15088),
        services={"ns/wp.ns.svc": {}},
    )
    target = svc("echo", "10.96.0.1", waypoint=gw_host("wp.ns.svc"))
    req = run([wp_svc, wp, target], "10.96.0.1:80")
    assert summary(req) == ("HBONE", "10.0.0.50:15008", "10.96.0.1:80")
    no_tunnel = wl("wp-tunnel", "10.0.0.50", sa="wp", protocol=HBONE, services={"ns/wp.ns.svc": {}})
    with pytest.raises(ProxyError, match="waypoint"):
        run([wp_svc, no_tunnel, target], "10.96.0.1:80")


# -- health and load balancing ----------------------------------------------------------------------------------------


def endpoints_svc(**kw: Any) -> Service:
    return svc("lb", "10.96.0.1", ports={80: 8080}, **kw)


def ep(name: str, ip_text: str, **kw: Any) -> Workload:
    return wl(name, ip_text, services={"ns/lb": {}}, **kw)


def picks(
    objs: Sequence[Workload | Service], n: int = 200, seed: int = 7, source: Workload = SOURCE
) -> collections.Counter[str]:
    state = make_state(*objs)
    rng = random.Random(seed)
    out: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        req = build_request(state, source, ip("127.0.0.1"), addr("10.96.0.1:80"), "", rng)
        assert req.actual_destination_workload is not None
        out[req.actual_destination_workload.name] += 1
    return out


def test_unhealthy_endpoints_are_skipped() -> None:
    got = picks([endpoints_svc(), ep("ok", "10.0.0.1"), ep("sick", "10.0.0.2", status=HealthStatus.UNHEALTHY)])
    assert got == {"ok": 200}


def test_only_unhealthy_endpoints_is_no_healthy_upstream() -> None:
    objs: list[Workload | Service] = [endpoints_svc(), ep("sick", "10.0.0.2", status=HealthStatus.UNHEALTHY)]
    with pytest.raises(ProxyError, match=re.escape("no healthy upstream for 10.96.0.1:80")) as err:
        run(objs, "10.96.0.1:80")
    assert err.value.flag is ResponseFlag.CONNECT


def test_allow_all_health_policy_uses_unhealthy_endpoints() -> None:
    lb = LoadBalancer(health_policy=LoadBalancerHealthPolicy.ALLOW_ALL)
    got = picks(
        [endpoints_svc(load_balancer=lb), ep("ok", "10.0.0.1"), ep("sick", "10.0.0.2", status=HealthStatus.UNHEALTHY)]
    )
    assert set(got) == {"ok", "sick"}
    only_sick = picks([endpoints_svc(load_balancer=lb), ep("sick", "10.0.0.2", status=HealthStatus.UNHEALTHY)], n=5)
    assert only_sick == {"sick": 5}


def test_no_endpoints_with_passthrough_mode_goes_to_original_destination() -> None:
    lb = LoadBalancer(mode=LoadBalancerMode.PASSTHROUGH)
    req = run([endpoints_svc(load_balancer=lb)], "10.96.0.1:80")
    assert summary(req) == ("TCP", "10.96.0.1:80", "")
    # Passthrough even when there are endpoints: the client picked the address itself.
    req = run([endpoints_svc(load_balancer=lb), ep("a", "10.0.0.1")], "10.96.0.1:80")
    assert summary(req) == ("TCP", "10.96.0.1:80", "")
    assert req.actual_destination_workload is None


def test_endpoint_whose_workload_is_unknown_is_skipped() -> None:
    service = svc("lb", "10.96.0.1")
    state = make_state(service, ep("known", "10.0.0.1"))
    # An endpoint staged for a workload that is gone (only the endpoint remains).
    stored = state.services.get(NamespacedHostname(NS, "lb"))
    assert stored is not None
    stored.endpoints["cluster1//v1/Pod/ns/ghost"] = Endpoint("cluster1//v1/Pod/ns/ghost", {})
    for seed in range(10):
        req = run([], "10.96.0.1:80", seed=seed, state=state)
        assert req.actual_destination_workload is not None
        assert req.actual_destination_workload.name == "known"


def test_weighted_random_by_capacity() -> None:
    n = 4000
    got = picks([endpoints_svc(), ep("small", "10.0.0.1", capacity=1), ep("big", "10.0.0.2", capacity=3)], n=n, seed=42)
    assert set(got) == {"small", "big"}
    assert 0.72 <= got["big"] / n <= 0.78, got
    # Equal capacity: an even split.
    even = picks([endpoints_svc(), ep("a", "10.0.0.1"), ep("b", "10.0.0.2")], n=n, seed=42)
    assert 0.47 <= even["a"] / n <= 0.53, even


def test_zero_capacity_endpoint_is_never_picked() -> None:
    got = picks([endpoints_svc(), ep("drained", "10.0.0.1", capacity=0), ep("live", "10.0.0.2", capacity=1)])
    assert got == {"live": 200}


def test_all_endpoints_zero_capacity_is_no_healthy_upstream() -> None:
    """Upstream: ``choose_weighted`` fails when every weight is zero -> no upstream -> ``NoHealthyUpstream``."""
    objs: list[Workload | Service] = [endpoints_svc(), ep("a", "10.0.0.1", capacity=0), ep("b", "10.0.0.2", capacity=0)]
    with pytest.raises(ProxyError, match="no healthy upstream"):
        run(objs, "10.96.0.1:80")
    with pytest.raises(ProxyError, match="no healthy upstream"):
        run([endpoints_svc(), ep("a", "10.0.0.1", capacity=0)], "10.96.0.1:80")


# Upstream test_load_balance: endpoints with localities, a STRICT and a FAILOVER service over [Network, Region, Zone].
PREFS = (LoadBalancerScope.NETWORK, LoadBalancerScope.REGION, LoadBalancerScope.ZONE)
LB_KEY = {"default/lb.default": {80: 80}}
LB_WORKLOADS = [
    wl("wl_no_locality", "192.168.0.1", ns="default", network="network", services=LB_KEY),
    wl("wl_match", "192.168.0.2", ns="default", network="network", locality=Locality("reg", "zone"), services=LB_KEY),
    wl(
        "wl_almost",
        "192.168.0.3",
        ns="default",
        network="network",
        locality=Locality("reg", "not-zone"),
        services=LB_KEY,
    ),
    wl("wl_other", "192.168.0.5", ns="default", network="other", locality=Locality("reg", "zone"), services=LB_KEY),
    wl("wl_empty_ip", ns="default", network="network", locality=Locality("reg", "zone"), services=LB_KEY),
]


def lb_state(mode: LoadBalancerMode) -> tuple[ProxyState, Service]:
    service = svc("lb.default", "10.96.1.1", ns="default", ports={80: 80}, load_balancer=LoadBalancer(PREFS, mode))
    state = make_state(service, *LB_WORKLOADS, base=False)
    stored = state.services.get(service.key)
    assert stored is not None
    return state, stored


def lb_choices(mode: LoadBalancerMode, src: Workload, tries: int = 60) -> set[str]:
    state, service = lb_state(mode)
    rng = random.Random(3)
    got = set()
    for _ in range(tries):
        picked = load_balance(state, src, service, 80, ResolutionMode.STANDARD, rng)
        if picked is not None:
            got.add(picked[1].name)
    return got


def src_at(network: str = "", region: str = "", zone: str = "") -> Workload:
    return wl("src", "10.1.1.1", ns="default", network=network, locality=Locality(region, zone))


@pytest.mark.parametrize(
    ("mode", "src", "expect"),
    [
        (LoadBalancerMode.STRICT, src_at(), set()),  # strict, nothing matches: nothing selected
        (LoadBalancerMode.STRICT, src_at("network", "reg", "zone"), {"wl_match"}),
        (LoadBalancerMode.STRICT, src_at("network", "reg", ""), set()),  # partial match is not enough
        (
            LoadBalancerMode.FAILOVER,
            src_at("no-match", "no-match", "no-match"),
            {"wl_match", "wl_almost", "wl_no_locality", "wl_other"},
        ),
        (LoadBalancerMode.FAILOVER, src_at("network", "reg", "zone"), {"wl_match"}),
        (LoadBalancerMode.FAILOVER, src_at("network", "reg", ""), {"wl_match", "wl_almost"}),
        (
            LoadBalancerMode.FAILOVER,
            src_at("network", "no-match", "no-match"),
            {"wl_match", "wl_almost", "wl_no_locality"},
        ),
        # Network first and not matching: the other scopes still rank (upstream's special case).
        (LoadBalancerMode.FAILOVER, src_at("no-match", "reg", "zone"), {"wl_match", "wl_other"}),
        (
            LoadBalancerMode.STANDARD,
            src_at("network", "reg", "zone"),
            {"wl_match", "wl_almost", "wl_no_locality", "wl_other"},
        ),
    ],
    ids=[
        "strict-no-match",
        "strict-match",
        "strict-partial",
        "failover-no-match",
        "failover-full",
        "failover-network-region",
        "failover-network",
        "failover-region-zone",
        "standard-ignores-preferences",
    ],
)
def test_load_balance_routing_preferences(mode: LoadBalancerMode, src: Workload, expect: set[str]) -> None:
    got = lb_choices(mode, src)
    assert got == expect
    assert "wl_empty_ip" not in got  # no address and no gateway: never selectable


def test_strict_with_no_match_is_an_error_through_build_request() -> None:
    state, _ = lb_state(LoadBalancerMode.STRICT)
    with pytest.raises(ProxyError, match="no healthy upstream"):
        build_request(state, src_at("", "reg", "zone"), ip("10.1.1.1"), addr("10.96.1.1:80"), "", random.Random(0))


def test_failover_node_and_cluster_scopes() -> None:
    prefs = (LoadBalancerScope.CLUSTER, LoadBalancerScope.NODE)
    service = svc("n", "10.96.2.1", ports={80: 80}, load_balancer=LoadBalancer(prefs, LoadBalancerMode.FAILOVER))
    same_node = wl("same-node", "10.0.2.1", node="local-node", cluster_id="c1", services={"ns/n": {}})
    same_cluster = wl("same-cluster", "10.0.2.2", node="other-node", cluster_id="c1", services={"ns/n": {}})
    other = wl("other", "10.0.2.3", node="local-node", cluster_id="c2", services={"ns/n": {}})
    source = wl("source-workload", "127.0.0.1", sa="default", node="local-node", cluster_id="c1")
    state = make_state(service, same_node, same_cluster, other, base=False)
    names = {
        build_request(
            state, source, ip("127.0.0.1"), addr("10.96.2.1:80"), "", random.Random(s)
        ).actual_destination_workload.name  # type: ignore[union-attr]
        for s in range(30)
    }
    assert names == {"same-node"}
    # Without the node-local one, the rest of the cluster beats the other cluster (cluster matched, node not).
    state = make_state(service, same_cluster, other, base=False)
    names = {
        build_request(
            state, source, ip("127.0.0.1"), addr("10.96.2.1:80"), "", random.Random(s)
        ).actual_destination_workload.name  # type: ignore[union-attr]
        for s in range(30)
    }
    assert names == {"same-cluster"}


# -- waypoints -----------------------------------------------------------------------------------------------------

WP_SVC = svc(
    "waypoint.ns.svc.cluster.local",
    "10.96.0.100",
    ports={15008: 15008},
    subject_alt_names=("spiffe://cluster.local/ns/ns/sa/waypoint-svc-san",),
)
WP_PODS = [
    wl(
        f"wp-{i}",
        f"10.0.0.{100 + i}",
        sa="waypoint",
        protocol=HBONE,
        services={"ns/waypoint.ns.svc.cluster.local": {15008: 15008}},
    )
    for i in (1, 2)
]
WP_REF = gw_host("waypoint.ns.svc.cluster.local")


def test_service_waypoint_by_hostname() -> None:
    target = svc("echo.ns.svc.cluster.local", "10.96.0.1", waypoint=WP_REF)
    endpoint = wl("echo-1", "10.0.0.7", protocol=HBONE, services={"ns/echo.ns.svc.cluster.local": {80: 8080}})
    seen = set()
    for seed in range(20):
        req = run([WP_SVC, *WP_PODS, target, endpoint], "10.96.0.1:80", seed=seed)
        assert req.protocol is OutboundProtocol.HBONE
        assert req.actual_destination[1] == 15008
        assert req.hbone_target == addr("10.96.0.1:80")  # the original VIP:port, not the endpoint
        assert req.actual_destination_workload is not None
        assert req.actual_destination_workload.name in ("wp-1", "wp-2")
        assert req.actual_destination[0] in req.actual_destination_workload.workload_ips
        assert req.upstream_sans == (Identity(TD, NS, "waypoint-svc-san"), Identity(TD, NS, "waypoint"))
        assert req.intended_destination_service is not None
        assert req.intended_destination_service.hostname == "echo.ns.svc.cluster.local"
        seen.add(req.actual_destination_workload.name)
    assert seen == {"wp-1", "wp-2"}  # load-balanced over the waypoint's endpoints


def test_service_waypoint_unknown_is_an_error() -> None:
    target = svc("echo", "10.96.0.1", waypoint=gw_host("missing.ns.svc"))
    with pytest.raises(ProxyError, match=re.escape("missing.ns.svc not found")):
        run([target], "10.96.0.1:80")


def test_service_waypoint_by_hbone_mtls_port() -> None:
    target = svc("echo", "10.96.0.1", waypoint=gw_addr("127.0.0.10", 15019))
    req = run([target], "10.96.0.1:80")
    assert summary(req) == ("HBONE", "127.0.0.10:15019", "10.96.0.1:80")
    assert req.upstream_sans == (WAYPOINT.identity,)


def test_service_waypoint_follows_request_ip_family() -> None:
    """A waypoint referenced by hostname adapts to the caller's family (an IP reference cannot)."""
    wp_svc = svc("wp-dual", "10.96.0.60", "fd00::60", ports={15008: 15008})
    wp = wl(
        "wp-dual", "10.0.0.60", "fd00::a:60", sa="waypoint", protocol=HBONE, services={"ns/wp-dual": {15008: 15008}}
    )
    target = svc("dual", "10.96.0.1", "fd00::1", waypoint=gw_host("wp-dual"))
    v4 = run([wp_svc, wp, target], "10.96.0.1:80")
    v6 = run([wp_svc, wp, target], "[fd00::1]:80", frm="::1")
    assert summary(v4) == ("HBONE", "10.0.0.60:15008", "10.96.0.1:80")
    assert summary(v6) == ("HBONE", "[fd00::a:60]:15008", "[fd00::1]:80")


def test_weighted_waypoints_split_by_weight() -> None:
    a, b = gw_addr("127.0.0.10"), gw_addr("127.0.0.11")
    target = svc("echo", "10.96.0.1", weighted_waypoints=(WeightedWaypoint(a, 75), WeightedWaypoint(b, 25)))
    state = make_state(target)
    rng = random.Random(0)
    n = 4000
    got: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        req = build_request(state, SOURCE, ip("127.0.0.1"), addr("10.96.0.1:80"), "", rng)
        got[fmt(req.actual_destination)] += 1
        assert req.hbone_target == addr("10.96.0.1:80")
    assert set(got) == {"127.0.0.10:15008", "127.0.0.11:15008"}
    assert 0.72 <= got["127.0.0.10:15008"] / n <= 0.78, got


@pytest.mark.parametrize(
    ("weights", "fallback", "expect"),
    [
        ((100, 0), None, {"127.0.0.10:15008"}),  # a zero-weight entry is never picked
        ((0, 100), None, {"127.0.0.11:15008"}),  # canary fully promoted
        ((0, 0), "127.0.0.10", {"127.0.0.10:15008"}),  # not samplable: the single waypoint field
        ((0, 0), None, {"direct"}),  # and with no waypoint field either: straight to the endpoint
    ],
    ids=["primary-only", "canary-only", "all-zero-fallback", "all-zero-no-waypoint"],
)
def test_weighted_waypoints_zero_weights(weights: tuple[int, int], fallback: str | None, expect: set[str]) -> None:
    a, b = gw_addr("127.0.0.10"), gw_addr("127.0.0.11")
    target = svc(
        "echo",
        "10.96.0.1",
        weighted_waypoints=(WeightedWaypoint(a, weights[0]), WeightedWaypoint(b, weights[1])),
        waypoint=gw_addr(fallback) if fallback else None,
    )
    endpoint = wl("echo-1", "10.0.0.7", services={"ns/echo": {80: 8080}})
    state = make_state(target, endpoint)
    got = set()
    for seed in range(50):
        req = build_request(state, SOURCE, ip("127.0.0.1"), addr("10.96.0.1:80"), "", random.Random(seed))
        got.add("direct" if req.actual_destination == addr("10.0.0.7:8080") else fmt(req.actual_destination))
    assert got == expect


def test_workload_waypoint_not_used_when_service_addressed() -> None:
    """The endpoint's own (workload) waypoint is for workload-addressed traffic only."""
    target = svc("echo", "10.96.0.1")
    endpoint = wl(
        "echo-1", "10.0.0.7", protocol=HBONE, waypoint=gw_addr("127.0.0.10"), services={"ns/echo": {80: 8080}}
    )
    assert summary(run([target, endpoint], "10.96.0.1:80")) == ("HBONE", "10.0.0.7:15008", "10.0.0.7:8080")
    assert summary(run([target, endpoint], "10.0.0.7:8080")) == ("HBONE", "127.0.0.10:15008", "10.0.0.7:8080")


def test_workload_waypoint_by_hostname_sans_and_service() -> None:
    dst = wl("dst", "10.0.0.7", protocol=HBONE, waypoint=WP_REF)
    req = run([WP_SVC, *WP_PODS, dst], "10.0.0.7:9000")
    assert req.protocol is OutboundProtocol.HBONE
    assert req.hbone_target == addr("10.0.0.7:9000")
    assert req.actual_destination[1] == 15008
    assert req.upstream_sans == (Identity(TD, NS, "waypoint-svc-san"), Identity(TD, NS, "waypoint"))
    assert req.intended_destination_service is None


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("me", [0, 1])
def test_traffic_from_the_destinations_waypoint_goes_direct(seed: int, me: int) -> None:
    """Upstream ``check_from_waypoint``: the source *is* one of the waypoint's pods (sandwich outbound), so the
    connection goes to the destination rather than back to the waypoint, whichever replica the source is."""
    source = WP_PODS[me]
    dst = wl("dst", "10.0.0.7", protocol=HBONE, waypoint=WP_REF)
    state = make_state(WP_SVC, *WP_PODS, dst)
    downstream = source.workload_ips[0]
    req = build_request(state, source, downstream, addr("10.0.0.7:9000"), "", random.Random(seed))
    assert summary(req) == ("HBONE", "10.0.0.7:15008", "10.0.0.7:9000")
    assert req.actual_destination_workload == dst


@pytest.mark.parametrize(
    ("ref", "me"),
    [
        (gw_addr("127.0.0.10"), WAYPOINT),  # the waypoint pod's own IP
        (gw_addr("10.96.0.100"), WP_PODS[1]),  # the waypoint service's VIP: any of its endpoints
        (gw_host("wp-host.example"), wl("wp-host", "10.0.0.120", sa="waypoint", hostname="wp-host.example")),
    ],
    ids=["by-pod-ip", "by-service-vip", "by-workload-hostname"],
)
def test_from_waypoint_for_every_kind_of_reference(ref: GatewayAddress, me: Workload) -> None:
    dst = wl("dst", "10.0.0.7", protocol=HBONE, waypoint=ref)
    state = make_state(WP_SVC, *WP_PODS, dst, me)
    for seed in range(8):
        req = build_request(state, me, me.workload_ips[0], addr("10.0.0.7:9000"), "", random.Random(seed))
        assert summary(req) == ("HBONE", "10.0.0.7:15008", "10.0.0.7:9000")
    # Anyone else goes through that waypoint.
    req = build_request(state, SOURCE, ip("127.0.0.1"), addr("10.0.0.7:9000"), "", random.Random(0))
    assert req.actual_destination[1] == 15008
    assert req.actual_destination[0] != ip("10.0.0.7")
    assert req.hbone_target == addr("10.0.0.7:9000")


def test_same_identity_from_another_ip_is_not_the_waypoint() -> None:
    """The check needs both the waypoint's identity and one of its IPs (a pod sharing the SA is not it)."""
    impostor = wl("impostor", "10.0.0.99", sa="waypoint", protocol=HBONE)
    dst = wl("dst", "10.0.0.7", protocol=HBONE, waypoint=WP_REF)
    state = make_state(WP_SVC, *WP_PODS, dst, impostor)
    req = build_request(state, impostor, ip("10.0.0.99"), addr("10.0.0.7:9000"), "", random.Random(0))
    assert req.actual_destination[0] in (ip("10.0.0.101"), ip("10.0.0.102"))
    assert req.hbone_target == addr("10.0.0.7:9000")


# -- visibility, IP families ------------------------------------------------------------------------------------------


def test_namespace_visibility_hides_service_from_other_namespaces() -> None:
    private = svc("private", "10.96.0.5", ns="team", visibility=Visibility.NAMESPACE)
    endpoint = wl("private-1", "10.0.0.5", ns="team", services={"team/private": {80: 8080}})
    # From another namespace the VIP is just an unknown address: passed through untouched.
    outsider = run([private, endpoint], "10.96.0.5:80")
    assert summary(outsider) == ("TCP", "10.96.0.5:80", "")
    assert outsider.intended_destination_service is None
    insider_src = wl("insider", "10.0.9.9", ns="team")
    insider = run([private, endpoint, insider_src], "10.96.0.5:80", source=insider_src)
    assert summary(insider) == ("TCP", "10.0.0.5:8080", "")


def test_namespace_visibility_falls_back_to_public_service_on_same_vip() -> None:
    private = svc("shared", "10.96.0.6", ns="team", visibility=Visibility.NAMESPACE)
    public = svc("shared", "10.96.0.6", ns="public")
    objs: list[Workload | Service] = [
        private,
        public,
        wl("team-ep", "10.0.0.61", ns="team", services={"team/shared": {80: 8080}}),
        wl("public-ep", "10.0.0.62", ns="public", services={"public/shared": {80: 8080}}),
    ]
    assert summary(run(objs, "10.96.0.6:80")) == ("TCP", "10.0.0.62:8080", "")
    insider = wl("insider", "10.0.9.9", ns="team")
    assert summary(run([*objs, insider], "10.96.0.6:80", source=insider)) == ("TCP", "10.0.0.61:8080", "")


DUAL = wl("dual", "127.0.0.2", "ff06::c3", protocol=HBONE, services={"ns/example.com": {}})


def family_svc(family: IpFamily | None) -> Service:
    return svc("example.com", "127.0.0.3", "::3", ports={80: 80}, ip_families=family)


@pytest.mark.parametrize(
    ("family", "frm", "to", "expect"),
    [
        (IpFamily.IPV6, "127.0.0.1", "127.0.0.3:80", ("HBONE", "[ff06::c3]:15008", "[ff06::c3]:80")),
        (IpFamily.IPV4, "127.0.0.1", "127.0.0.3:80", ("HBONE", "127.0.0.2:15008", "127.0.0.2:80")),
        (IpFamily.IPV4, "::1", "[::3]:80", ("HBONE", "127.0.0.2:15008", "127.0.0.2:80")),
        (IpFamily.DUAL, "127.0.0.1", "127.0.0.3:80", ("HBONE", "127.0.0.2:15008", "127.0.0.2:80")),
        (IpFamily.DUAL, "::1", "[::3]:80", ("HBONE", "[ff06::c3]:15008", "[ff06::c3]:80")),
        (None, "::1", "[::3]:80", ("HBONE", "[ff06::c3]:15008", "[ff06::c3]:80")),
    ],
    ids=["v6only", "v4only", "v4only-from-v6", "dual-v4", "dual-v6", "unset-v6"],
)
def test_service_ip_families(family: IpFamily | None, frm: str, to: str, expect: tuple[str, str, str]) -> None:
    assert summary(run([family_svc(family), DUAL], to, frm=frm)) == expect


def test_v6_only_endpoint_reached_from_v4_vip() -> None:
    v6 = wl("v6pod", "fd00::7", services={"ns/example.com": {}})
    assert summary(run([family_svc(IpFamily.DUAL), v6], "127.0.0.3:80")) == ("TCP", "[fd00::7]:80", "")


def test_v6_workload_target_keeps_its_family() -> None:
    dst = wl("v6", "fd00::2", protocol=HBONE)
    assert summary(run([dst], "[fd00::2]:8080", frm="::1")) == ("HBONE", "[fd00::2]:15008", "[fd00::2]:8080")

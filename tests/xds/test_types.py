"""Protobuf -> state model conversion (ztunnel.xds.types): upstream's defaults, rejections and error paths."""

from __future__ import annotations

import ipaddress

import pytest
from google.protobuf import empty_pb2

from xds.istio.security import authorization_pb2 as sec
from xds.istio.workload import workload_pb2 as wl
from ztunnel.identity.spiffe import Identity
from ztunnel.rbac import Action, Scope, ServiceAccountMatch, StringMatch, StringMatchKind
from ztunnel.state.service import IpFamily, LoadBalancerHealthPolicy, LoadBalancerMode, LoadBalancerScope, Visibility
from ztunnel.state.workload import (
    AppTunnelProtocol,
    HealthStatus,
    InboundProtocol,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
)
from ztunnel.xds.types import (
    ConversionError,
    address_from_xds,
    authorization_from_xds,
    ip_from_bytes,
    service_from_xds,
    workload_from_xds,
)

V4 = bytes([10, 0, 0, 1])


def workload(**kw: object) -> wl.Workload:
    base: dict[str, object] = {"uid": "c1//v1/Pod/ns/pod", "name": "pod", "namespace": "ns", "addresses": [V4]}
    base.update(kw)
    return wl.Workload(**base)  # type: ignore[arg-type]


def test_workload_defaults_as_upstream() -> None:
    w = workload_from_xds(workload())
    assert w.trust_domain == "cluster.local"
    assert w.service_account == "default"
    assert w.cluster_id == "Kubernetes"
    assert w.capacity == 1
    assert w.identity == Identity("cluster.local", "ns", "default")
    assert w.protocol is InboundProtocol.TCP
    assert w.network_mode is NetworkMode.STANDARD
    assert w.status is HealthStatus.HEALTHY
    assert w.workload_type == "deployment"
    assert w.workload_ips == (ipaddress.ip_address("10.0.0.1"),)


def test_workload_full() -> None:
    msg = workload(
        addresses=[V4, ipaddress.ip_address("fd00::1").packed, ipaddress.ip_address("::ffff:1.2.3.4").packed],
        trust_domain="td",
        service_account="sa",
        network="net",
        tunnel_protocol=wl.HBONE,
        node="node-a",
        canonical_name="app",
        canonical_revision="v2",
        workload_type=wl.CRONJOB,
        workload_name="wn",
        native_tunnel=True,
        application_tunnel=wl.ApplicationTunnel(protocol=wl.ApplicationTunnel.PROXY, port=15088),
        services={"ns/svc.ns.svc.cluster.local": wl.PortList(ports=[wl.Port(service_port=80, target_port=8080)])},
        authorization_policies=["ns/p1"],
        status=wl.UNHEALTHY,
        cluster_id="c1",
        locality=wl.Locality(region="r", zone="z", subzone="s"),
        network_mode=wl.HOST_NETWORK,
        waypoint=wl.GatewayAddress(
            hostname=wl.NamespacedHostname(namespace="ns", hostname="wp.ns.svc"), hbone_mtls_port=15008
        ),
        network_gateway=wl.GatewayAddress(address=wl.NetworkAddress(network="net", address=V4), hbone_mtls_port=15009),
    )
    msg.capacity.value = 0
    w = workload_from_xds(msg)
    assert w.workload_ips[2] == ipaddress.ip_address("1.2.3.4")  # v4-mapped is stored as IPv4
    assert w.identity == Identity("td", "ns", "sa")
    assert w.protocol is InboundProtocol.HBONE
    assert w.network_mode is NetworkMode.HOST_NETWORK
    assert w.status is HealthStatus.UNHEALTHY
    assert w.workload_type == "cronjob"
    assert w.application_tunnel is not None and w.application_tunnel.protocol is AppTunnelProtocol.PROXY
    assert w.application_tunnel.port == 15088
    assert dict(w.services[NamespacedHostname("ns", "svc.ns.svc.cluster.local")]) == {80: 8080}
    assert w.waypoint is not None and w.waypoint.destination == NamespacedHostname("ns", "wp.ns.svc")
    assert w.network_gateway is not None
    assert w.network_gateway.destination == NetworkAddress("net", ipaddress.ip_address("10.0.0.1"))
    assert w.network_gateway.hbone_mtls_port == 15009
    assert w.capacity == 0  # set explicitly: kept
    assert (w.locality.region, w.locality.zone, w.locality.subzone) == ("r", "z", "s")
    assert w.cluster_id == "c1"
    assert w.authorization_policies == ("ns/p1",)


@pytest.mark.parametrize(
    ("msg", "expected"),
    [
        (workload(addresses=[b"\x01\x02\x03\x04\x05"]), "addresses[0]: IP address must be 4 or 16 bytes, got 5"),
        (workload(addresses=[V4, b""]), "addresses[1]: IP address must be 4 or 16 bytes, got 0"),
        (
            workload(tunnel_protocol=wl.LEGACY_ISTIO_MTLS),
            "tunnel_protocol: unsupported tunnel protocol: legacy istio mtls",
        ),
        (workload(tunnel_protocol=7), "tunnel_protocol: unknown enum value 7"),
        (workload(status=9), "status: unknown enum value 9"),
        (workload(network_mode=3), "network_mode: unknown enum value 3"),
        (
            workload(services={"no-slash": wl.PortList()}),
            "services['no-slash']: failed to parse namespaced hostname 'no-slash' (expected namespace/hostname)",
        ),
        (
            workload(services={"ns/h": wl.PortList(ports=[wl.Port(service_port=70000, target_port=1)])}),
            "services['ns/h'].ports[0].service_port: port 70000 is out of range (0-65535)",
        ),
        (
            workload(waypoint=wl.GatewayAddress(hbone_mtls_port=15008)),
            "waypoint: nonempty gateway address is missing address",
        ),
        (
            workload(waypoint=wl.GatewayAddress(address=wl.NetworkAddress(address=b"\x01"))),
            "waypoint.address.address: IP address must be 4 or 16 bytes, got 1",
        ),
        (
            workload(application_tunnel=wl.ApplicationTunnel(protocol=5)),  # type: ignore[arg-type]  # an enum number the schema lacks
            "application_tunnel.protocol: unknown enum value 5",
        ),
    ],
)
def test_workload_rejections_name_the_field(msg: wl.Workload, expected: str) -> None:
    with pytest.raises(ConversionError) as e:
        workload_from_xds(msg)
    assert str(e.value) == expected


def test_unknown_workload_type_reads_as_deployment() -> None:
    assert workload_from_xds(workload(workload_type=42)).workload_type == "deployment"


def test_address_wraps_errors_with_the_kind() -> None:
    with pytest.raises(ConversionError, match=r"^workload\.addresses\[0\]: IP address must be 4 or 16 bytes, got 3$"):
        address_from_xds(wl.Address(workload=workload(addresses=[b"abc"])))
    with pytest.raises(ConversionError, match=r"^type: unknown address type"):
        address_from_xds(wl.Address())
    assert address_from_xds(wl.Address(workload=workload())).uid == "c1//v1/Pod/ns/pod"  # type: ignore[union-attr]


def test_service_vips_cidrs_and_load_balancing() -> None:
    s = service_from_xds(
        wl.Service(
            name="svc",
            namespace="ns",
            hostname="svc.ns.svc.cluster.local",
            addresses=[
                wl.NetworkAddress(network="", address=V4),
                wl.NetworkAddress(network="", address=bytes([10, 96, 0, 0]), length=12),
                wl.NetworkAddress(network="n", address=V4, length=32),  # full length: a plain VIP
            ],
            ports=[wl.Port(service_port=80, target_port=8080), wl.Port(service_port=443)],
            subject_alt_names=["spiffe://td/ns/ns/sa/x"],
            load_balancing=wl.LoadBalancing(
                routing_preference=[wl.LoadBalancing.NETWORK, wl.LoadBalancing.ZONE],
                mode=wl.LoadBalancing.FAILOVER,
                health_policy=wl.LoadBalancing.ALLOW_ALL,
            ),
            ip_families=wl.DUAL,
            canonical=True,
            visibility=wl.Service.NAMESPACE,
            weighted_waypoints=[
                wl.WeightedWaypoint(
                    destination=wl.GatewayAddress(hostname=wl.NamespacedHostname(namespace="a", hostname="b")),
                    weight=3,
                )
            ],
        )
    )
    assert [str(v) for v in s.vips] == ["/10.0.0.1", "n/10.0.0.1"]
    assert [str(c) for c in s.cidr_vips] == ["/10.96.0.0/12"]
    assert dict(s.ports) == {80: 8080, 443: 0}
    assert s.load_balancer is not None
    assert s.load_balancer.routing_preferences == (LoadBalancerScope.NETWORK, LoadBalancerScope.ZONE)
    assert s.load_balancer.mode is LoadBalancerMode.FAILOVER
    assert s.load_balancer.health_policy is LoadBalancerHealthPolicy.ALLOW_ALL
    assert s.ip_families is IpFamily.DUAL
    assert s.canonical and s.visibility is Visibility.NAMESPACE
    assert s.weighted_waypoints[0].weight == 3


def test_service_defaults_and_fail_open_visibility() -> None:
    s = service_from_xds(wl.Service(name="s", namespace="ns", hostname="h", visibility=7))  # type: ignore[arg-type]  # an enum number the schema lacks
    assert s.visibility is Visibility.PUBLIC
    assert s.ip_families is None
    assert s.load_balancer is None
    lb = service_from_xds(wl.Service(load_balancing=wl.LoadBalancing())).load_balancer
    assert lb is not None and lb.mode is LoadBalancerMode.STANDARD


@pytest.mark.parametrize(
    ("msg", "expected"),
    [
        (
            wl.Service(addresses=[wl.NetworkAddress(address=b"\x01\x02")]),
            "addresses[0].address: IP address must be 4 or 16 bytes, got 2",
        ),
        (
            wl.Service(addresses=[wl.NetworkAddress(address=V4, length=33)]),
            "addresses[0].length: invalid cidr: prefix length 33 > 32",
        ),
        (
            wl.Service(load_balancing=wl.LoadBalancing(routing_preference=[wl.LoadBalancing.UNSPECIFIED_SCOPE])),
            "load_balancing.routing_preference[0]: invalid target UNSPECIFIED_SCOPE",
        ),
        (wl.Service(load_balancing=wl.LoadBalancing(mode=9)), "load_balancing.mode: unknown enum value 9"),  # type: ignore[arg-type]  # an enum number the schema lacks
        (wl.Service(ip_families=8), "ip_families: unknown enum value 8"),  # type: ignore[arg-type]  # an enum number the schema lacks
        (
            wl.Service(weighted_waypoints=[wl.WeightedWaypoint(weight=1)]),
            "weighted_waypoints[0].destination: nonempty gateway address is missing address",
        ),
    ],
)
def test_service_rejections_name_the_field(msg: wl.Service, expected: str) -> None:
    with pytest.raises(ConversionError) as e:
        service_from_xds(msg)
    assert str(e.value) == expected


def test_authorization_conversion() -> None:
    msg = sec.Authorization(
        name="p",
        namespace="ns",
        scope=sec.WORKLOAD_SELECTOR,
        action=sec.DENY,
        dry_run=True,
        rules=[
            sec.Rule(
                clauses=[
                    sec.Clause(
                        matches=[
                            sec.Match(
                                namespaces=[sec.StringMatch(exact="a"), sec.StringMatch(), sec.StringMatch(prefix="p")],
                                principals=[
                                    sec.StringMatch(suffix="/sa/x"),
                                    sec.StringMatch(presence=empty_pb2.Empty()),
                                ],
                                source_ips=[
                                    sec.Address(address=bytes([10, 1, 2, 3]), length=8),
                                    # IPv4-mapped: kept as sent, an IPv6 network (tests/xds/test_authorization_cidrs.py)
                                    sec.Address(address=ipaddress.IPv6Address("::ffff:10.0.0.0").packed, length=104),
                                ],
                                destination_ports=[80, 443],
                                not_service_accounts=[sec.ServiceAccountMatch(namespace="ns", serviceAccount="sa")],
                            )
                        ]
                    )
                ]
            )
        ],
    )
    p = authorization_from_xds(msg)
    assert p.key == "ns/p"
    assert p.scope is Scope.WORKLOAD_SELECTOR and p.action is Action.DENY and p.dry_run
    (m,) = p.rules[0][0]
    assert m.namespaces == (StringMatch(StringMatchKind.EXACT, "a"), StringMatch(StringMatchKind.PREFIX, "p"))
    assert m.principals == (StringMatch(StringMatchKind.SUFFIX, "/sa/x"), StringMatch(StringMatchKind.PRESENCE))
    assert m.source_ips == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::ffff:10.0.0.0/104"))
    assert m.destination_ports == (80, 443)
    assert m.not_service_accounts == (ServiceAccountMatch("ns", "sa"),)


@pytest.mark.parametrize(
    ("msg", "expected"),
    [
        (sec.Authorization(scope=5), "scope: unknown enum value 5"),  # type: ignore[arg-type]  # an enum number the schema lacks
        (sec.Authorization(action=2), "action: unknown enum value 2"),  # type: ignore[arg-type]  # an enum number the schema lacks
        (
            sec.Authorization(
                rules=[sec.Rule(clauses=[sec.Clause(matches=[sec.Match(not_destination_ports=[70000])])])]
            ),
            "rules[0].clauses[0].matches[0].not_destination_ports[0]: port 70000 is out of range (0-65535)",
        ),
    ],
)
def test_authorization_rejections(msg: sec.Authorization, expected: str) -> None:
    with pytest.raises(ConversionError) as e:
        authorization_from_xds(msg)
    assert str(e.value) == expected


def test_ip_from_bytes() -> None:
    assert ip_from_bytes(bytes(16), "f") == ipaddress.ip_address("::")
    with pytest.raises(ConversionError, match=r"^f: IP address must be 4 or 16 bytes, got 15$"):
        ip_from_bytes(bytes(15), "f")

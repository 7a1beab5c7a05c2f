"""``build_inbound_request`` and its parts, as pure functions over a state: destination validation (the waypoint
"sandwich"), the upstream port (hostname authorities, app tunnels, ztunnel's own ports), ``destination_service``,
and the headers that decide where a request came from (``forwarded``, ``x-forwarded-network``).

The state is upstream's ``inbound.rs`` test state: a client, a server and a waypoint workload; a "server" service
(VIP 10.10.0.1, port 80 -> 8080) whose endpoint is the server, a "waypoint" service (VIP 10.10.0.2) whose endpoint is
the waypoint; the server (as workload or service) uses the waypoint referenced by pod IP, service VIP or hostname.
"""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from types import SimpleNamespace
from typing import cast

import pytest

from ztunnel.config import WorkloadInfo
from ztunnel.net import format_addr
from ztunnel.proxy.common import guess_inbound_service
from ztunnel.proxy.inbound import InboundRejected, build_inbound_request, from_gateway, parse_forwarded_host
from ztunnel.proxy.inputs import ProxyInputs
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import Service
from ztunnel.state.workload import (
    ApplicationTunnel,
    AppTunnelProtocol,
    GatewayAddress,
    InboundProtocol,
    IPAddress,
    NamespacedHostname,
    NetworkAddress,
    Workload,
)

CLIENT_POD = "10.0.0.1"
SERVER_POD = "10.0.0.2"
WAYPOINT_POD = "10.0.0.3"
SERVER_SVC = "10.10.0.1"
WAYPOINT_SVC = "10.10.0.2"
SERVER_HOST = "server.default.svc.cluster.local"
WAYPOINT_HOST = "waypoint.default.svc.cluster.local"
TARGET_PORT = 8080
PROXY_PORT = 15088
ILLEGAL = frozenset({15001, 15006, 15008, 15080})

BY_POD = GatewayAddress(NetworkAddress("", ipaddress.IPv4Address(WAYPOINT_POD)))
BY_VIP = GatewayAddress(NetworkAddress("", ipaddress.IPv4Address(WAYPOINT_SVC)))
BY_HOST = GatewayAddress(NamespacedHostname("default", WAYPOINT_HOST))
TUNNEL = ApplicationTunnel(AppTunnelProtocol.PROXY, PROXY_PORT)


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def svc_key(host: str) -> NamespacedHostname:
    return NamespacedHostname("default", host)


def state_with(
    attach: str | None = None,
    waypoint: GatewayAddress | None = None,
    tunnel: ApplicationTunnel | None = None,
    server_ports: dict[int, int] | None = None,
    endpoint_ports: dict[int, int] | None = None,
    extra_services: tuple[Service, ...] = (),
    server_services: tuple[str, ...] = (),
) -> ProxyState:
    """The test state; ``attach`` is "service" or "workload": which of the server's two uses ``waypoint``."""

    def service(name: str, vip: str, gw: GatewayAddress | None, ports: dict[int, int]) -> Service:
        return Service(
            name=name,
            namespace="default",
            hostname=f"{name}.default.svc.cluster.local",
            vips=(NetworkAddress("", ip(vip)),),
            ports=ports,
            subject_alt_names=(f"{name}.default.svc.cluster.local",),
            waypoint=gw,
        )

    def workload(name: str, pod: str, **kw: object) -> Workload:
        return Workload(
            uid=f"cluster1//v1/Pod/default/{name}",
            name=f"workload-{name}",
            namespace="default",
            service_account=f"service-account-{name}",
            trust_domain="cluster.local",
            workload_ips=(ip(pod),),
            protocol=InboundProtocol.HBONE,
            **kw,  # type: ignore[arg-type]
        )

    server_svcs = {svc_key(SERVER_HOST): endpoint_ports or {}}
    server_svcs.update({svc_key(h): {} for h in server_services})
    state = ProxyState()
    state.apply(
        StateUpdate(
            services=[
                service("waypoint", WAYPOINT_SVC, None, {80: 8080}),
                service("server", SERVER_SVC, waypoint if attach == "service" else None, server_ports or {80: 8080}),
                *extra_services,
            ],
            workloads=[
                workload("waypoint", WAYPOINT_POD, application_tunnel=tunnel, services={svc_key(WAYPOINT_HOST): {}}),
                workload("client", CLIENT_POD),
                workload(
                    "server",
                    SERVER_POD,
                    waypoint=waypoint if attach == "workload" else None,
                    services=server_svcs,
                ),
            ],
        )
    )
    return state


def inputs(state: ProxyState, local_ip: str, network: str = "") -> ProxyInputs:
    local = state.workloads.find_address(NetworkAddress("", ip(local_ip)))
    assert local is not None
    pi = SimpleNamespace(
        local=SimpleNamespace(find=lambda: local, info=WorkloadInfo(local.name, local.namespace, "sa")),
        state=state,
        config=SimpleNamespace(illegal_ports=ILLEGAL, network=network),
    )
    return cast(ProxyInputs, pi)


# Upstream's test_find_inbound_upstream / test_build_inbound_request cases (plus waypoints by hostname).
OK_CASES = {
    "to workload no waypoint": (None, None, None, SERVER_POD, format_addr(SERVER_POD, TARGET_PORT), SERVER_POD, 8080),
    "svc hostname to workload no waypoint": (None, None, None, SERVER_POD, format_addr(SERVER_HOST, 80), SERVER_POD, 8080),
    "to workload with waypoint referenced by pod": (
        "workload", BY_POD, None, WAYPOINT_POD, format_addr(SERVER_POD, TARGET_PORT), WAYPOINT_POD, 8080,
    ),
    "to workload with waypoint referenced by vip": (
        "workload", BY_VIP, None, WAYPOINT_POD, format_addr(SERVER_POD, TARGET_PORT), WAYPOINT_POD, 8080,
    ),
    "to workload with waypoint referenced by hostname": (
        "workload", BY_HOST, None, WAYPOINT_POD, format_addr(SERVER_POD, TARGET_PORT), WAYPOINT_POD, 8080,
    ),
    "to workload with app tunnel": (
        "workload", BY_VIP, TUNNEL, WAYPOINT_POD, format_addr(SERVER_POD, TARGET_PORT), WAYPOINT_POD, PROXY_PORT,
    ),
    "to service with waypoint referenced by pod": (
        "service", BY_POD, None, WAYPOINT_POD, format_addr(SERVER_SVC, TARGET_PORT), WAYPOINT_POD, 8080,
    ),
    "to service with waypoint referenced by vip": (
        "service", BY_VIP, None, WAYPOINT_POD, format_addr(SERVER_SVC, TARGET_PORT), WAYPOINT_POD, 8080,
    ),
    "to service with waypoint referenced by hostname": (
        "service", BY_HOST, None, WAYPOINT_POD, format_addr(SERVER_SVC, TARGET_PORT), WAYPOINT_POD, 8080,
    ),
    "to service with app tunnel": (
        "service", BY_VIP, TUNNEL, WAYPOINT_POD, format_addr(SERVER_SVC, TARGET_PORT), WAYPOINT_POD, PROXY_PORT,
    ),
}  # fmt: skip

ERROR_CASES = {
    "to server ip mismatch": (None, None, SERVER_POD, CLIENT_POD),
    "to waypoint without attachment": (None, None, WAYPOINT_POD, CLIENT_POD),
    "to workload via waypoint with wrong attachment": ("service", BY_POD, WAYPOINT_POD, SERVER_POD),
    "to service via waypoint with wrong attachment": ("workload", BY_POD, WAYPOINT_POD, SERVER_SVC),
    # The waypoint the target names is another one: its service's endpoints do not include us.
    "to service whose waypoint vip is not ours": ("service", BY_VIP, CLIENT_POD, SERVER_SVC),
    "to workload whose waypoint hostname is not ours": ("workload", BY_HOST, CLIENT_POD, SERVER_POD),
    "to an unknown address": (None, None, WAYPOINT_POD, "10.0.0.99"),
}


@pytest.mark.parametrize("case", list(OK_CASES))
def test_inbound_upstream(case: str) -> None:
    attach, gw, tunnel, conn_dst, auth, want_ip, want_port = OK_CASES[case]
    pi = inputs(state_with(attach, gw, tunnel), conn_dst)
    req = build_inbound_request(pi, "CONNECT", auth, ip(conn_dst), {})
    assert req.upstream == (ip(want_ip), want_port)


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_inbound_destination_rejected(case: str) -> None:
    attach, gw, conn_dst, target = ERROR_CASES[case]
    pi = inputs(state_with(attach, gw), conn_dst)
    with pytest.raises(InboundRejected) as e:
        build_inbound_request(pi, "CONNECT", format_addr(target, TARGET_PORT), ip(conn_dst), {})
    assert e.value.status == 400
    assert str(e.value) == f"ip mismatch: {target} != {conn_dst}"


def test_illegal_port_is_checked_before_the_app_tunnel_port() -> None:
    """Upstream refuses a target port of ztunnel's own before an app tunnel overrides it (the app tunnel's port
    would otherwise launder a self-call)."""
    pi = inputs(state_with("service", BY_VIP, TUNNEL), WAYPOINT_POD)
    for port in sorted(ILLEGAL):
        with pytest.raises(InboundRejected) as e:
            build_inbound_request(pi, "CONNECT", format_addr(SERVER_SVC, port), ip(WAYPOINT_POD), {})
        assert (e.value.status, str(e.value)) == (503, "attempted recursive call to ourselves")


def test_hostname_authority_maps_service_ports() -> None:
    # Numeric target port on the service.
    pi = inputs(state_with(server_ports={80: 8080}), SERVER_POD)
    assert build_inbound_request(pi, "CONNECT", f"{SERVER_HOST}:80", ip(SERVER_POD), {}).upstream[1] == 8080
    # Named target port: the service says 0, the endpoint's own map has the number.
    pi = inputs(state_with(server_ports={80: 0}, endpoint_ports={80: 9090}), SERVER_POD)
    assert build_inbound_request(pi, "CONNECT", f"{SERVER_HOST}:80", ip(SERVER_POD), {}).upstream[1] == 9090
    # Named, and this endpoint does not define it: no port.
    pi = inputs(state_with(server_ports={80: 0}), SERVER_POD)
    with pytest.raises(InboundRejected) as e:
        build_inbound_request(pi, "CONNECT", f"{SERVER_HOST}:80", ip(SERVER_POD), {})
    assert e.value.status == 503


# -- destination_service ---------------------------------------------------------------------------------------

OTHER = Service(
    name="other",
    namespace="default",
    hostname="other.default.svc.cluster.local",
    vips=(NetworkAddress("", ip("10.10.0.3")),),
    ports={81: 9090, 82: 0},
)
STRANGER = Service(
    name="stranger", namespace="default", hostname="stranger.default.svc.cluster.local", ports={80: 8080}
)


def service_of(headers: dict[str, str], auth: str, **kw: object) -> str | None:
    state = state_with(extra_services=(OTHER, STRANGER), server_services=(OTHER.hostname,), **kw)  # type: ignore[arg-type]
    req = build_inbound_request(inputs(state, SERVER_POD), "CONNECT", auth, ip(SERVER_POD), headers)
    return req.service.hostname if req.service is not None else None


def test_forwarded_host_is_accepted_only_for_a_service_of_the_destination() -> None:
    to_8080 = format_addr(SERVER_POD, 8080)
    # Named by the client and one of ours: that one, even though the port says "server".
    assert service_of({"forwarded": f'for="1.2.3.4:5";host={OTHER.hostname}'}, to_8080) == OTHER.hostname
    # Invented, or a real service that does not select this workload: ignored; the port decides.
    for host in ("invented.example", STRANGER.hostname, "x" * 10_000):
        assert service_of({"forwarded": f"host={host}"}, to_8080) == SERVER_HOST
    # Nothing matches the port: unknown, whatever the header said.
    assert service_of({"forwarded": "host=invented.example"}, format_addr(SERVER_POD, 7777)) is None


def test_destination_service_by_target_port_or_named_port() -> None:
    assert service_of({}, format_addr(SERVER_POD, 8080)) == SERVER_HOST
    assert service_of({}, format_addr(SERVER_POD, 9090)) == OTHER.hostname  # other: 81 -> 9090
    assert service_of({}, format_addr(SERVER_POD, 7070)) is None
    # A named port (target 0 on the service) resolved through this endpoint's own port map.
    assert service_of({}, format_addr(SERVER_POD, 7070), endpoint_ports={80: 7070}, server_ports={80: 0}) == SERVER_HOST


def test_hostname_authority_offers_only_that_service() -> None:
    # The forwarded host names another of our services: a hostname authority admits only its own service.
    assert service_of({"forwarded": f"host={OTHER.hostname}"}, f"{SERVER_HOST}:80") == SERVER_HOST


def test_guess_inbound_service_order() -> None:
    """Upstream's order: the forwarded host among the candidates first, else the first candidate by port."""
    state = state_with(extra_services=(OTHER,))
    dest = state.workloads.find_address(NetworkAddress("", ip(SERVER_POD)))
    assert dest is not None
    server = state.services.get(svc_key(SERVER_HOST))
    other = replace(OTHER, ports={80: 8080})
    assert server is not None
    assert guess_inbound_service([server, other], None, 8080, dest).hostname == SERVER_HOST  # type: ignore[union-attr]
    assert guess_inbound_service([other, server], None, 8080, dest).hostname == OTHER.hostname  # type: ignore[union-attr]
    got = guess_inbound_service([server, other], OTHER.hostname, 8080, dest)
    assert got is not None and got.hostname == OTHER.hostname
    assert guess_inbound_service([], SERVER_HOST, 8080, dest) is None


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ('for="10.0.0.1:80";host=a.example', "a.example"),
        ('for="10.0.0.1:80"; host="a.example"', "a.example"),
        ("host=a.example;host=b.example", "a.example"),
        ('for="10.0.0.1:80"', None),
        ("host=", None),
        ('host=""', None),
        ("Host=a.example", None),  # upstream matches the parameter name as written
        ("host=bücher.example", None),  # not ASCII: the header is ignored
        ("", None),
    ],
)
def test_parse_forwarded_host(value: str, want: str | None) -> None:
    assert parse_forwarded_host(value) == want


@pytest.mark.parametrize(
    ("header", "network", "want"),
    [
        (None, "", False),
        ("", "", False),
        ("net1", "", True),
        ("NET1", "net1", False),  # compared without case, as upstream
        ("net2", "net1", True),
    ],
)
def test_from_gateway(header: str | None, network: str, want: bool) -> None:
    headers = {} if header is None else {"x-forwarded-network": header}
    assert from_gateway(headers, network) is want


def test_authorities_are_parsed_once() -> None:
    """The same few authorities come back on every CONNECT: the parsed address is the same object each time (no
    ipaddress parse per connection); a refused authority is still refused every time, naming itself."""
    from ztunnel.proxy.inbound import parse_authority

    ip, port = parse_authority("10.1.2.3:8080")
    assert str(ip) == "10.1.2.3" and port == 8080
    assert parse_authority("10.1.2.3:8080")[0] is ip
    assert parse_authority("[::ffff:10.1.2.3]:8080") == (ip, 8080)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"10\.1\.2\.3:99999"):
            parse_authority("10.1.2.3:99999")

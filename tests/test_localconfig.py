from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from ztunnel.localconfig import LocalConfigError, load_local_config, parse_local_config
from ztunnel.rbac import Action, Scope, StringMatchKind
from ztunnel.state import ProxyState
from ztunnel.state.service import LoadBalancerMode, LoadBalancerScope, Visibility
from ztunnel.state.workload import InboundProtocol, NamespacedHostname, NetworkAddress

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_upstream_localhost_example_shape() -> None:
    cfg = load_local_config(EXAMPLES / "localhost.yaml")
    state = ProxyState()
    state.apply(cfg.update)
    local = state.workloads.find_uid("cluster1//v1/Pod/default/local")
    assert local is not None
    assert local.protocol is InboundProtocol.HBONE
    assert local.workload_ips == (ipaddress.ip_address("127.0.0.1"),)
    assert str(local.identity) == "spiffe://cluster.local/ns/default/sa/default"
    tcp = state.workloads.find_address(NetworkAddress("", ipaddress.ip_address("127.0.0.2")))
    assert tcp is not None and tcp.protocol is InboundProtocol.TCP
    svc = state.services.get(NamespacedHostname("default", "example.com"))
    assert svc is not None
    assert svc.ports == {80: 8080}
    assert set(svc.endpoints) == {"cluster1//v1/Pod/default/local", "cluster1//v1/Pod/default/local-tcp"}
    remote = state.services.get_best_by_vip(NetworkAddress("remote", ipaddress.ip_address("127.10.0.2")), None)
    assert remote is not None and remote.hostname == "example2.com"
    (policy,) = state.policies
    assert policy.key == "default/deny-9999"
    assert policy.scope is Scope.NAMESPACE and policy.action is Action.ALLOW
    assert policy.rules[0][0][0].not_destination_ports == (9999,)


def test_full_schema() -> None:
    text = """
workloads:
- uid: c//v1/Pod/ns1/w
  name: w
  namespace: ns1
  serviceAccount: sa1
  trustDomain: td.example
  workloadIps: ["10.0.0.1", "fd00::1", "::ffff:10.0.0.9"]
  protocol: HBONE
  networkMode: Standard
  network: net1
  node: node-1
  waypoint: {destination: {namespace: ns1, hostname: wp.ns1.svc.cluster.local}, hboneMtlsPort: 15008}
  networkGateway: {destination: "net2/192.168.0.1"}
  applicationTunnel: {protocol: PROXY, port: 15088}
  authorizationPolicies: ["ns1/p1"]
  status: Unhealthy
  clusterId: c1
  locality: {region: r, zone: z, subzone: s}
  capacity: 3
  canonicalName: app
  canonicalRevision: v2
  workloadName: w-deploy
  workloadType: deployment
  hostname: w.example
  nativeTunnel: true
  services: {"ns1/svc.ns1.svc.cluster.local": {"80": "8080"}}
services:
- name: svc
  namespace: ns1
  hostname: svc.ns1.svc.cluster.local
  vips: ["net1/10.96.0.1"]
  cidrVips: ["net1/10.200.0.0/16"]
  ports: {80: 0}
  subjectAltNames: ["spiffe://td.example/ns/ns1/sa/sa1"]
  waypoint: {destination: "net1/10.0.0.100", hboneMtlsPort: 15008}
  weightedWaypoints: [{destination: {destination: "net1/10.0.0.101"}, weight: 2}]
  loadBalancer: {routingPreferences: [Region, Zone], mode: Failover, healthPolicy: AllowAll}
  ipFamilies: Dual
  canonical: true
  visibility: Namespace
policies:
- name: p1
  namespace: ns1
  scope: WorkloadSelector
  action: Deny
  dryRun: true
  rules:
  - - - namespaces: [{Exact: a}, {Prefix: b}]
        notNamespaces: [{Suffix: c}]
        principals: [Presence]
        notPrincipals: [{Presence: []}]
        serviceAccounts: [{namespace: ns1, serviceAccount: sa1}]
        sourceIps: ["10.0.0.0/8", "fd00::/8", "192.168.1.1"]
        destinationPorts: [80]
"""
    cfg = parse_local_config(text, "inline.yaml")
    state = ProxyState()
    state.apply(cfg.update)
    w = state.workloads.find_uid("c//v1/Pod/ns1/w")
    assert w is not None
    assert w.workload_ips[2] == ipaddress.ip_address("10.0.0.9")  # v4-mapped canonicalised
    assert str(w.identity) == "spiffe://td.example/ns/ns1/sa/sa1"
    assert w.application_tunnel is not None and w.application_tunnel.port == 15088
    assert w.capacity == 3 and w.locality.zone == "z"
    assert w.services[NamespacedHostname("ns1", "svc.ns1.svc.cluster.local")] == {80: 8080}
    svc = state.services.get_best_by_vip(NetworkAddress("net1", ipaddress.ip_address("10.200.3.4")), "ns1")
    assert svc is not None and svc.visibility is Visibility.NAMESPACE
    assert svc.load_balancer is not None and svc.load_balancer.mode is LoadBalancerMode.FAILOVER
    assert svc.load_balancer.routing_preferences == (LoadBalancerScope.REGION, LoadBalancerScope.ZONE)
    assert state.services.get_best_by_vip(NetworkAddress("net1", ipaddress.ip_address("10.96.0.1")), "other") is None
    (p,) = state.policies
    m = p.rules[0][0][0]
    assert [s.kind for s in m.namespaces] == [StringMatchKind.EXACT, StringMatchKind.PREFIX]
    assert m.principals[0].kind is StringMatchKind.PRESENCE and m.not_principals[0].kind is StringMatchKind.PRESENCE
    assert m.source_ips[2] == ipaddress.ip_network("192.168.1.1/32")
    assert p.dry_run and p.scope is Scope.WORKLOAD_SELECTOR


MALFORMED = [
    ("workloads: {}", "workloads: expected a list, got a mapping"),
    ("workloads: [{namespace: a, workloadIps: [1.2.3.4], color: red}]", "workloads[0].color: unknown field 'color'"),
    ("workloads: [{uid: x, workloadIps: [1.2.3.4]}]", "workloads[0].namespace: missing required field"),
    (
        "workloads: [{uid: a, namespace: a, workloadIps: [1.2.3.4]}, {uid: b, namespace: a, workloadIps: [1.2.3.4, 10.0.0.300]}]",
        "workloads[1].workloadIps[1]: '10.0.0.300' is not an IP address",
    ),
    ("workloads: [{namespace: a, workloadIps: [], protocol: QUIC}]", "workloads[0].protocol: unknown value 'QUIC'"),
    ("workloads: [{namespace: a, workloadIps: [], services: {nohost: {80: 80}}}]", "workloads[0].services['nohost']"),
    (
        "workloads: [{namespace: a, workloadIps: [], services: {a/b: {80: 70000}}}]",
        "workloads[0].services['a/b'].80: expected an integer from 0 to 65535, got 70000",
    ),
    ("workloads: [{namespace: a, workloadIps: [], capacity: -1}]", "workloads[0].capacity"),
    ("workloads: [{namespace: a, workloadIps: [], waypoint: {hboneMtlsPort: 1}}]", "workloads[0].waypoint.destination"),
    (
        "workloads: [{uid: a, namespace: a, workloadIps: []}, {uid: a, namespace: b, workloadIps: []}]",
        "workloads[1]: duplicate uid 'a' (also workloads[0])",
    ),
    ("services: [{name: s, namespace: n, hostname: h, vips: ['10.0.0.1']}]", "services[0].vips[0]: '10.0.0.1' is not"),
    ("services: [{name: s, namespace: n, hostname: h, ports: {http: 80}}]", "services[0].ports['http']"),
    ("services: [{name: s, namespace: n, hostname: h, visibility: Private}]", "services[0].visibility: unknown value"),
    ("services: [{name: s, namespace: n, hostname: h, loadBalancer: {mode: Random}}]", "services[0].loadBalancer.mode"),
    ("policies: [{name: p, scope: Namespace, action: Audit}]", "policies[0].action: unknown value 'Audit'"),
    ("policies: [{name: p, scope: Namespace}]", "policies[0].action: missing required field"),
    (
        "policies: [{name: p, scope: Global, action: Allow, rules: [[[{sourceIps: [10.0.0.0/33]}]]]}]",
        "policies[0].rules[0][0][0].sourceIps[0]",
    ),
    (
        "policies: [{name: p, scope: Global, action: Allow, rules: [[[{principals: [{Regex: x}]}]]]}]",
        "policies[0].rules[0][0][0].principals[0]: expected one of !Exact str",
    ),
    (
        "policies: [{name: p, scope: Global, action: Allow, rules: [[[{destinationPort: [80]}]]]}]",
        "policies[0].rules[0][0][0].destinationPort: unknown field",
    ),
    (
        "policies: [{name: p, scope: Global, action: Allow, rules: [[[{destinationPorts: [http]}]]]}]",
        "destinationPorts[0]",
    ),
    ("- just\n- a list", "expected a mapping, got a list"),
    ("workloads: [\n  {namespace: a", "line 2"),
    (
        "services: [{name: s, namespace: n, hostname: h, canonical: 'yes'}]",
        "services[0].canonical: expected true or false",
    ),
]


@pytest.mark.parametrize(("text", "needle"), MALFORMED)
def test_malformed_files_name_the_path(text: str, needle: str) -> None:
    with pytest.raises(LocalConfigError) as e:
        parse_local_config(text, "bad.yaml")
    assert str(e.value).startswith("bad.yaml: ")
    assert needle in str(e.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LocalConfigError) as e:
        load_local_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(e.value) and "cannot read local config" in str(e.value)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    f = tmp_path / "cfg.yaml"
    f.write_text("workloads: [{namespace: a, workloadIps: [x]}]\n")
    with pytest.raises(LocalConfigError) as e:
        load_local_config(f)
    assert str(e.value) == f"{f}: workloads[0].workloadIps[0]: 'x' is not an IP address"
    if os.getuid() != 0:  # root can read anything
        f.chmod(0)
        with pytest.raises(LocalConfigError):
            load_local_config(f)


def test_empty_document_is_empty_state() -> None:
    cfg = parse_local_config("", "empty.yaml")
    assert cfg.update.workloads == [] and cfg.update.replace_all


def test_string_matches_in_upstreams_yaml_tags() -> None:
    """serde_yaml (upstream) spells an enum variant as a tag: ``!Exact x``; it reads as the map form does."""
    rule = "policies: [{{name: p, namespace: n, scope: Namespace, action: Allow, rules: [[[{{{m}}}]]]}}]"
    tagged = "principals: [!Exact td/ns/a/sa/b, !Prefix td/ns/c], notPrincipals: [!Suffix /sa/d, Presence]"
    mapped = "principals: [{Exact: td/ns/a/sa/b}, {Prefix: td/ns/c}], notPrincipals: [{Suffix: /sa/d}, Presence]"
    a = parse_local_config(rule.format(m=tagged), "tagged.yaml").update
    b = parse_local_config(rule.format(m=mapped), "mapped.yaml").update
    assert a == b
    with pytest.raises(LocalConfigError, match=r"bad.yaml.*line 1.*unknown tag !Regex"):
        parse_local_config(rule.format(m="principals: [!Regex x]"), "bad.yaml")

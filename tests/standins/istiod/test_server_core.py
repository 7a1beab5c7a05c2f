"""The local control plane's sans-IO parts: model -> protobuf conversion, the per-stream delta protocol, CA policy."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf.struct_pb2 import Struct

from xds.envoy.service.discovery.v3 import discovery_pb2 as pb
from xds.istio.v1.auth import ca_pb2
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.caclient import generate_csr
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity
from ztunnel.localconfig import load_local_config, parse_local_config
from ztunnel.standins.istiod.ca import CaPolicy, CaRefused, node_identity
from ztunnel.standins.istiod.convert import ConvertError, resources_from_update, workload_name
from ztunnel.standins.istiod.server import DeltaSession, Snapshot, build_snapshot
from ztunnel.state import StateUpdate
from ztunnel.state.workload import Workload
from ztunnel.testing import EXAMPLES
from ztunnel.xds.types import ADDRESS_TYPE, AUTHORIZATION_TYPE, address_from_xds, authorization_from_xds

RICH = """
workloads:
- uid: c1//v1/Pod/ns/a
  name: a
  namespace: ns
  serviceAccount: sa-a
  trustDomain: td.local
  workloadIps: ["10.0.0.1", "fd00::1"]
  protocol: HBONE
  networkMode: HostNetwork
  node: n1
  network: net1
  waypoint: {destination: "net1/10.9.9.9", hboneMtlsPort: 15009}
  networkGateway: {destination: {namespace: gw, hostname: gw.example}}
  applicationTunnel: {protocol: PROXY, port: 15088}
  authorizationPolicies: ["ns/sel"]
  status: Unhealthy
  clusterId: c1
  locality: {region: r, zone: z, subzone: s}
  capacity: 3
  workloadName: a-deploy
  workloadType: job
  canonicalName: a
  canonicalRevision: v9
  hostname: a.example
  nativeTunnel: true
  services:
    "ns/svc.ns.svc.cluster.local": {80: 8080, 443: 8443}
- name: nouid
  namespace: ns
  workloadIps: ["10.0.0.2"]
services:
- name: svc
  namespace: ns
  hostname: svc.ns.svc.cluster.local
  vips: ["/10.96.0.1", "net1/fd00::10"]
  cidrVips: ["/10.97.0.0/16"]
  ports: {80: 8080}
  subjectAltNames: ["spiffe://td.local/ns/ns/sa/sa-a"]
  canonical: true
  visibility: Namespace
  waypoint: {destination: {namespace: ns, hostname: wp}}
  weightedWaypoints: [{destination: {destination: "/10.1.1.1"}, weight: 2}]
  loadBalancer: {routingPreferences: [Network, Zone], mode: Failover, healthPolicy: AllowAll}
  ipFamilies: Dual
policies:
- name: sel
  namespace: ns
  scope: WorkloadSelector
  action: Deny
  dryRun: true
  rules:
  - - - namespaces: [{Exact: a}, {Prefix: b}]
        notPrincipals: [{Suffix: /sa/x}, Presence]
        serviceAccounts: [{namespace: ns, serviceAccount: sa}]
        sourceIps: ["10.0.0.0/8", "fd00::/16"]
        notDestinationIps: ["1.2.3.4"]
        destinationPorts: [80]
        notDestinationPorts: [9999]
    - []
"""


def _normalize(w: Workload) -> Workload:
    # What the xDS side fills in for fields the file left empty.
    return replace(
        w, uid=workload_name(w), cluster_id=w.cluster_id or "Kubernetes", workload_type=w.workload_type or "deployment"
    )


@pytest.mark.parametrize("source", ["rich", "two-node.yaml", "localhost.yaml"])
def test_round_trip_model_protobuf_model(source: str) -> None:
    if source == "rich":
        update = parse_local_config(RICH, "rich").update
    else:
        update = load_local_config(EXAMPLES / source).update
    resources = resources_from_update(update)
    back = [address_from_xds(m) for m in resources[ADDRESS_TYPE].values()]  # type: ignore[arg-type]
    workloads = [x for x in back if isinstance(x, Workload)]
    services = [x for x in back if not isinstance(x, Workload)]
    assert workloads == [_normalize(w) for w in update.workloads]
    assert services == update.services
    policies = [authorization_from_xds(m) for m in resources[AUTHORIZATION_TYPE].values()]  # type: ignore[arg-type]
    assert policies == update.policies
    if source == "rich":
        # Resource names are istiod's: the uid (or its shape when absent), and namespace/hostname.
        assert list(resources[ADDRESS_TYPE]) == [
            "c1//v1/Pod/ns/a",
            "Kubernetes//v1/Pod/ns/nouid",
            "ns/svc.ns.svc.cluster.local",
        ]


def test_unrepresentable_config_is_refused_with_the_resource_named() -> None:
    bad_type = parse_local_config("workloads: [{uid: u, namespace: ns, workloadIps: [], workloadType: statefulset}]")
    with pytest.raises(ConvertError, match=r"workload u: workloadType 'statefulset' has no xDS form"):
        resources_from_update(bad_type.update)
    endpoints = parse_local_config(
        "services: [{name: s, namespace: ns, hostname: h, endpoints: {u: {workloadUid: u}}}]"
    )
    with pytest.raises(ConvertError, match=r"service ns/h: endpoints listed on a service cannot be served"):
        resources_from_update(endpoints.update)


# -- the delta session --------------------------------------------------------------------------------------------


def snapshot(version: int, yaml_text: str) -> Snapshot:
    return build_snapshot(version, parse_local_config(yaml_text).update, {})


ONE = "workloads: [{uid: w1, name: w1, namespace: ns, workloadIps: ['10.0.0.1']}]"
TWO = ONE[:-1] + ", {uid: w2, name: w2, namespace: ns, workloadIps: ['10.0.0.2']}]"


def initial(
    type_url: str, versions: dict[str, str] | None = None, sub: list[str] | None = None, unsub: list[str] | None = None
) -> pb.DeltaDiscoveryRequest:
    return pb.DeltaDiscoveryRequest(
        type_url=type_url,
        initial_resource_versions=versions or {},
        resource_names_subscribe=sub or [],
        resource_names_unsubscribe=unsub or [],
    )


def test_first_request_gets_everything_and_always_an_answer() -> None:
    s = DeltaSession(snapshot(1, TWO))
    (resp,) = s.on_request(initial(ADDRESS_TYPE))
    assert [r.name for r in resp.resources] == ["w1", "w2"]
    assert resp.nonce and resp.type_url == ADDRESS_TYPE
    (resp,) = s.on_request(initial(AUTHORIZATION_TYPE))
    assert list(resp.resources) == [] and list(resp.removed_resources) == []


def test_initial_versions_skip_unchanged_and_remove_unknown() -> None:
    snap = snapshot(1, TWO)
    w1_version = snap.of(ADDRESS_TYPE)["w1"].version
    s = DeltaSession(snap)
    (resp,) = s.on_request(initial(ADDRESS_TYPE, {"w1": w1_version, "gone": "x", "w2": "stale"}))
    assert [r.name for r in resp.resources] == ["w2"]
    assert list(resp.removed_resources) == ["gone"]
    assert s.initial_versions[ADDRESS_TYPE] == {"w1": w1_version, "gone": "x", "w2": "stale"}


def test_snapshot_changes_become_deltas() -> None:
    s = DeltaSession(snapshot(1, TWO))
    s.on_request(initial(ADDRESS_TYPE))
    s.on_request(initial(AUTHORIZATION_TYPE))
    changed = TWO.replace("10.0.0.2", "10.0.0.3")
    (resp,) = s.on_snapshot(snapshot(2, changed))
    assert [r.name for r in resp.resources] == ["w2"] and list(resp.removed_resources) == []
    (resp,) = s.on_snapshot(snapshot(3, ONE))
    assert list(resp.resources) == [] and list(resp.removed_resources) == ["w2"]
    assert s.on_snapshot(snapshot(4, ONE)) == []  # nothing changed: nothing sent


def test_acks_and_nacks_are_recorded() -> None:
    s = DeltaSession(snapshot(1, ONE))
    (resp,) = s.on_request(initial(ADDRESS_TYPE))
    assert s.on_request(pb.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE, response_nonce=resp.nonce)) == []
    nack = pb.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE, response_nonce="9")
    nack.error_detail.message = "w1: bad"
    assert s.on_request(nack) == []
    assert s.acks == [(ADDRESS_TYPE, resp.nonce)]
    assert [(n.nonce, n.message) for n in s.nacks] == [("9", "w1: bad")]


def test_on_demand_subscriptions() -> None:
    s = DeltaSession(snapshot(1, TWO))
    (resp,) = s.on_request(initial(ADDRESS_TYPE, sub=["*"], unsub=["*"]))
    assert list(resp.resources) == [] and list(resp.removed_resources) == []
    (resp,) = s.on_request(pb.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE, resource_names_subscribe=["w2", "nope"]))
    assert [r.name for r in resp.resources] == ["w2"]
    assert list(resp.removed_resources) == ["nope"]  # answered, so the client stops waiting
    # Only subscribed names follow changes.
    (resp,) = s.on_snapshot(snapshot(2, TWO.replace("10.0.0.1", "10.0.0.9").replace("10.0.0.2", "10.0.0.8")))
    assert [r.name for r in resp.resources] == ["w2"]


MESH_WORKLOADS = """
workloads:
- {uid: c, name: c, namespace: ns, workloadIps: ["10.0.0.1"], node: node-a}
- {uid: s1, name: s1, namespace: ns, workloadIps: ["10.0.0.2"], node: node-b,
   services: {"ns/svc.ns.svc.cluster.local": {80: 8080}}}
- {uid: other, name: other, namespace: ns, workloadIps: ["10.0.0.3"], node: node-b}
"""
MESH_SERVICES = """
services:
- {name: svc, namespace: ns, hostname: svc.ns.svc.cluster.local, vips: ["/10.96.0.1"], ports: {80: 8080}}
"""
MESH = MESH_WORKLOADS + MESH_SERVICES


def on_demand_session(snap: Snapshot, node_name: str = "") -> tuple[DeltaSession, pb.DeltaDiscoveryResponse]:
    s = DeltaSession(snap)
    req = initial(ADDRESS_TYPE, sub=["*"], unsub=["*"])
    req.node.id = "ztunnel~1.1.1.1~zt.istio-system~istio-system.svc.cluster.local"
    req.node.metadata.update({"NODE_NAME": node_name})
    (first,) = s.on_request(req)
    return s, first


def test_on_demand_address_resolves_to_service_and_endpoints() -> None:
    s, first = on_demand_session(snapshot(1, MESH))
    assert list(first.resources) == []  # no NODE_NAME: nothing unasked
    (resp,) = s.on_request(pb.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE, resource_names_subscribe=["/10.96.0.1"]))
    # The VIP comes back as the service under its own name plus its endpoint, each with its addresses as aliases.
    assert {r.name: list(r.aliases) for r in resp.resources} == {
        "ns/svc.ns.svc.cluster.local": ["/10.96.0.1"],
        "s1": ["/10.0.0.2"],
    }
    assert list(resp.removed_resources) == []
    # A workload IP resolves to that workload; asking again re-sends it (istiod answers every request).
    (resp,) = s.on_request(pb.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE, resource_names_subscribe=["/10.0.0.3"]))
    assert [r.name for r in resp.resources] == ["other"]
    (resp,) = s.on_request(pb.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE, resource_names_subscribe=["/10.0.0.3"]))
    assert [r.name for r in resp.resources] == ["other"]
    # A new endpoint of the subscribed VIP follows; an unrelated workload does not.
    grown = (
        MESH_WORKLOADS
        + '- {uid: s2, name: s2, namespace: ns, workloadIps: ["10.0.0.4"],'
        + ' services: {"ns/svc.ns.svc.cluster.local": {80: 8080}}}\n'
        + '- {uid: x, name: x, namespace: ns, workloadIps: ["10.0.0.9"]}\n'
        + MESH_SERVICES
    )
    (resp,) = s.on_snapshot(snapshot(2, grown))
    assert [r.name for r in resp.resources] == ["s2"]


def test_on_demand_client_gets_its_node_workloads_unasked() -> None:
    s, first = on_demand_session(snapshot(1, MESH), node_name="node-b")
    assert s.node_name == "node-b"
    assert sorted(r.name for r in first.resources) == ["other", "s1"]
    (resp,) = s.on_request(pb.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE, resource_names_subscribe=["/10.9.9.9"]))
    assert list(resp.resources) == []
    assert list(resp.removed_resources) == ["/10.9.9.9"]  # unknown address: answered, so the client stops waiting


def test_on_demand_reconnect_keeps_held_names_subscribed() -> None:
    snap = snapshot(1, MESH)
    s = DeltaSession(snap)
    held = {"other": snap.of(ADDRESS_TYPE)["other"].version, "s1": "old"}
    (resp,) = s.on_request(initial(ADDRESS_TYPE, held, sub=["*"], unsub=["*"]))
    assert [r.name for r in resp.resources] == ["s1"]  # changed since; "other" is current and not re-sent
    assert list(resp.removed_resources) == []


# -- CA policy ----------------------------------------------------------------------------------------------------

TD = "cluster.local"
CLIENT = Identity(TD, "default", "client")
SERVER = Identity(TD, "default", "server")
NODE = node_identity(TD)


@pytest.fixture(scope="module")
def ca() -> LocalCA:
    return LocalCA.generate(TD)


def request(
    identity: Identity, impersonate: Identity | None = None, ttl: int = 3600, csr: str | None = None
) -> ca_pb2.IstioCertificateRequest:
    req = ca_pb2.IstioCertificateRequest(csr=csr or generate_csr(identity)[0], validity_duration=ttl)
    if impersonate is not None:
        md = Struct()
        md.update({"ImpersonatedIdentity": str(impersonate)})
        req.metadata.CopyFrom(md)
    return req


def policy(ca: LocalCA, tokens: dict[str, Identity] | None = None) -> CaPolicy:
    return CaPolicy(
        ca=ca, trust_domain=TD, tokens=tokens or {}, trusted_nodes={NODE}, served_identities=lambda: {CLIENT}
    )


def refused(code: grpc.StatusCode, fn: object, *args: object) -> str:
    with pytest.raises(CaRefused) as e:
        fn(*args)  # type: ignore[operator]
    assert e.value.code == code
    return str(e.value)


def test_open_server_signs_any_identity_of_its_trust_domain(ca: LocalCA) -> None:
    p = policy(ca)
    assert p.authenticate({}) is None
    identity = Identity(TD, "x", "y")
    csr, key = generate_csr(identity)
    chain = p.sign(request(identity, csr=csr), None)
    assert len(chain) == 2 and chain[1] == ca.root_pem()
    cert = WorkloadCertificate.from_pem_chain(chain, key)
    assert cert.identity == identity
    assert cert.not_after - cert.not_before == timedelta(hours=1, minutes=1)  # ttl + the CA's 1 min backdating
    msg = refused(grpc.StatusCode.PERMISSION_DENIED, p.sign, request(Identity("other.td", "x", "y")), None)
    assert "outside this CA's trust domain" in msg


def test_tokens_authenticate(ca: LocalCA) -> None:
    p = policy(ca, {"t-client": CLIENT, "t-node": NODE})
    assert p.authenticate({"authorization": "Bearer t-client"}) == CLIENT
    assert "no bearer token" in refused(grpc.StatusCode.UNAUTHENTICATED, p.authenticate, {})
    assert "unknown token" in refused(grpc.StatusCode.UNAUTHENTICATED, p.authenticate, {"authorization": "Bearer x"})


def test_identity_rules_with_tokens(ca: LocalCA) -> None:
    p = policy(ca, {"t-client": CLIENT, "t-node": NODE})
    assert len(p.sign(request(CLIENT), CLIENT)) == 2  # its own identity
    msg = refused(grpc.StatusCode.PERMISSION_DENIED, p.sign, request(SERVER), CLIENT)
    assert msg == f"caller {CLIENT} may not request a certificate for {SERVER}"
    # A trusted node may impersonate the identity of a served workload...
    assert len(p.sign(request(CLIENT, impersonate=CLIENT), NODE)) == 2
    # ...but not one nothing runs as, and nobody else may impersonate.
    assert "no served workload" in refused(grpc.StatusCode.PERMISSION_DENIED, p.sign, request(SERVER, SERVER), NODE)
    assert "only trusted node identities" in refused(
        grpc.StatusCode.PERMISSION_DENIED, p.sign, request(CLIENT, CLIENT), CLIENT
    )


def test_csr_checks(ca: LocalCA) -> None:
    p = policy(ca)
    # The CSR's SAN must be the impersonated identity.
    msg = refused(grpc.StatusCode.INVALID_ARGUMENT, p.sign, request(SERVER, impersonate=CLIENT), None)
    assert "CSR rejected" in msg and str(CLIENT) in msg
    assert "cannot parse CSR" in refused(grpc.StatusCode.INVALID_ARGUMENT, p.sign, request(CLIENT, csr="junk"), None)
    key = ec.generate_private_key(ec.SECP256R1())
    two_sans = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(str(CLIENT)), x509.UniformResourceIdentifier(str(SERVER))]
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    assert "exactly one URI SAN" in refused(
        grpc.StatusCode.INVALID_ARGUMENT, p.sign, request(CLIENT, csr=two_sans), None
    )
    msg = refused(grpc.StatusCode.INVALID_ARGUMENT, p.sign, request(CLIENT, ttl=91 * 86400), None)
    assert msg == "requested TTL 91 days, 0:00:00 is greater than the max allowed TTL 90 days, 0:00:00"


def test_snapshot_versions_are_content_hashes(tmp_path: Path) -> None:
    a = build_snapshot(1, parse_local_config(ONE).update, {})
    b = build_snapshot(7, parse_local_config(ONE).update, {})
    assert a.of(ADDRESS_TYPE)["w1"].version == b.of(ADDRESS_TYPE)["w1"].version
    c = build_snapshot(2, parse_local_config(ONE.replace("10.0.0.1", "10.0.0.5")).update, {})
    assert c.of(ADDRESS_TYPE)["w1"].version != a.of(ADDRESS_TYPE)["w1"].version
    assert build_snapshot(1, StateUpdate(), {}).of(ADDRESS_TYPE) == {}

"""The sans-IO delta ADS core (DeltaAdsState): requests, ACK/NACK, readiness, removals, on-demand. No sockets."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from google.protobuf import any_pb2
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

from xds.envoy.service.discovery.v3 import discovery_pb2 as pb
from xds.istio.security import authorization_pb2 as sec
from xds.istio.workload import workload_pb2 as wl
from ztunnel.config import from_env
from ztunnel.state import ProxyState
from ztunnel.state.workload import NamespacedHostname
from ztunnel.xds.client import (
    TRANSITIONS,
    DeltaAdsState,
    RejectedConfig,
    ResourceKey,
    ResourceRemoved,
    ResourceUpdated,
    SubscriptionState,
    XdsSignal,
    XdsUpdate,
    build_node,
)
from ztunnel.xds.types import ADDRESS_TYPE, AUTHORIZATION_TYPE
from ztunnel.xds.updater import AddressHandler, AuthorizationHandler

_nonces = itertools.count(1)


def res(name: str, msg: Message | bytes, version: str = "v1", type_url: str = ADDRESS_TYPE) -> pb.Resource:
    value = msg if isinstance(msg, bytes) else msg.SerializeToString()
    return pb.Resource(name=name, version=version, resource=any_pb2.Any(type_url=type_url, value=value))


def response(type_url: str, *resources: pb.Resource, removed: Sequence[str] = ()) -> pb.DeltaDiscoveryResponse:
    return pb.DeltaDiscoveryResponse(
        type_url=type_url, nonce=f"n{next(_nonces)}", resources=list(resources), removed_resources=list(removed)
    )


def wl_addr(uid: str, ip: bytes = b"\x0a\x00\x00\x01", **kw: object) -> wl.Address:
    return wl.Address(workload=wl.Workload(uid=uid, name=uid.rsplit("/", 1)[-1], namespace="ns", addresses=[ip], **kw))  # type: ignore[arg-type]


def svc_addr(ns: str, host: str) -> wl.Address:
    return wl.Address(service=wl.Service(name=host.split(".", maxsplit=1)[0], namespace=ns, hostname=host))


def policy(ns: str, name: str) -> sec.Authorization:
    return sec.Authorization(name=name, namespace=ns, scope=sec.NAMESPACE, action=sec.DENY)


@pytest.fixture
def state() -> ProxyState:
    return ProxyState()


def core(state: ProxyState, on_demand: bool = False) -> DeltaAdsState:
    cfg = from_env({"XDS_ADDRESS": "https://cp:15012", "POD_NAME": "zt", "POD_NAMESPACE": "istio-system"})
    return DeltaAdsState(build_node(cfg), [AddressHandler(state), AuthorizationHandler(state)], on_demand)


class Recorder:
    """A handler that records what it is given and rejects names starting with ``bad``."""

    type_url = ADDRESS_TYPE
    message_type: type[Message] = wl.Address
    on_demand_capable = True

    def __init__(self) -> None:
        self.calls: list[list[XdsUpdate]] = []

    def handle(self, updates: Sequence[XdsUpdate]) -> list[RejectedConfig]:
        self.calls.append(list(updates))
        return [RejectedConfig(u.name, "no") for u in updates if u.name.startswith("bad")]


def test_initial_requests_are_wildcard_with_node(state: ProxyState) -> None:
    c = core(state)
    reqs = c.initial_requests()
    assert [r.type_url for r in reqs] == [ADDRESS_TYPE, AUTHORIZATION_TYPE]
    for r in reqs:
        assert r.node.id == "ztunnel~1.1.1.1~zt.istio-system~istio-system.svc.cluster.local"
        assert list(r.resource_names_subscribe) == [] and list(r.resource_names_unsubscribe) == []
        assert dict(r.initial_resource_versions) == {}
        assert not r.response_nonce


def test_node_metadata_as_upstream() -> None:
    cfg = from_env(
        {
            "XDS_ADDRESS": "",
            "INSTANCE_IP": "10.1.2.3",
            "POD_NAME": "zt-1",
            "POD_NAMESPACE": "istio-system",
            "NODE_NAME": "node-a",
            "ISTIO_META_CLUSTER_ID": "c1",
            "ISTIO_METAJSON_LABELS": '{"app": "x", "n": 2}',
        }
    )
    node = build_node(cfg)
    assert node.id == "ztunnel~10.1.2.3~zt-1.istio-system~istio-system.svc.cluster.local"
    md = node.metadata.fields
    assert md["NAME"].string_value == "zt-1"
    assert md["NAMESPACE"].string_value == "istio-system"
    assert md["INSTANCE_IPS"].string_value == "10.1.2.3"
    assert md["NODE_NAME"].string_value == "node-a"
    assert md["CLUSTER_ID"].string_value == "c1"
    labels = md["LABELS"].struct_value.fields
    assert labels["app"].string_value == "x" and labels["n"].number_value == 2


def test_ack_applies_and_records_versions(state: ProxyState) -> None:
    c = core(state)
    h = c.receive(
        response(
            ADDRESS_TYPE,
            res("c//v1/Pod/ns/a", wl_addr("c//v1/Pod/ns/a"), "1"),
            res("ns/s.ns", svc_addr("ns", "s.ns"), "2"),
        )
    )
    assert h.signal is XdsSignal.ACK
    assert h.reply.type_url == ADDRESS_TYPE and h.reply.response_nonce == h.nonce
    assert not h.reply.HasField("error_detail") and not h.reply.HasField("node")
    assert state.workloads.find_uid("c//v1/Pod/ns/a") is not None
    assert state.services.get(NamespacedHostname("ns", "s.ns")) is not None
    assert c.known_resources[ADDRESS_TYPE] == {"c//v1/Pod/ns/a": "1", "ns/s.ns": "2"}


def test_nack_names_each_bad_resource_and_applies_the_good_ones(state: ProxyState) -> None:
    c = core(state)
    h = c.receive(
        response(
            ADDRESS_TYPE,
            res("good", wl_addr("good"), "1"),
            res("bad-ip", wl_addr("bad-ip", ip=b"\x01\x02\x03\x04\x05"), "1"),
            res("junk", b"\xff", "1"),
            pb.Resource(name="empty", version="1"),
        )
    )
    assert h.signal is XdsSignal.NACK
    assert h.error_detail is not None
    parts = h.error_detail.split("; ")
    assert parts[0] == "bad-ip: workload.addresses[0]: IP address must be 4 or 16 bytes, got 5"
    assert parts[1].startswith("junk: decode: ")
    assert parts[2] == "empty: XDS payload without resource"
    assert state.workloads.find_uid("good") is not None
    assert state.workloads.find_uid("bad-ip") is None
    # Only accepted resources count as held: the rejected ones must be re-sent after a reconnect.
    assert c.known_resources[ADDRESS_TYPE] == {"good": "1"}
    assert dict(c.initial_requests()[0].initial_resource_versions) == {"good": "1"}


def test_nack_keeps_the_last_good_version(state: ProxyState) -> None:
    c = core(state)
    c.receive(response(ADDRESS_TYPE, res("w", wl_addr("w", tunnel_protocol=wl.HBONE), "1")))
    h = c.receive(response(ADDRESS_TYPE, res("w", wl_addr("w", tunnel_protocol=wl.LEGACY_ISTIO_MTLS), "2")))
    assert h.signal is XdsSignal.NACK
    assert h.error_detail == "w: workload.tunnel_protocol: unsupported tunnel protocol: legacy istio mtls"
    w = state.workloads.find_uid("w")
    assert w is not None and w.protocol.value == "HBONE"
    assert c.known_resources[ADDRESS_TYPE] == {"w": "1"}


def test_removals_of_workloads_services_and_policies(state: ProxyState) -> None:
    c = core(state)
    c.receive(
        response(ADDRESS_TYPE, res("c//v1/Pod/ns/a", wl_addr("c//v1/Pod/ns/a")), res("ns/s", svc_addr("ns", "s")))
    )
    c.receive(response(AUTHORIZATION_TYPE, res("ns/p", policy("ns", "p"), type_url=AUTHORIZATION_TYPE)))
    assert len(state.policies) == 1
    h = c.receive(response(ADDRESS_TYPE, removed=["c//v1/Pod/ns/a", "ns/s", "c//v1/Pod/ns/unknown"]))
    assert h.signal is XdsSignal.ACK
    assert len(state.workloads) == 0 and len(state.services) == 0
    assert c.known_resources[ADDRESS_TYPE] == {}
    c.receive(response(AUTHORIZATION_TYPE, removed=["ns/p"]))
    assert len(state.policies) == 0


def test_policy_named_differently_from_its_key_is_still_removed(state: ProxyState) -> None:
    c = core(state)
    c.receive(response(AUTHORIZATION_TYPE, res("odd-name", policy("ns", "p"), type_url=AUTHORIZATION_TYPE)))
    assert state.policies.get("ns/p") is not None
    c.receive(response(AUTHORIZATION_TYPE, removed=["odd-name"]))
    assert len(state.policies) == 0


def test_update_and_removal_of_one_name_in_one_response_removes_it() -> None:
    rec = Recorder()
    c = DeltaAdsState(pb.DeltaDiscoveryRequest().node, [rec])
    c.receive(response(ADDRESS_TYPE, res("x", wl_addr("x")), removed=["x"]))
    assert rec.calls == [[ResourceRemoved("x")]]
    assert "x" not in c.known_resources[ADDRESS_TYPE]


def test_handler_sees_updates_in_order_then_removals() -> None:
    rec = Recorder()
    c = DeltaAdsState(pb.DeltaDiscoveryRequest().node, [rec])
    c.receive(response(ADDRESS_TYPE, res("a", wl_addr("a")), res("b", wl_addr("b")), removed=["z"]))
    names = [(type(u).__name__, u.name) for u in rec.calls[0]]
    assert names == [("ResourceUpdated", "a"), ("ResourceUpdated", "b"), ("ResourceRemoved", "z")]
    assert isinstance(rec.calls[0][0], ResourceUpdated) and isinstance(rec.calls[0][0].resource, wl.Address)


def test_unknown_type_is_acked_and_not_tracked(state: ProxyState) -> None:
    c = core(state)
    h = c.receive(
        response("type.googleapis.com/some.Other", res("x", b"\x01", type_url="type.googleapis.com/some.Other"))
    )
    assert h.signal is XdsSignal.ACK and not h.known_type
    assert h.reply.type_url == "type.googleapis.com/some.Other"
    assert "type.googleapis.com/some.Other" not in c.known_resources
    assert not c.ready


def test_ready_after_first_ack_of_both_types_only(state: ProxyState) -> None:
    c = core(state)
    h1 = c.receive(response(ADDRESS_TYPE, res("bad", wl_addr("bad", ip=b"\x01"))))
    assert h1.signal is XdsSignal.NACK and not h1.became_ready
    h2 = c.receive(response(AUTHORIZATION_TYPE))
    assert h2.signal is XdsSignal.ACK and not h2.became_ready and not c.ready
    assert c.subscriptions == {ADDRESS_TYPE: SubscriptionState.UNSYNCED, AUTHORIZATION_TYPE: SubscriptionState.SYNCED}
    h3 = c.receive(response(ADDRESS_TYPE))
    assert (h3.became_ready, c.ready) == (True, True)
    h4 = c.receive(response(ADDRESS_TYPE))
    assert not h4.became_ready  # once per lifetime


def test_versions_survive_for_reconnect(state: ProxyState) -> None:
    c = core(state)
    c.receive(response(ADDRESS_TYPE, res("a", wl_addr("a"), "7")))
    c.receive(response(AUTHORIZATION_TYPE, res("ns/p", policy("ns", "p"), "3", type_url=AUTHORIZATION_TYPE)))
    addr, auth = c.initial_requests()
    assert dict(addr.initial_resource_versions) == {"a": "7"}
    assert dict(auth.initial_resource_versions) == {"ns/p": "3"}
    assert addr.node.id  # the node is on every stream's first requests


def test_on_demand_initial_request_and_readiness(state: ProxyState) -> None:
    c = core(state, on_demand=True)
    addr, auth = c.initial_requests()
    assert list(addr.resource_names_subscribe) == ["*"] and list(addr.resource_names_unsubscribe) == ["*"]
    assert list(auth.resource_names_subscribe) == [] and list(auth.resource_names_unsubscribe) == []
    assert c.subscriptions[ADDRESS_TYPE] is SubscriptionState.ON_DEMAND
    assert c.receive(response(AUTHORIZATION_TYPE)).became_ready


def test_demand_request_and_answer(state: ProxyState) -> None:
    c = core(state, on_demand=True)
    req = c.demand(ADDRESS_TYPE, "/10.0.0.1")
    assert req is not None
    assert req.type_url == ADDRESS_TYPE and list(req.resource_names_subscribe) == ["/10.0.0.1"]
    assert not req.HasField("node")
    assert c.known_resources[ADDRESS_TYPE] == {"/10.0.0.1": ""}
    h = c.receive(response(ADDRESS_TYPE, res("other", wl_addr("other"))))
    assert h.demands_answered == ()
    h = c.receive(response(ADDRESS_TYPE, removed=["/10.0.0.1"]))
    assert h.demands_answered == (ResourceKey(ADDRESS_TYPE, "/10.0.0.1"),)
    assert c.pending_demands == set()


def test_demand_is_sent_once_while_pending(state: ProxyState) -> None:
    c = core(state, on_demand=True)
    assert c.demand(ADDRESS_TYPE, "/10.0.0.1") is not None
    assert c.demand(ADDRESS_TYPE, "/10.0.0.1") is None  # already asked: wait for the same answer
    c.receive(response(ADDRESS_TYPE, removed=["/10.0.0.1"]))
    assert c.demand(ADDRESS_TYPE, "/10.0.0.1") is not None  # answered: a later miss asks again


def test_demand_answered_by_alias(state: ProxyState) -> None:
    # istiod answers "/10.96.0.1" with the service that has that VIP, under the service's own name, plus its
    # endpoints; the demanded name comes back as an alias.
    c = core(state, on_demand=True)
    c.demand(ADDRESS_TYPE, "/10.96.0.1")
    svc = res("ns/svc.ns.svc.cluster.local", svc_addr("ns", "svc.ns.svc.cluster.local"))
    svc.aliases.append("/10.96.0.1")
    h = c.receive(response(ADDRESS_TYPE, svc, res("c1//v1/Pod/ns/a", wl_addr("c1//v1/Pod/ns/a"))))
    assert h.demands_answered == (ResourceKey(ADDRESS_TYPE, "/10.96.0.1"),)
    assert state.services.get(NamespacedHostname("ns", "svc.ns.svc.cluster.local")) is not None
    assert c.known_resources[ADDRESS_TYPE]["ns/svc.ns.svc.cluster.local"] == "v1"


@pytest.mark.parametrize(("state", "signal"), list(itertools.product(SubscriptionState, XdsSignal)))
def test_transition_table_is_total(state: SubscriptionState, signal: XdsSignal) -> None:
    nxt = TRANSITIONS[(state, signal)]
    if state is SubscriptionState.ON_DEMAND:
        assert nxt is SubscriptionState.ON_DEMAND
    elif signal is XdsSignal.ACK:
        assert nxt is SubscriptionState.SYNCED
    else:
        assert nxt is state  # a NACK never changes readiness


@given(st.lists(st.tuples(st.sampled_from([ADDRESS_TYPE, AUTHORIZATION_TYPE]), st.booleans()), max_size=12))
def test_ready_iff_each_type_was_acked_once(seq: list[tuple[str, bool]]) -> None:
    c = DeltaAdsState(pb.DeltaDiscoveryRequest().node, [_Rejecting(ADDRESS_TYPE), _Rejecting(AUTHORIZATION_TYPE)])
    acked: set[str] = set()
    ready_events = 0
    for type_url, good in seq:
        h = c.receive(response(type_url, res("ok" if good else "bad", b"", type_url=type_url)))
        ready_events += h.became_ready
        if good:
            acked.add(type_url)
        assert c.ready == (acked == {ADDRESS_TYPE, AUTHORIZATION_TYPE})
    assert ready_events == (1 if c.ready else 0)


class _Rejecting:
    message_type: type[Message] = wl.Address
    on_demand_capable = False

    def __init__(self, type_url: str) -> None:
        self.type_url = type_url

    def handle(self, updates: Sequence[XdsUpdate]) -> list[RejectedConfig]:
        return [RejectedConfig(u.name, "no") for u in updates if u.name == "bad"]

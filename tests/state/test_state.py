from __future__ import annotations

import ipaddress
from types import MappingProxyType

from ztunnel.rbac import Action, Authorization, Scope
from ztunnel.state import ProxyState, StateChange, StateUpdate
from ztunnel.state.service import Service, Visibility, find_best_match
from ztunnel.state.workload import InboundProtocol, NamespacedHostname, NetworkAddress, NetworkCidr, Workload

SVC = NamespacedHostname("default", "echo.default.svc.cluster.local")


def ip(s: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(s)


def wl(
    uid: str,
    addr: str,
    *,
    ns: str = "default",
    node: str = "",
    services: dict[NamespacedHostname, dict[int, int]] | None = None,
    **kw,
) -> Workload:
    return Workload(
        uid=uid,
        name=uid.rsplit("/", 1)[-1],
        namespace=ns,
        workload_ips=(ip(addr),),
        trust_domain="cluster.local",
        service_account="sa",
        node=node,
        services=MappingProxyType(services or {}),
        **kw,
    )


def svc(ns: str = "default", host: str = "echo.default.svc.cluster.local", vip: str = "10.96.0.1", **kw) -> Service:
    return Service(
        name=host.split(".", maxsplit=1)[0], namespace=ns, hostname=host, vips=(NetworkAddress("", ip(vip)),), **kw
    )


def test_workload_indexes() -> None:
    s = ProxyState(local_node="n1")
    s.apply(StateUpdate(workloads=[wl("c//v1/Pod/default/a", "10.0.0.1", node="n1"), wl("b", "10.0.0.2", node="n2")]))
    a = s.workloads.find_address(NetworkAddress("", ip("10.0.0.1")))
    assert a is not None and a.uid == "c//v1/Pod/default/a"
    assert s.workloads.find_address(NetworkAddress("other", ip("10.0.0.1"))) is None
    assert s.workloads.find_local("default", "a", "sa") is a
    assert s.workloads.find_local("default", "b", "sa") is None  # on another node
    assert list(s.workloads.node_local_identities()) == [a.identity]
    # Replacing a workload with a new IP drops the old address.
    s.apply(StateUpdate(workloads=[wl("c//v1/Pod/default/a", "10.0.0.9", node="n1")]))
    assert s.workloads.find_address(NetworkAddress("", ip("10.0.0.1"))) is None
    assert s.workloads.find_address(NetworkAddress("", ip("10.0.0.9"))) is not None
    s.apply(StateUpdate(removed_workloads=["c//v1/Pod/default/a"]))
    assert s.workloads.find_address(NetworkAddress("", ip("10.0.0.9"))) is None
    assert list(s.workloads.node_local_identities()) == []


def test_find_address_and_hostname_as_upstream() -> None:
    """Workloads before service VIPs for an address; services before workloads for a hostname."""
    s = ProxyState()
    pod = wl("c//v1/Pod/default/a", "10.0.0.1", hostname="a.example")
    echo = svc(vip="10.0.0.1")  # a VIP that is also a pod's address
    s.apply(StateUpdate(workloads=[pod], services=[echo, svc(host="other.default.svc.cluster.local", vip="10.96.0.2")]))
    assert s.find_address(NetworkAddress("", ip("10.0.0.1"))) is s.workloads.find_uid(pod.uid)
    assert s.find_address(NetworkAddress("", ip("10.96.0.2"))) is s.services.get(
        NamespacedHostname("default", "other.default.svc.cluster.local")
    )
    assert s.find_address(NetworkAddress("", ip("10.0.0.9"))) is None
    assert s.find_hostname(SVC) is s.services.get(SVC)
    assert s.find_hostname(NamespacedHostname("default", "a.example")) is s.workloads.find_uid(pod.uid)
    assert s.find_hostname(NamespacedHostname("other", "a.example")) is None


def test_address_conflict_prefers_pods_then_hbone() -> None:
    s = ProxyState()
    se = wl("c/networking.istio.io/ServiceEntry/default/se", "10.0.0.1", protocol=InboundProtocol.HBONE)
    pod = wl("Kubernetes//Pod/default/p", "10.0.0.1")  # istiod writes pods as <cluster>//Pod/<ns>/<name>
    s.apply(StateUpdate(workloads=[se, pod]))
    found = s.workloads.find_address(NetworkAddress("", ip("10.0.0.1")))
    assert found is not None and found.uid == pod.uid
    s.apply(StateUpdate(removed_workloads=[pod.uid]))
    found = s.workloads.find_address(NetworkAddress("", ip("10.0.0.1")))
    assert found is not None and found.uid == se.uid


def test_endpoints_follow_workloads_and_stage_before_service() -> None:
    s = ProxyState()
    # The workload arrives first: its endpoint waits for the service.
    s.apply(StateUpdate(workloads=[wl("w1", "10.0.0.1", services={SVC: {80: 8080}})]))
    assert SVC in s.services.staged
    s.apply(StateUpdate(services=[svc()]))
    service = s.services.get(SVC)
    assert service is not None and set(service.endpoints) == {"w1"}
    assert service.endpoints["w1"].port == {80: 8080}
    assert SVC not in s.services.staged
    # Updating the service keeps its endpoints.
    s.apply(StateUpdate(services=[svc(vip="10.96.0.2")]))
    service = s.services.get(SVC)
    assert service is not None and set(service.endpoints) == {"w1"}
    assert s.services.get_best_by_vip(NetworkAddress("", ip("10.96.0.1")), None) is None
    # A workload that stops listing the service leaves its endpoints.
    s.apply(StateUpdate(workloads=[wl("w1", "10.0.0.1")]))
    service = s.services.get(SVC)
    assert service is not None and service.endpoints == {}
    s.apply(StateUpdate(workloads=[wl("w2", "10.0.0.2", services={SVC: {}})]))
    s.apply(StateUpdate(removed_services=[SVC]))
    assert s.services.get(SVC) is None
    assert set(s.services.staged[SVC]) == {"w2"}  # kept for a service that comes back
    s.apply(StateUpdate(removed_workloads=["w2"]))
    assert SVC not in s.services.staged


def test_vip_and_host_ranking() -> None:
    s = ProxyState()
    a = svc(ns="a", host="shared.example", vip="10.96.0.5")
    b = svc(ns="b", host="shared.example", vip="10.96.0.5", canonical=True)
    c = svc(ns="c", host="shared.example", vip="10.96.0.5", visibility=Visibility.NAMESPACE)
    s.apply(StateUpdate(services=[a, b, c]))
    vip = NetworkAddress("", ip("10.96.0.5"))
    assert len(s.services.get_by_vip(vip)) == 3
    assert s.services.get_best_by_vip(vip, "a") == a  # client namespace first
    assert s.services.get_best_by_vip(vip, "x") == b  # then canonical
    assert s.services.get_best_by_vip(vip, "c") == c  # visible to its own namespace
    assert s.services.get_best_by_host("shared.example", "x") == b
    assert find_best_match([a, c], None, "c") == c  # preferred namespace
    assert find_best_match([a, c], None, None) == a  # else the first


def test_cidr_vip_longest_prefix_and_namespace() -> None:
    s = ProxyState()
    wide = Service(name="w", namespace="a", hostname="w", cidr_vips=(NetworkCidr.parse("/10.0.0.0/8"),))
    narrow = Service(name="n", namespace="b", hostname="n", cidr_vips=(NetworkCidr.parse("/10.1.0.0/16"),))
    s.apply(StateUpdate(services=[wide, narrow]))
    addr = NetworkAddress("", ip("10.1.2.3"))
    assert s.services.get_best_by_vip(addr, None) == narrow
    assert s.services.get_best_by_vip(addr, "a") == wide  # namespace beats specificity
    assert s.services.get_best_by_vip(NetworkAddress("", ip("11.0.0.1")), None) is None


def test_policies_indexed_by_scope() -> None:
    s = ProxyState()
    g = Authorization("g", "istio-system", Scope.GLOBAL, Action.DENY)
    n = Authorization("n", "default", Scope.NAMESPACE, Action.ALLOW)
    w = Authorization("w", "default", Scope.WORKLOAD_SELECTOR, Action.ALLOW)
    s.apply(StateUpdate(policies=[g, n, w]))
    assert set(s.policies.in_namespace("")) == {"istio-system/g"}
    assert set(s.policies.in_namespace("default")) == {"default/n"}
    assert s.policies.get("default/w") == w
    s.apply(StateUpdate(removed_policies=["default/n"]))
    assert s.policies.in_namespace("default") == {}


def test_batches_are_atomic_and_notify_once() -> None:
    s = ProxyState()
    seen: list[tuple[StateChange, int, int]] = []
    unsubscribe = s.subscribe(lambda ch: seen.append((ch, len(s.workloads), len(s.services))))
    s.apply(StateUpdate(workloads=[wl("w1", "10.0.0.1"), wl("w2", "10.0.0.2")], services=[svc()]))
    assert seen == [(StateChange(workloads=True, services=True, policies=False), 2, 1)]
    s.apply(StateUpdate(policies=[Authorization("p", "default", Scope.NAMESPACE, Action.ALLOW)]))
    assert seen[-1][0] == StateChange(workloads=False, services=False, policies=True)
    unsubscribe()
    s.apply(StateUpdate(removed_workloads=["w1"]))
    assert len(seen) == 2


def test_replace_all_removes_what_is_absent() -> None:
    s = ProxyState()
    s.apply(StateUpdate(workloads=[wl("w1", "10.0.0.1"), wl("w2", "10.0.0.2", services={SVC: {}})], services=[svc()]))
    s.apply(StateUpdate(workloads=[wl("w1", "10.0.0.1")], replace_all=True))
    assert [w.uid for w in s.workloads] == ["w1"]
    assert len(s.services) == 0 and s.services.staged == {}

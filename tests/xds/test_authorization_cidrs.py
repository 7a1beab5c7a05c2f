"""CIDRs in xDS authorization policies: kept exactly as sent (IPv4-mapped IPv6 included), matched as upstream, and
a malformed one refuses the whole resource (NACK naming it) instead of silently vanishing.

Upstream (``rbac.rs``) turns each ``Address`` into an ``ipnet::IpNet`` from the raw bytes (no canonicalisation), so
``::ffff:10.0.0.0/104`` stays an IPv6 network; ``IpNet::contains`` is false across families, and every source and
destination address is canonicalised (``::ffff:a.b.c.d`` -> ``a.b.c.d``) before matching. So a mapped CIDR never
matches an IPv4 peer: ``notIpBlocks: [mapped]`` holds for every IPv4 source (the DENY denies), ``ipBlocks:
[mapped]`` for none (the ALLOW allows nothing). Both fail closed. Dropping the entry, as this project did, turned
both into fail-open rules.

Everything here goes through real protobufs: messages serialised to bytes and fed to the delta ADS core with the
real handlers, or to the conversion, and the same policy written as local config YAML must mean the same.
"""

from __future__ import annotations

import ipaddress
import itertools

import pytest
from google.protobuf import any_pb2
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import fuzz_settings
from xds.envoy.service.discovery.v3 import discovery_pb2 as pb
from xds.istio.security import authorization_pb2 as sec
from ztunnel.config import from_env
from ztunnel.identity.spiffe import Identity
from ztunnel.localconfig import parse_local_config
from ztunnel.rbac import Authorization, Connection, evaluate
from ztunnel.state import ProxyState
from ztunnel.xds.client import DeltaAdsState, XdsSignal, build_node
from ztunnel.xds.types import AUTHORIZATION_TYPE, ConversionError, authorization_from_xds
from ztunnel.xds.updater import AddressHandler, AuthorizationHandler

FOO = Identity("cluster.local", "foo", "sa")
BAR = Identity("cluster.local", "bar", "sa")
DST = ipaddress.ip_address("10.9.9.9")
_nonces = itertools.count(1)


def addr(cidr: str) -> sec.Address:
    """An ``Address`` as istiod encodes an ipBlocks entry: ``netip.Prefix.Addr().AsSlice()`` (16 bytes for a
    mapped address) and the prefix length as written."""
    net = ipaddress.ip_network(cidr, strict=False)
    return sec.Address(address=net.network_address.packed, length=net.prefixlen)


def policy(action: int, match: sec.Match, name: str = "p") -> sec.Authorization:
    return sec.Authorization(
        name=name,
        namespace="ns",
        scope=sec.NAMESPACE,
        action=action,  # type: ignore[arg-type]
        rules=[sec.Rule(clauses=[sec.Clause(matches=[match])])],
    )


def via_ads(*policies: sec.Authorization) -> tuple[ProxyState, XdsSignal, str | None]:
    """Push ``policies`` (serialised) through the delta ADS core into a fresh state."""
    state = ProxyState()
    cfg = from_env({"XDS_ADDRESS": "https://cp:15012", "POD_NAME": "zt", "POD_NAMESPACE": "istio-system"})
    core = DeltaAdsState(build_node(cfg), [AddressHandler(state), AuthorizationHandler(state)], False)
    resources = [
        pb.Resource(
            name=f"{p.namespace}/{p.name}",
            version="1",
            resource=any_pb2.Any(type_url=AUTHORIZATION_TYPE, value=p.SerializeToString()),
        )
        for p in policies
    ]
    handled = core.receive(
        pb.DeltaDiscoveryResponse(type_url=AUTHORIZATION_TYPE, nonce=f"n{next(_nonces)}", resources=resources)
    )
    return state, handled.signal, handled.error_detail


def allowed(state: ProxyState, src: str, identity: Identity | None) -> bool:
    conn = Connection(ipaddress.ip_address(src), 40000, DST, 8080, identity)
    return evaluate(state.policies.for_workload("ns", ()), conn).allowed


# -- the two fail-open rules of the issue --------------------------------------------------------------------------


def test_deny_not_ip_blocks_mapped_denies_every_ipv4_source() -> None:
    state, signal, _ = via_ads(policy(sec.DENY, sec.Match(not_source_ips=[addr("::ffff:10.0.0.0/104")])))
    assert signal is XdsSignal.ACK
    (p,) = state.policies
    assert p.rules[0][0][0].not_source_ips == (ipaddress.IPv6Network("::ffff:a00:0/104"),)
    # The mapped network contains no IPv4 address (upstream: IpNet::contains across families is false), so
    # "not in it" holds for every IPv4 source, 10/8 included: all denied, as upstream.
    for src in ("10.1.2.3", "192.168.0.1"):
        assert not allowed(state, src, FOO), src


def test_allow_mapped_ip_blocks_with_namespace_allows_nothing_from_ipv4() -> None:
    match = sec.Match(source_ips=[addr("::ffff:10.0.0.0/104")], namespaces=[sec.StringMatch(exact="foo")])
    state, signal, _ = via_ads(policy(sec.ALLOW, match))
    assert signal is XdsSignal.ACK
    for src in ("10.1.2.3", "192.168.0.1"):
        assert not allowed(state, src, FOO), src  # was: foo allowed from anywhere
        assert not allowed(state, src, BAR), src


def test_plain_ipv4_and_ipv6_cidrs_match_their_family() -> None:
    state, _, _ = via_ads(policy(sec.ALLOW, sec.Match(source_ips=[addr("10.0.0.0/8"), addr("fd00::/8")])))
    assert allowed(state, "10.1.2.3", None)
    assert allowed(state, "fd00::1", None)
    assert not allowed(state, "11.0.0.1", None)
    assert not allowed(state, "fe80::1", None)


# -- malformed CIDRs: the resource is refused, naming the entry ---------------------------------------------------

BAD = [
    (
        sec.Match(source_ips=[addr("10.0.0.0/8"), sec.Address(address=b"\x01\x02\x03", length=8)]),
        "rules[0].clauses[0].matches[0].source_ips[1]: IP address must be 4 or 16 bytes, got 3",
    ),
    (
        sec.Match(not_source_ips=[sec.Address(address=bytes([10, 0, 0, 0]), length=33)]),
        "rules[0].clauses[0].matches[0].not_source_ips[0]: invalid CIDR 10.0.0.0/33: prefix length 33 > 32",
    ),
    (
        # upstream truncates the length to 8 bits (264 -> /8); refused here
        sec.Match(destination_ips=[sec.Address(address=bytes([10, 0, 0, 0]), length=264)]),
        "rules[0].clauses[0].matches[0].destination_ips[0]: invalid CIDR 10.0.0.0/264: prefix length 264 > 32",
    ),
    (
        sec.Match(
            not_destination_ips=[sec.Address(address=ipaddress.IPv6Address("::ffff:10.0.0.0").packed, length=129)]
        ),
        "rules[0].clauses[0].matches[0].not_destination_ips[0]: invalid CIDR ::ffff:a00:0/129: prefix length 129 > 128",
    ),
    (
        sec.Match(source_ips=[sec.Address()]),
        "rules[0].clauses[0].matches[0].source_ips[0]: IP address must be 4 or 16 bytes, got 0",
    ),
]


@pytest.mark.parametrize(("match", "expected"), BAD)
def test_malformed_cidr_is_refused_naming_it(match: sec.Match, expected: str) -> None:
    with pytest.raises(ConversionError) as e:
        authorization_from_xds(policy(sec.DENY, match))
    assert str(e.value) == expected


@pytest.mark.parametrize(("match", "expected"), BAD)
def test_malformed_cidr_nacks_the_policy_and_applies_the_others(match: sec.Match, expected: str) -> None:
    good = policy(sec.DENY, sec.Match(source_ips=[addr("10.0.0.0/8")]), name="good")
    state, signal, detail = via_ads(policy(sec.DENY, match, name="bad"), good)
    assert signal is XdsSignal.NACK
    assert detail == f"ns/bad: {expected}"
    assert [p.key for p in state.policies] == ["ns/good"]


def test_a_nacked_update_keeps_the_previous_version_of_the_policy() -> None:
    # docs/security.md: a NACKed policy is not enforced until a valid one arrives; the version already held stays.
    state = ProxyState()
    cfg = from_env({"XDS_ADDRESS": "https://cp:15012", "POD_NAME": "zt", "POD_NAMESPACE": "istio-system"})
    core = DeltaAdsState(build_node(cfg), [AddressHandler(state), AuthorizationHandler(state)], False)

    def push(p: sec.Authorization, version: str) -> XdsSignal:
        any_p = any_pb2.Any(type_url=AUTHORIZATION_TYPE, value=p.SerializeToString())
        resource = pb.Resource(name="ns/p", version=version, resource=any_p)
        response = pb.DeltaDiscoveryResponse(type_url=AUTHORIZATION_TYPE, nonce=f"n{version}", resources=[resource])
        return core.receive(response).signal

    assert push(policy(sec.DENY, sec.Match(source_ips=[addr("10.0.0.0/8")])), "1") is XdsSignal.ACK
    broken = sec.Match(source_ips=[sec.Address(address=b"\x0a\x00\x00", length=8)])
    assert push(policy(sec.DENY, broken), "2") is XdsSignal.NACK
    assert not allowed(state, "10.1.2.3", None)  # version 1 still denies 10/8
    assert allowed(state, "192.168.0.1", None)


# -- xDS and local config agree ------------------------------------------------------------------------------------

v4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
v6 = st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address)
mapped = v4.map(lambda a: ipaddress.IPv6Address(b"\x00" * 10 + b"\xff\xff" + a.packed))
cidrs = st.one_of(
    st.tuples(v4, st.integers(0, 32)),
    st.tuples(v6, st.integers(0, 128)),
    st.tuples(mapped, st.integers(0, 128)),
    st.tuples(mapped, st.integers(96, 128)),
)
sources = st.one_of(v4, v6, mapped.map(lambda a: a.ipv4_mapped))


def local_policy(
    action: str, field: str, nets: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]
) -> Authorization:
    entries = ", ".join(f'"{ip}/{n}"' for ip, n in nets)
    text = f"""
policies:
  - name: p
    namespace: ns
    scope: Namespace
    action: {action}
    rules:
      - - - {field}: [{entries}]
"""
    (p,) = parse_local_config(text).update.policies
    return p


@given(
    st.sampled_from([("Allow", sec.ALLOW), ("Deny", sec.DENY)]),
    st.sampled_from([("sourceIps", "source_ips"), ("notSourceIps", "not_source_ips")]),
    st.lists(cidrs, min_size=1, max_size=4),
    st.lists(sources, min_size=1, max_size=8),
)
@fuzz_settings(200)
def test_xds_and_local_config_give_the_same_policy_and_decisions(
    action: tuple[str, int],
    field: tuple[str, str],
    nets: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]],
    srcs: list[ipaddress.IPv4Address | ipaddress.IPv6Address],
) -> None:
    local = local_policy(action[0], field[0], nets)
    match = sec.Match(**{field[1]: [sec.Address(address=ip.packed, length=n) for ip, n in nets]})  # type: ignore[arg-type]
    xds = authorization_from_xds(sec.Authorization.FromString(policy(action[1], match).SerializeToString()))
    assert xds == local
    networks = [ipaddress.ip_network((ip, n), strict=False) for ip, n in nets]
    for src in srcs:
        conn = Connection(src, 1, DST, 80)
        # Upstream's rule as an oracle: same family and inside (sources are canonical, so never mapped).
        inside = any(net.version == src.version and src in net for net in networks)
        holds = inside if field[1] == "source_ips" else not inside
        expect_allowed = holds if action[1] == sec.ALLOW else not holds
        assert evaluate([xds], conn).allowed is expect_allowed
        assert evaluate([local], conn).allowed is expect_allowed

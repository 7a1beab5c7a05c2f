# mypy: disable-error-code="import-untyped"
"""Pin istio.security (authorization) and istio.v1.auth (CA) field numbers against hand-encoded bytes."""

from __future__ import annotations

import pytest
from google.protobuf import empty_pb2, struct_pb2

from tests.xds.wire import assert_wire, ld, packed, vint
from xds.istio.security import authorization_pb2 as sec
from xds.istio.v1.auth import ca_pb2
from xds.istio.workload import workload_pb2

IP4 = bytes([192, 168, 0, 0])
IP6 = bytes.fromhex("fd000000000000000000000000000000")


def test_authorization_top_level_fields() -> None:
    msg = sec.Authorization(
        name="deny-x",
        namespace="ns1",
        scope=sec.WORKLOAD_SELECTOR,
        action=sec.DENY,
        rules=[sec.Rule(clauses=[sec.Clause(matches=[sec.Match(destination_ports=[80])])])],
        dry_run=True,
        extensions=[workload_pb2.Extension(name="e")],
    )
    match = packed(9, [80])
    expected = (
        ld(1, "deny-x")
        + ld(2, "ns1")
        + vint(3, 2)  # WORKLOAD_SELECTOR
        + vint(4, 1)  # DENY
        + ld(5, ld(1, ld(2, match)))  # rules=5 -> clauses=1 -> matches=2
        + vint(6, 1)
        + ld(7, ld(1, "e"))
    )
    assert_wire(msg, expected)


def test_defaults_are_global_allow() -> None:
    msg = sec.Authorization.FromString(ld(1, "p"))
    assert msg.scope == sec.GLOBAL == 0
    assert msg.action == sec.ALLOW == 0


def test_string_match_oneof() -> None:
    assert_wire(sec.StringMatch(exact="a"), ld(1, "a"))
    assert_wire(sec.StringMatch(prefix="b"), ld(2, "b"))
    assert_wire(sec.StringMatch(suffix="c"), ld(3, "c"))
    presence = sec.StringMatch(presence=empty_pb2.Empty())
    assert_wire(presence, ld(4, b""))
    assert presence.WhichOneof("match_type") == "presence"


def test_match_fields() -> None:
    msg = sec.Match(
        namespaces=[sec.StringMatch(exact="ns1")],
        not_namespaces=[sec.StringMatch(prefix="kube-")],
        principals=[sec.StringMatch(suffix="/sa/admin")],
        not_principals=[sec.StringMatch(presence=empty_pb2.Empty())],
        source_ips=[sec.Address(address=IP4, length=16)],
        not_source_ips=[sec.Address(address=IP6, length=8)],
        destination_ips=[sec.Address(address=bytes([10, 0, 0, 1]), length=32)],
        not_destination_ips=[sec.Address(address=bytes([10, 0, 0, 2]), length=0)],
        destination_ports=[80, 443],
        not_destination_ports=[15000],
        service_accounts=[sec.ServiceAccountMatch(namespace="ns1", serviceAccount="sa1")],
        not_service_accounts=[sec.ServiceAccountMatch(namespace="ns2", serviceAccount="sa2")],
        extensions=[workload_pb2.Extension(name="m")],
    )
    expected = (
        ld(1, ld(1, "ns1"))
        + ld(2, ld(2, "kube-"))
        + ld(3, ld(3, "/sa/admin"))
        + ld(4, ld(4, b""))
        + ld(5, ld(1, IP4) + vint(2, 16))
        + ld(6, ld(1, IP6) + vint(2, 8))
        + ld(7, ld(1, bytes([10, 0, 0, 1])) + vint(2, 32))
        + ld(8, ld(1, bytes([10, 0, 0, 2])))  # length is plain proto3 uint32: 0 is not encoded
        + packed(9, [80, 443])
        + packed(10, [15000])
        + ld(11, ld(1, "ns1") + ld(2, "sa1"))
        + ld(12, ld(1, "ns2") + ld(2, "sa2"))
        + ld(13, ld(1, "m"))
    )
    assert_wire(msg, expected)


def test_uint32_match_fields() -> None:
    assert_wire(sec.Address(length=0xFFFFFFFF), vint(2, 0xFFFFFFFF))
    assert_wire(sec.Match(destination_ports=[0xFFFFFFFF]), packed(9, [0xFFFFFFFF]))
    with pytest.raises(ValueError, match="out of range"):
        sec.Address(length=1 << 32)
    with pytest.raises(ValueError, match="out of range"):
        sec.Match(not_destination_ports=[-1])


def test_unpacked_ports_are_accepted() -> None:
    """Parsers must accept repeated scalars both packed and unpacked (istiod's Go encoder packs)."""
    msg = sec.Match.FromString(vint(9, 80) + vint(9, 443))
    assert list(msg.destination_ports) == [80, 443]


def test_istio_certificate_request() -> None:
    metadata = struct_pb2.Struct()
    metadata["ImpersonatedIdentity"] = "spiffe://cluster.local/ns/default/sa/app"
    msg = ca_pb2.IstioCertificateRequest(csr="-----BEGIN CERTIFICATE REQUEST-----\n", validity_duration=86400)
    msg.metadata.CopyFrom(metadata)
    # Struct{fields = 1: map<string, Value>}; Value{string_value = 3}
    entry = ld(1, "ImpersonatedIdentity") + ld(2, ld(3, "spiffe://cluster.local/ns/default/sa/app"))
    expected = (
        ld(1, "-----BEGIN CERTIFICATE REQUEST-----\n")
        + vint(3, 86400)  # validity_duration is field 3 (there is no field 2)
        + ld(4, ld(1, entry))
    )
    assert_wire(msg, expected)
    assert 2 not in ca_pb2.IstioCertificateRequest.DESCRIPTOR.fields_by_number


def test_validity_duration_is_int64() -> None:
    big = 1 << 40
    assert_wire(ca_pb2.IstioCertificateRequest(validity_duration=big), vint(3, big))
    assert_wire(ca_pb2.IstioCertificateRequest(validity_duration=-1), vint(3, -1))


def test_istio_certificate_response() -> None:
    msg = ca_pb2.IstioCertificateResponse(cert_chain=["LEAF", "INTERMEDIATE", "ROOT1ROOT2"])
    assert_wire(msg, ld(1, "LEAF") + ld(1, "INTERMEDIATE") + ld(1, "ROOT1ROOT2"))

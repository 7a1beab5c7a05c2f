from __future__ import annotations

import ipaddress

import pytest

from ztunnel.identity import Identity
from ztunnel.rbac import (
    Action,
    Authorization,
    Connection,
    Match,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
    parse_cidr,
)

ALICE = Identity("cluster.local", "ns-a", "alice")


def conn(src: str = "10.0.0.1", dst: str = "10.0.0.2", port: int = 80, identity: Identity | None = ALICE) -> Connection:
    return Connection(ipaddress.ip_address(src), 40000, ipaddress.ip_address(dst), port, identity)


def policy(*rules: tuple[tuple[Match, ...], ...]) -> Authorization:
    return Authorization("p", "ns", Scope.NAMESPACE, Action.ALLOW, rules=rules)


def one(m: Match) -> Authorization:
    return policy(((m,),))


def test_empty_rules_never_match() -> None:
    assert not policy().matches(conn())


def test_empty_clause_is_true_and_empty_match_is_skipped() -> None:
    assert policy(((),)).matches(conn())  # a rule with one empty clause
    assert not one(Match()).matches(conn())  # an all-empty match never matches
    assert policy(((Match(), Match(destination_ports=(80,))),)).matches(conn())


def test_nesting_or_and_or() -> None:
    port80 = Match(destination_ports=(80,))
    port81 = Match(destination_ports=(81,))
    from_a = Match(namespaces=(StringMatch(StringMatchKind.EXACT, "ns-a"),))
    assert policy(((port81,), (port80,))).matches(conn()) is False  # clauses AND: 81 fails
    assert policy(((port81, port80), (from_a,))).matches(conn())  # matches in a clause OR
    assert policy(((port81,),), ((port80,),)).matches(conn())  # rules OR


@pytest.mark.parametrize(
    ("m", "expected"),
    [
        (Match(namespaces=(StringMatch(StringMatchKind.EXACT, "ns-a"),)), True),
        (Match(namespaces=(StringMatch(StringMatchKind.PREFIX, "ns-"),)), True),
        (Match(namespaces=(StringMatch(StringMatchKind.SUFFIX, "-b"),)), False),
        (Match(not_namespaces=(StringMatch(StringMatchKind.EXACT, "ns-a"),)), False),
        (Match(not_namespaces=(StringMatch(StringMatchKind.EXACT, "ns-b"),)), True),
        (Match(principals=(StringMatch(StringMatchKind.EXACT, "cluster.local/ns/ns-a/sa/alice"),)), True),
        (Match(principals=(StringMatch(StringMatchKind.EXACT, "spiffe://cluster.local/ns/ns-a/sa/alice"),)), False),
        (Match(principals=(StringMatch(StringMatchKind.PRESENCE),)), True),
        (Match(not_principals=(StringMatch(StringMatchKind.PRESENCE),)), False),
        (Match(service_accounts=(ServiceAccountMatch("ns-a", "alice"),)), True),
        (Match(not_service_accounts=(ServiceAccountMatch("ns-a", "alice"),)), False),
        (Match(source_ips=(parse_cidr("10.0.0.0/24"),)), True),
        (Match(not_source_ips=(parse_cidr("10.0.0.0/24"),)), False),
        (Match(destination_ips=(parse_cidr("10.0.0.2"),)), True),
        (Match(not_destination_ips=(parse_cidr("10.0.0.0/8"),)), False),
        (Match(destination_ports=(80, 443)), True),
        (Match(not_destination_ports=(80,)), False),
        (Match(source_ips=(parse_cidr("fd00::/8"),)), False),
    ],
)
def test_match_fields(m: Match, expected: bool) -> None:
    assert one(m).matches(conn()) is expected


def test_no_identity() -> None:
    plaintext = conn(identity=None)
    assert not one(Match(principals=(StringMatch(StringMatchKind.PRESENCE),))).matches(plaintext)
    assert one(Match(not_principals=(StringMatch(StringMatchKind.PRESENCE),))).matches(plaintext)
    assert not one(Match(service_accounts=(ServiceAccountMatch("ns-a", "alice"),))).matches(plaintext)
    assert one(Match(not_namespaces=(StringMatch(StringMatchKind.PRESENCE),))).matches(plaintext)


def test_ipv6_cidr() -> None:
    c = conn(src="fd00::5", dst="fd00::6")
    assert one(Match(source_ips=(parse_cidr("fd00::/64"),))).matches(c)
    assert not one(Match(destination_ips=(parse_cidr("fe80::/10"),))).matches(c)

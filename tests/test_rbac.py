from __future__ import annotations

import ipaddress
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ztunnel.identity import Identity
from ztunnel.rbac import (
    NOT_ALLOWED,
    Action,
    Authorization,
    CompiledRules,
    Connection,
    Match,
    Plan,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
    evaluate,
    parse_cidr,
)
from ztunnel.state import ProxyState, StateUpdate

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


# -- evaluation: scopes, DENY before ALLOW, dry-run ---------------------------------------------------------------


PORT80 = Match(destination_ports=(80,))
PORT81 = Match(destination_ports=(81,))


def pol(
    name: str, action: Action, *matches: Match, dry_run: bool = False, scope: Scope = Scope.NAMESPACE, ns: str = "ns"
) -> Authorization:
    rules = tuple(((m,),) for m in matches)
    return Authorization(name, ns, scope, action, rules=rules, dry_run=dry_run)


def test_no_policies_allows() -> None:
    assert evaluate([], conn()).allowed


def test_deny_before_allow_with_upstream_reasons() -> None:
    allow = pol("allow-80", Action.ALLOW, PORT80)
    deny = pol("deny-80", Action.DENY, PORT80)
    d = evaluate([allow, deny], conn())
    assert not d.allowed and d.reason == "explicitly denied by: ns/deny-80" and d.policy == "ns/deny-80"
    d = evaluate([pol("allow-81", Action.ALLOW, PORT81)], conn())
    assert not d.allowed and d.reason == NOT_ALLOWED == "allow policies exist, but none allowed"
    assert evaluate([pol("allow-81", Action.ALLOW, PORT81), allow], conn()).allowed
    assert evaluate([pol("deny-81", Action.DENY, PORT81)], conn()).allowed


def test_dry_run_never_enforced_but_logged(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.rbac")
    caplog.set_level(logging.DEBUG, logger="test.rbac")
    deny_dry = pol("deny-dry", Action.DENY, PORT80, dry_run=True)
    allow_dry = pol("allow-dry", Action.ALLOW, PORT81, dry_run=True)
    assert evaluate([deny_dry, allow_dry], conn(), log, logging.DEBUG).allowed
    messages = [r.getMessage() for r in caplog.records]
    assert "dry-run: deny policy match" in messages
    assert "dry-run: no allow policies match" in messages


def test_scopes_select_policies() -> None:
    state = ProxyState()
    state.apply(
        StateUpdate(
            policies=[
                pol("global-deny-81", Action.DENY, PORT81, scope=Scope.GLOBAL, ns="istio-system"),
                pol("ns-allow-80", Action.ALLOW, PORT80, ns="ns"),
                pol("other-ns-deny-80", Action.DENY, PORT80, ns="other"),
                pol("selected-deny-80", Action.DENY, PORT80, scope=Scope.WORKLOAD_SELECTOR, ns="ns"),
            ]
        )
    )
    plain = state.policies.for_workload("ns", ())
    assert {p.key for p in plain} == {"istio-system/global-deny-81", "ns/ns-allow-80"}
    assert evaluate(plain, conn()).allowed
    assert not evaluate(plain, conn(port=81)).allowed  # the global DENY applies everywhere
    selected = state.policies.for_workload("ns", ("ns/selected-deny-80", "ns/not-yet-known"))
    assert "ns/selected-deny-80" in {p.key for p in selected}
    assert not evaluate(selected, conn()).allowed
    assert evaluate(state.policies.for_workload("elsewhere", ()), conn()).allowed


def test_peer_authentication_strict_blocks_plaintext() -> None:
    strict = Authorization(
        "istio_converted_static_strict",
        "ns",
        Scope.NAMESPACE,
        Action.DENY,
        rules=(((Match(not_principals=(StringMatch(StringMatchKind.PRESENCE),)),),),),
    )
    assert not evaluate([strict], conn(identity=None)).allowed
    assert evaluate([strict], conn()).allowed


# Hypothesis: invariants of the decision procedure over random policies and connections.
_matches = st.builds(
    Match,
    destination_ports=st.lists(st.sampled_from([80, 81, 443]), max_size=2).map(tuple),
    not_destination_ports=st.lists(st.sampled_from([80, 81, 443]), max_size=1).map(tuple),
    namespaces=st.lists(
        st.sampled_from([StringMatch(StringMatchKind.EXACT, "ns-a"), StringMatch(StringMatchKind.PREFIX, "ns-b")]),
        max_size=1,
    ).map(tuple),
    principals=st.lists(
        st.sampled_from([StringMatch(StringMatchKind.PRESENCE), StringMatch(StringMatchKind.SUFFIX, "alice")]),
        max_size=1,
    ).map(tuple),
)
_rules = st.lists(st.lists(st.lists(_matches, max_size=2).map(tuple), max_size=2).map(tuple), max_size=2).map(tuple)
_policies = st.lists(
    st.builds(
        Authorization,
        name=st.sampled_from(["a", "b", "c", "d"]),
        namespace=st.just("ns"),
        scope=st.just(Scope.NAMESPACE),
        action=st.sampled_from(list(Action)),
        rules=_rules,
        dry_run=st.booleans(),
    ),
    max_size=4,
)
_conns = st.builds(
    conn,
    port=st.sampled_from([80, 81, 443]),
    identity=st.sampled_from([ALICE, Identity("cluster.local", "ns-b1", "bob"), None]),
)


@settings(max_examples=300, deadline=None)
@given(_policies, _conns, _rules)
def test_adding_deny_never_allows_more(policies: list[Authorization], c: Connection, rules: tuple[Any, ...]) -> None:
    before = evaluate(policies, c).allowed
    after = evaluate([*policies, Authorization("new", "ns", Scope.NAMESPACE, Action.DENY, rules)], c).allowed
    assert not (not before and after)


@settings(max_examples=300, deadline=None)
@given(_policies, _conns, _rules)
def test_adding_allow_to_a_set_with_allows_never_denies_more(
    policies: list[Authorization], c: Connection, rules: tuple[Any, ...]
) -> None:
    if not any(p.action is Action.ALLOW and not p.dry_run for p in policies):
        return
    before = evaluate(policies, c).allowed
    after = evaluate([*policies, Authorization("new", "ns", Scope.NAMESPACE, Action.ALLOW, rules)], c).allowed
    assert not (before and not after)


@settings(max_examples=300, deadline=None)
@given(_policies, _conns, _rules, st.sampled_from(list(Action)))
def test_dry_run_policy_never_changes_the_decision(
    policies: list[Authorization], c: Connection, rules: tuple[Any, ...], action: Action
) -> None:
    dry = Authorization("dry", "ns", Scope.NAMESPACE, action, rules, dry_run=True)
    assert evaluate([*policies, dry], c) == evaluate(policies, c)


def reference_evaluate(policies: list[Authorization], c: Connection) -> tuple[bool, str | None]:
    """Upstream's decision written directly over ``Authorization.matches`` (no compilation, grouping or index):
    allowed, and the first DENY policy (in policy order) that matched."""
    live = [p for p in policies if not p.dry_run]
    for p in live:
        if p.action is Action.DENY and p.matches(c):
            return False, p.key
    allows = [p for p in live if p.action is Action.ALLOW]
    return not allows or any(p.matches(c) for p in allows), None


_cidr_matches = st.builds(
    Match,
    source_ips=st.lists(
        st.sampled_from([parse_cidr("10.0.0.0/24"), parse_cidr("fd00::/8"), parse_cidr("10.0.0.1")]), max_size=2
    ).map(tuple),
    not_destination_ips=st.lists(st.sampled_from([parse_cidr("10.0.0.2"), parse_cidr("0.0.0.0/0")]), max_size=1).map(
        tuple
    ),
    service_accounts=st.lists(
        st.sampled_from([ServiceAccountMatch("ns-a", "alice"), ServiceAccountMatch("x", "y")]), max_size=1
    ).map(tuple),
    not_principals=st.lists(
        st.sampled_from(
            [StringMatch(StringMatchKind.PRESENCE), StringMatch(StringMatchKind.PREFIX, "cluster.local/ns/ns-b")]
        ),
        max_size=1,
    ).map(tuple),
)
_any_rules = st.lists(
    st.lists(st.lists(st.one_of(_matches, _cidr_matches), max_size=2).map(tuple), max_size=2).map(tuple), max_size=3
).map(tuple)
_any_policies = st.lists(
    st.builds(
        Authorization,
        name=st.sampled_from(["a", "b", "c"]),
        namespace=st.just("ns"),
        scope=st.just(Scope.NAMESPACE),
        action=st.sampled_from(list(Action)),
        rules=_any_rules,
        dry_run=st.booleans(),
    ),
    max_size=5,
)
_any_conns = st.builds(
    conn,
    src=st.sampled_from(["10.0.0.1", "10.0.0.9", "10.1.0.1"]),
    dst=st.sampled_from(["10.0.0.2", "10.0.0.3"]),
    port=st.sampled_from([80, 81, 443]),
    identity=st.sampled_from([ALICE, Identity("cluster.local", "ns-b1", "bob"), None]),
)


@settings(max_examples=500, deadline=None)
@given(_any_policies, _any_conns)
def test_compiled_plan_equals_the_reference_semantics(policies: list[Authorization], c: Connection) -> None:
    decision = evaluate(policies, c)
    assert (decision.allowed, decision.policy) == reference_evaluate(policies, c)


_ported_matches = st.builds(
    Match,
    destination_ports=st.lists(st.sampled_from([80, 81, 443]), max_size=2).map(tuple),
    not_destination_ports=st.lists(st.sampled_from([80, 443]), max_size=1).map(tuple),
    source_ips=st.lists(st.sampled_from([parse_cidr("10.0.0.0/24")]), max_size=1).map(tuple),
)
_ported_policies = st.lists(
    st.builds(
        Authorization,
        name=st.sampled_from(["a", "b", "c", "d", "e", "f"]),
        namespace=st.just("ns"),
        scope=st.just(Scope.NAMESPACE),
        action=st.sampled_from([Action.ALLOW, Action.DENY]),
        rules=st.lists(
            st.lists(st.lists(_ported_matches, max_size=3).map(tuple), max_size=3).map(tuple), max_size=3
        ).map(tuple),
    ),
    max_size=8,
)


@settings(max_examples=1000, deadline=None)
@given(_ported_policies, _any_conns)
def test_port_index_never_changes_the_decision_or_the_denying_policy(
    policies: list[Authorization], c: Connection
) -> None:
    # Rules mixing clauses with and without ports, several ports per clause and empty clauses: the index must
    # only skip what cannot match, and still name the first matching DENY in policy order.
    decision = evaluate(policies, c)
    assert (decision.allowed, decision.policy) == reference_evaluate(policies, c)


def test_port_index_skips_policies_for_other_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    policies = [
        Authorization(f"p{i}", "ns", Scope.NAMESPACE, Action.ALLOW, (((Match(destination_ports=(9000 + i,)),),),))
        for i in range(1000)
    ]
    policies.append(pol("deny-from-192.168", Action.DENY, Match(source_ips=(parse_cidr("192.168.0.0/16"),))))
    plan = Plan(policies)
    calls = 0
    real = CompiledRules.matches

    def counting(self: CompiledRules, s: Any) -> bool:
        nonlocal calls
        calls += 1
        return real(self, s)

    monkeypatch.setattr(CompiledRules, "matches", counting)
    assert plan.evaluate(conn(port=9500)).allowed
    assert calls == 2  # the port-less DENY and the one ALLOW for 9500, not 1,000
    calls = 0
    assert not plan.evaluate(conn(port=80)).allowed
    assert calls == 1


def test_plan_is_cached_until_policies_change() -> None:
    state = ProxyState()
    state.apply(StateUpdate(policies=[pol("allow-80", Action.ALLOW, PORT80)]))
    plan = state.policies.plan("ns", ())
    assert state.policies.plan("ns", ()) is plan
    assert plan.evaluate(conn()).allowed and not plan.evaluate(conn(port=81)).allowed
    state.apply(StateUpdate(policies=[pol("deny-80", Action.DENY, PORT80)]))
    fresh = state.policies.plan("ns", ())
    assert fresh is not plan and not fresh.evaluate(conn()).allowed


# -- the match table, filled in: presence, prefix/suffix, the holding side of every negation, IPv6 negations ----------


def matches_both_ways(m: Match, c: Connection) -> bool:
    """The reference semantics (``Authorization.matches``) and the compiled plan must agree on every row: an ALLOW
    policy allows exactly the connections it matches."""
    reference = one(m).matches(c)
    assert evaluate([one(m)], c).allowed is reference
    return reference


BOB = Identity("cluster.local", "ns-a", "bob")
V6: dict[str, Any] = {"src": "fd00::5", "dst": "fd00::6"}


@pytest.mark.parametrize(
    ("m", "c", "expected"),
    [
        # namespaces: presence holds for any identity (its namespace is never empty), never for plaintext
        (Match(namespaces=(StringMatch(StringMatchKind.PRESENCE),)), conn(), True),
        (Match(namespaces=(StringMatch(StringMatchKind.PRESENCE),)), conn(identity=None), False),
        (Match(not_namespaces=(StringMatch(StringMatchKind.PRESENCE),)), conn(), False),
        (Match(namespaces=(StringMatch(StringMatchKind.SUFFIX, "-a"),)), conn(), True),
        # principals: matched without "spiffe://", by prefix and suffix too
        (Match(principals=(StringMatch(StringMatchKind.PREFIX, "cluster.local/ns/ns-a/"),)), conn(), True),
        (Match(principals=(StringMatch(StringMatchKind.PREFIX, "cluster.local/ns/ns-b/"),)), conn(), False),
        (Match(principals=(StringMatch(StringMatchKind.PREFIX, "spiffe://"),)), conn(), False),
        (Match(principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/alice"),)), conn(), True),
        (Match(principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/bob"),)), conn(), False),
        (Match(principals=(StringMatch(StringMatchKind.PREFIX, ""),)), conn(identity=None), False),
        (Match(principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/alice"),)), conn(identity=None), False),
        (Match(not_principals=(StringMatch(StringMatchKind.PREFIX, "cluster.local/ns/ns-b/"),)), conn(), True),
        (Match(not_principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/alice"),)), conn(), False),
        (Match(not_principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/alice"),)), conn(identity=None), True),
        # the holding (true) side of each negation: nothing in the list matches
        (Match(not_service_accounts=(ServiceAccountMatch("ns-a", "bob"),)), conn(), True),
        (Match(not_service_accounts=(ServiceAccountMatch("ns-b", "alice"),)), conn(), True),
        (Match(not_service_accounts=(ServiceAccountMatch("ns-a", "alice"),)), conn(identity=BOB), True),
        (Match(not_service_accounts=(ServiceAccountMatch("ns-a", "alice"),)), conn(identity=None), True),
        (Match(not_source_ips=(parse_cidr("192.168.0.0/16"), parse_cidr("10.0.1.0/24"))), conn(), True),
        (Match(not_destination_ips=(parse_cidr("10.0.0.3"),)), conn(), True),
        (Match(not_destination_ports=(443, 8080)), conn(), True),
        # positive and negative lists of one kind together: in the first, in none of the second
        (Match(source_ips=(parse_cidr("10.0.0.0/8"),), not_source_ips=(parse_cidr("10.0.0.0/24"),)), conn(), False),
        (Match(source_ips=(parse_cidr("10.0.0.0/8"),), not_source_ips=(parse_cidr("10.0.1.0/24"),)), conn(), True),
        (Match(destination_ports=(80,), not_destination_ports=(80,)), conn(), False),
        # IPv6: negations hold when the address is outside, fail when inside
        (Match(not_source_ips=(parse_cidr("fd00::/64"),)), conn(**V6), False),
        (Match(not_source_ips=(parse_cidr("fe80::/10"),)), conn(**V6), True),
        (Match(not_destination_ips=(parse_cidr("fd00::6"),)), conn(**V6), False),
        (Match(not_destination_ips=(parse_cidr("fd00::7"),)), conn(**V6), True),
        (Match(destination_ips=(parse_cidr("fd00::/8"),)), conn(**V6), True),
        # a CIDR of the other family never contains the address: its negation holds
        (Match(not_source_ips=(parse_cidr("0.0.0.0/0"),)), conn(**V6), True),
        (Match(source_ips=(parse_cidr("0.0.0.0/0"),)), conn(**V6), False),
        (Match(not_destination_ips=(parse_cidr("::/0"),)), conn(), True),
        (Match(destination_ips=(parse_cidr("::/0"),)), conn(), False),
    ],
)
def test_match_table(m: Match, c: Connection, expected: bool) -> None:
    assert matches_both_ways(m, c) is expected


# -- policies that cannot apply are never evaluated ------------------------------------------------------------------


def test_inapplicable_policies_are_never_evaluated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the destination namespace's policies, the global ones and those the workload names are evaluated: each
    policy here has rules of its own (a distinct port), so a count of rule-set evaluations counts policies.
    Thousands of policies of other namespaces, and of selectors that pick other workloads, add nothing."""
    from ztunnel import rbac

    evaluated: list[rbac.CompiledRules] = []
    real = rbac.CompiledRules.matches

    def spy(self: rbac.CompiledRules, s: Any) -> bool:
        evaluated.append(self)
        return real(self, s)

    monkeypatch.setattr(rbac.CompiledRules, "matches", spy)
    reference_calls: list[Authorization] = []
    real_matches = Authorization.matches

    def reference_spy(p: Authorization, c: Connection) -> bool:
        reference_calls.append(p)
        return real_matches(p, c)

    monkeypatch.setattr(Authorization, "matches", reference_spy)

    applicable = [
        pol("ns-allow-80", Action.ALLOW, PORT80),
        # on the connection's port (so the port index does not skip them), but from sources it does not come from
        pol(
            "global-deny-81",
            Action.DENY,
            Match(destination_ports=(80,), source_ips=(parse_cidr("192.168.0.0/16"),)),
            scope=Scope.GLOBAL,
            ns="istio-system",
        ),
        pol(
            "selected-deny-82",
            Action.DENY,
            Match(destination_ports=(80,), source_ips=(parse_cidr("172.16.0.0/12"),)),
            scope=Scope.WORKLOAD_SELECTOR,
        ),
    ]
    others = [
        # every one of these would deny the connection, were it (wrongly) applied
        *(
            pol(f"deny-{i}", Action.DENY, Match(not_destination_ports=(10_000 + i,)), ns=f"other-{i}")
            for i in range(2000)
        ),
        *(
            pol(
                f"unselected-{i}",
                Action.DENY,
                Match(not_destination_ports=(20_000 + i,)),
                scope=Scope.WORKLOAD_SELECTOR,
            )
            for i in range(2000)
        ),
    ]

    def run(policies: list[Authorization]) -> tuple[bool, list[rbac.CompiledRules]]:
        state = ProxyState()
        state.apply(StateUpdate(policies=policies))
        evaluated.clear()
        allowed = state.policies.plan("ns", ("ns/selected-deny-82",)).evaluate(conn()).allowed
        return allowed, list(evaluated)

    alone = run(applicable)
    crowded = run(applicable + others)
    assert alone[0] is crowded[0] is True  # both DENYs looked at and passed, then the ALLOW matched
    assert len(crowded[1]) == len(alone[1]) == 3
    assert {id(r) for r in crowded[1]} == {id(rbac.compile_rules(p.rules)) for p in applicable}
    assert reference_calls == []  # the compiled plan never falls back to per-policy matching

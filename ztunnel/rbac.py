"""Istio L4 authorization policy: the model and its match semantics (upstream ``rbac.rs``).

A policy's ``rules`` are OR-ed; each rule's clauses are AND-ed; each clause's matches are OR-ed; inside one match
every field kind present is AND-ed and the values of one kind are OR-ed. Edge cases, all upstream's: a policy with
no rules never matches; an empty clause is true; a match with every field empty is skipped (never matches);
``not_*`` lists match when none of their entries match.

Pure: no I/O, no clock. Which policies apply to a connection, and DENY-before-ALLOW, live in ``state.policy``.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ztunnel.identity.spiffe import SPIFFE_PREFIX, Identity

T = TypeVar("T")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Scope(enum.Enum):
    GLOBAL = "Global"
    NAMESPACE = "Namespace"
    WORKLOAD_SELECTOR = "WorkloadSelector"


class Action(enum.Enum):
    ALLOW = "Allow"
    DENY = "Deny"


class StringMatchKind(enum.Enum):
    EXACT = "Exact"
    PREFIX = "Prefix"
    SUFFIX = "Suffix"
    PRESENCE = "Presence"


@dataclass(frozen=True, slots=True)
class StringMatch:
    kind: StringMatchKind
    value: str = ""

    def matches(self, check: str) -> bool:
        if self.kind is StringMatchKind.EXACT:
            return check == self.value
        if self.kind is StringMatchKind.PREFIX:
            return check.startswith(self.value)
        if self.kind is StringMatchKind.SUFFIX:
            return check.endswith(self.value)
        return check != ""

    def matches_principal(self, principal: str) -> bool:
        # Istio principals are written without "spiffe://" (a prefix match "*foo" means "spiffe://*foo"), so the
        # prefix is stripped first, and an identity without it never matches.
        if not principal.startswith(SPIFFE_PREFIX):
            return False
        return self.matches(principal[len(SPIFFE_PREFIX) :])

    def __str__(self) -> str:
        return self.kind.value if self.kind is StringMatchKind.PRESENCE else f"{self.kind.value}({self.value})"


@dataclass(frozen=True, slots=True)
class ServiceAccountMatch:
    namespace: str
    service_account: str

    def matches(self, identity: Identity | None) -> bool:
        return (
            identity is not None
            and identity.namespace == self.namespace
            and identity.service_account == self.service_account
        )


@dataclass(frozen=True, slots=True)
class Match:
    """One match: every non-empty field must hold. Field names are upstream's (camelCase in YAML)."""

    namespaces: tuple[StringMatch, ...] = ()
    not_namespaces: tuple[StringMatch, ...] = ()
    service_accounts: tuple[ServiceAccountMatch, ...] = ()
    not_service_accounts: tuple[ServiceAccountMatch, ...] = ()
    principals: tuple[StringMatch, ...] = ()
    not_principals: tuple[StringMatch, ...] = ()
    source_ips: tuple[IPNetwork, ...] = ()
    not_source_ips: tuple[IPNetwork, ...] = ()
    destination_ips: tuple[IPNetwork, ...] = ()
    not_destination_ips: tuple[IPNetwork, ...] = ()
    destination_ports: tuple[int, ...] = ()
    not_destination_ports: tuple[int, ...] = ()

    def is_empty(self) -> bool:
        return not (
            self.namespaces
            or self.not_namespaces
            or self.service_accounts
            or self.not_service_accounts
            or self.principals
            or self.not_principals
            or self.source_ips
            or self.not_source_ips
            or self.destination_ips
            or self.not_destination_ips
            or self.destination_ports
            or self.not_destination_ports
        )


@dataclass(frozen=True, slots=True)
class Connection:
    """What policy sees of a connection: addresses, the verified peer identity (None for plaintext), network."""

    src_ip: IPAddress
    src_port: int
    dst_ip: IPAddress
    dst_port: int
    src_identity: Identity | None = None
    dst_network: str = ""

    def __str__(self) -> str:
        return f"{_addr(self.src_ip, self.src_port)}({self.src_identity})->{_addr(self.dst_ip, self.dst_port)}"


def _addr(ip: IPAddress, port: int) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _either(positive: Sequence[T], negative: Sequence[T], predicate: Callable[[T], bool]) -> bool:
    if positive and not any(predicate(p) for p in positive):
        return False
    return not (negative and any(predicate(n) for n in negative))


@dataclass(frozen=True, slots=True)
class Authorization:
    """An AuthorizationPolicy as istiod sends it to ztunnel. ``key`` is ``namespace/name``."""

    name: str
    namespace: str
    scope: Scope
    action: Action
    rules: tuple[tuple[tuple[Match, ...], ...], ...] = ()
    dry_run: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def matches(self, conn: Connection) -> bool:
        if not self.rules:
            return False
        identity = conn.src_identity
        principal = str(identity) if identity is not None else ""
        namespace = identity.namespace if identity is not None else ""
        for rule in self.rules:
            if all(self._clause_matches(clause, conn, identity, principal, namespace) for clause in rule):
                return True
        return False

    @staticmethod
    def _clause_matches(
        clause: tuple[Match, ...], conn: Connection, identity: Identity | None, principal: str, namespace: str
    ) -> bool:
        if not clause:
            return True
        for m in clause:
            if m.is_empty():
                continue
            if (
                _either(m.destination_ips, m.not_destination_ips, lambda n: conn.dst_ip in n)
                and _either(m.source_ips, m.not_source_ips, lambda n: conn.src_ip in n)
                and _either(m.destination_ports, m.not_destination_ports, lambda p: p == conn.dst_port)
                and _either(m.service_accounts, m.not_service_accounts, lambda s: s.matches(identity))
                and _either(m.principals, m.not_principals, lambda s: s.matches_principal(principal))
                and _either(m.namespaces, m.not_namespaces, lambda s: s.matches(namespace))
            ):
                return True
        return False


def parse_cidr(text: str) -> IPNetwork:
    """A CIDR (``10.0.0.0/8``, ``fd00::/8``) or a bare IP (a /32 or /128). Host bits are masked off."""
    return ipaddress.ip_network(text.strip(), strict=False)


NOT_ALLOWED = "allow policies exist, but none allowed"


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of evaluating a connection. ``reason`` is upstream's wording for a denial."""

    allowed: bool
    reason: str = ""
    policy: str | None = None  # the DENY policy that matched


ALLOWED = Decision(True)


def evaluate(
    policies: Iterable[Authorization], conn: Connection, log: logging.Logger | None = None, log_level: int = 0
) -> Decision:
    """Istio semantics (upstream ``state.rs::assert_rbac``): any matching DENY denies; no ALLOW policies allows;
    a matching ALLOW allows; otherwise deny. Dry-run policies are evaluated and logged, never enforced."""
    allow: list[Authorization] = []
    allow_dry: list[Authorization] = []
    deny: list[Authorization] = []
    deny_dry: list[Authorization] = []
    for p in policies:
        if p.action is Action.ALLOW:
            (allow_dry if p.dry_run else allow).append(p)
        else:
            (deny_dry if p.dry_run else deny).append(p)
    say = _logger(log, log_level, conn)
    if say is not None:
        for p in deny_dry:
            if p.matches(conn):
                say("dry-run: deny policy match", p)
        if allow_dry:
            matched = [p for p in allow_dry if p.matches(conn)]
            for p in matched:
                say("dry-run: allow policy match", p)
            if not allow and not matched:
                # Allowed now, but would be denied if the dry-run ALLOW policies were enforced.
                say("dry-run: no allow policies match", None)
    for p in deny:
        if p.matches(conn):
            if say is not None:
                say("deny policy match", p)
            return Decision(False, f"explicitly denied by: {p.key}", p.key)
    if not allow:
        return ALLOWED
    for p in allow:
        if p.matches(conn):
            if say is not None:
                say("allow policy match", p)
            return ALLOWED
    if say is not None:
        say("no allow policies matched", None)
    return Decision(False, NOT_ALLOWED)


def _logger(
    log: logging.Logger | None, level: int, conn: Connection
) -> Callable[[str, Authorization | None], None] | None:
    """A policy-decision logger, or None when the level is off (then evaluation pays nothing for logs)."""
    if log is None or not log.isEnabledFor(level):
        return None

    def say(message: str, policy: Authorization | None) -> None:
        fields = {"conn": str(conn)} if policy is None else {"policy": policy.key, "conn": str(conn)}
        log.log(level, message, extra={"fields": fields})

    return say

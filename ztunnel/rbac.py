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
from collections.abc import Callable, Sequence
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

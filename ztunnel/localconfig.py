"""The local configuration file (``LOCAL_XDS_PATH`` / ``LOCAL_XDS``): upstream's YAML schema, validated strictly.

Shape (upstream ``xds.rs::LocalConfig``; camelCase keys)::

    workloads: [ {uid, name, namespace, serviceAccount, workloadIps, protocol, ..., services: {"ns/host": {80: 8080}}} ]
    services:  [ {name, namespace, hostname, vips: ["net/ip"], ports: {80: 8080}, subjectAltNames, ...} ]
    policies:  [ {name, namespace, scope, action, dryRun, rules: [[[ {notDestinationPorts: [9999]} ]]]} ]

Unknown keys are rejected (upstream uses ``deny_unknown_fields``). Every error names the file, the path inside it
(``workloads[2].workloadIps[0]``) and the problem, so an operator can fix the file without reading our code.

Parsing is pure: :func:`parse_local_config` takes the text; :func:`load_local_config` only adds reading the file.
"""

from __future__ import annotations

import enum
import ipaddress
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import yaml

from ztunnel.errors import ZtunnelError
from ztunnel.identity.spiffe import DEFAULT_TRUST_DOMAIN
from ztunnel.rbac import (
    Action,
    Authorization,
    Match,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
    parse_cidr,
)
from ztunnel.state import StateUpdate
from ztunnel.state.service import (
    Endpoint,
    IpFamily,
    LoadBalancer,
    LoadBalancerHealthPolicy,
    LoadBalancerMode,
    LoadBalancerScope,
    Service,
    Visibility,
    WeightedWaypoint,
)
from ztunnel.state.workload import (
    ApplicationTunnel,
    AppTunnelProtocol,
    GatewayAddress,
    HealthStatus,
    InboundProtocol,
    IPAddress,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkCidr,
    NetworkMode,
    Workload,
    canonical_ip,
)

E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T")


# YAML limits, as upstream's serde_yaml: nesting deeper than 128 levels, and a document whose aliases expand it more
# than 100-fold (a "billion laughs" file: 2 KB of nested aliases is 10^8 values once walked), are refused.
MAX_DEPTH = 128
MAX_EXPANSION = 100


class LocalConfigError(ZtunnelError, ValueError):
    """A malformed local config. ``str()`` reads ``<source>: <path>: <problem>``."""

    def __init__(self, source: str, path: str, problem: str) -> None:
        self.source = source
        self.path = path
        self.problem = problem
        super().__init__(f"{source}: {path}: {problem}" if path else f"{source}: {problem}")


@dataclass(frozen=True, slots=True)
class LocalConfig:
    """The parsed file: the state batch it describes (also shown as the config dump's ``staticConfig``)."""

    update: StateUpdate


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses what serde_yaml refuses: duplicate keys, nesting beyond :data:`MAX_DEPTH`,
    and values its constructors cannot build (``!!bool maybe``, ``2020-13-45``, a 5,000-digit integer), each as a
    ``MarkedYAMLError`` with the line and column instead of a bare ``KeyError``/``ValueError``/``RecursionError``."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise yaml.composer.ComposerError(None, None, f"nesting deeper than {MAX_DEPTH} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except (ValueError, LookupError, TypeError, ArithmeticError) as e:  # whatever a conversion raises
            what = node.tag.rsplit(":", 1)[-1]
            if isinstance(node, yaml.ScalarNode):
                what += f" {_show(node.value)}"
            raise yaml.constructor.ConstructorError(None, None, f"cannot read {what}: {e}", node.start_mark) from None

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<: *base``: merged keys may be overridden
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue  # unhashable: the base class reports it with its mark
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {_show(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _tagged_string_match(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    """Upstream's YAML form of a string match: serde_yaml writes and reads an enum variant as a tag (``!Exact x``,
    ``!Prefix x``, ``!Suffix x``, ``!Presence``); read as the map form ``{Exact: x}`` that :func:`_string_match`
    takes (also accepted, as the form of the JSON config dump)."""
    if suffix not in ("Exact", "Prefix", "Suffix", "Presence"):
        raise yaml.constructor.ConstructorError(
            None, None, f"unknown tag !{suffix} (expected !Exact, !Prefix, !Suffix or !Presence)", node.start_mark
        )
    if not isinstance(node, yaml.ScalarNode):
        raise yaml.constructor.ConstructorError(None, None, f"!{suffix} takes a string", node.start_mark)
    value = loader.construct_scalar(node)
    return {suffix: value if suffix != "Presence" else None}


_Loader.add_multi_constructor("!", _tagged_string_match)


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes in the document with every alias expanded, counting stops just past ``limit`` (also ends cycles)."""
    count, stack = 0, [root]
    while stack and count <= limit:
        node = stack.pop()
        count += 1
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack += (k, v)
    return count


def _distinct_nodes(root: yaml.Node) -> int:
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack += (k, v)
    return len(seen)


def _load_yaml(text: str) -> Any:
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        limit = MAX_EXPANSION * _distinct_nodes(root)
        if _expanded_size(root, limit) > limit:
            raise yaml.composer.ComposerError(
                None, None, f"aliases expand the document more than {MAX_EXPANSION}-fold", root.start_mark
            )
        return loader.construct_document(root)
    finally:
        loader.dispose()


# Values quoted in error messages are cut short: a wrong-typed value may be an alias of a huge structure.
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlist = _repr.maxdict = _repr.maxset = _repr.maxtuple = 5
_repr.maxlevel = 3
_repr.maxlong = 40


def _show(value: Any) -> str:
    try:
        return _repr.repr(value)
    except ValueError:  # an integer too long for str() (hex input is not limited)
        return f"<{type(value).__name__} too large to show>"


class Reader:
    """Walks the YAML (or JSON) document; every accessor knows the path of the value it reads. Public with
    read_workload, read_service and read_policy so that ztunnel explain reads a config dump with the same rules."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, problem: str) -> LocalConfigError:
        return LocalConfigError(self.source, path, problem)

    def obj(self, node: Any, path: str, allowed: set[str], required: frozenset[str] = frozenset()) -> dict[str, Any]:
        if not isinstance(node, dict):
            raise self.fail(path, f"expected a mapping, got {_kind(node)}")
        for key in node:
            if not isinstance(key, str):
                raise self.fail(path, f"keys must be strings, got {_show(key)}")
            if key not in allowed:
                raise self.fail(
                    _join(path, key), f"unknown field {_show(key)}; expected one of: {', '.join(sorted(allowed))}"
                )
        for key in sorted(required):
            if node.get(key) is None:
                raise self.fail(_join(path, key), "missing required field")
        return node

    def seq(self, node: Any, path: str) -> list[Any]:
        if node is None:
            return []
        if not isinstance(node, list):
            raise self.fail(path, f"expected a list, got {_kind(node)}")
        return node

    def text(self, node: Any, path: str, default: str = "") -> str:
        if node is None:
            return default
        if not isinstance(node, str):
            raise self.fail(path, f"expected a string, got {_kind(node)} {_show(node)}")
        return node

    def flag(self, node: Any, path: str, default: bool = False) -> bool:
        if node is None:
            return default
        if not isinstance(node, bool):
            raise self.fail(path, f"expected true or false, got {_show(node)}")
        return node

    def integer(self, node: Any, path: str, *, minimum: int = 0, maximum: int = 2**32 - 1) -> int:
        # A quoted number is accepted (ASCII digits only: "²".isdigit() is true, and int() refuses it).
        if isinstance(node, str) and node.strip().isascii() and node.strip().isdigit() and len(node.strip()) <= 20:
            node = int(node)
        if not isinstance(node, int) or isinstance(node, bool) or not minimum <= node <= maximum:
            raise self.fail(path, f"expected an integer from {minimum} to {maximum}, got {_show(node)}")
        return node

    def port(self, node: Any, path: str) -> int:
        return self.integer(node, path, maximum=65535)

    def enum(self, node: Any, path: str, cls: type[E], default: E | None = None) -> E:
        if node is None and default is not None:
            return default
        for member in cls:
            if member.value == node:
                return member
        accepted = ", ".join(str(m.value) for m in cls)
        raise self.fail(path, f"unknown value {_show(node)}; expected one of: {accepted}")

    def ip(self, node: Any, path: str) -> IPAddress:
        text = self.text(node, path)
        try:
            return canonical_ip(ipaddress.ip_address(text))
        except ValueError:
            raise self.fail(path, f"{_show(text)} is not an IP address") from None

    def parsed(self, node: Any, path: str, parse: Callable[[str], T]) -> T:
        text = self.text(node, path)
        try:
            return parse(text)
        except ValueError as e:
            raise self.fail(path, str(e)) from None

    def port_map(self, node: Any, path: str) -> Mapping[int, int]:
        if node is None:
            return MappingProxyType({})
        if not isinstance(node, dict):
            raise self.fail(path, f"expected a mapping of port to port, got {_kind(node)}")
        out = {}
        for k, v in node.items():
            key = self.port(k, f"{path}[{_show(k)}]")
            out[key] = self.port(v, _join(path, str(key)))
        return MappingProxyType(out)


def _kind(node: Any) -> str:
    if node is None:
        return "nothing (null)"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer"}.get(
        type(node), type(node).__name__
    )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# -- workloads ---------------------------------------------------------------------------------------------------

_WORKLOAD_FIELDS = {
    "uid",
    "name",
    "namespace",
    "serviceAccount",
    "trustDomain",
    "workloadIps",
    "protocol",
    "networkMode",
    "node",
    "network",
    "waypoint",
    "networkGateway",
    "applicationTunnel",
    "authorizationPolicies",
    "status",
    "clusterId",
    "locality",
    "capacity",
    "workloadName",
    "workloadType",
    "canonicalName",
    "canonicalRevision",
    "hostname",
    "nativeTunnel",
    "services",
}


def _gateway(r: Reader, node: Any, path: str) -> GatewayAddress | None:
    if node is None:
        return None
    o = r.obj(node, path, {"destination", "hboneMtlsPort"}, frozenset({"destination"}))
    dest = o["destination"]
    dpath = _join(path, "destination")
    destination: NetworkAddress | NamespacedHostname
    if isinstance(dest, str):
        destination = r.parsed(dest, dpath, NetworkAddress.parse)
    else:
        d = r.obj(dest, dpath, {"namespace", "hostname"}, frozenset({"namespace", "hostname"}))
        destination = NamespacedHostname(
            r.text(d["namespace"], _join(dpath, "namespace")), r.text(d["hostname"], _join(dpath, "hostname"))
        )
    port = 15008 if o.get("hboneMtlsPort") is None else r.port(o["hboneMtlsPort"], _join(path, "hboneMtlsPort"))
    return GatewayAddress(destination, port)


def read_workload(r: Reader, node: Any, path: str, trust_domain: str) -> Workload:
    o = r.obj(node, path, _WORKLOAD_FIELDS, frozenset({"namespace", "workloadIps"}))
    p = partial(_join, path)
    ips = tuple(
        r.ip(ip, f"{p('workloadIps')}[{i}]") for i, ip in enumerate(r.seq(o.get("workloadIps"), p("workloadIps")))
    )
    services: dict[NamespacedHostname, Mapping[int, int]] = {}
    raw_services = o.get("services")
    if raw_services is not None:
        if not isinstance(raw_services, dict):
            raise r.fail(
                p("services"), f'expected a mapping of "namespace/hostname" to ports, got {_kind(raw_services)}'
            )
        for key, ports in raw_services.items():
            spath = f"{p('services')}[{_show(key)}]"
            services[r.parsed(key, spath, NamespacedHostname.parse)] = r.port_map(ports, spath)
    tunnel = None
    if o.get("applicationTunnel") is not None:
        t = r.obj(o["applicationTunnel"], p("applicationTunnel"), {"protocol", "port"}, frozenset({"protocol"}))
        tunnel = ApplicationTunnel(
            r.enum(t["protocol"], _join(p("applicationTunnel"), "protocol"), AppTunnelProtocol),
            None if t.get("port") in (None, 0) else r.port(t["port"], _join(p("applicationTunnel"), "port")),
        )
    locality = Locality()
    if o.get("locality") is not None:
        lo = r.obj(o["locality"], p("locality"), {"region", "zone", "subzone"})
        locality = Locality(
            r.text(lo.get("region"), _join(p("locality"), "region")),
            r.text(lo.get("zone"), _join(p("locality"), "zone")),
            r.text(lo.get("subzone"), _join(p("locality"), "subzone")),
        )
    policies = tuple(
        r.text(x, f"{p('authorizationPolicies')}[{i}]")
        for i, x in enumerate(r.seq(o.get("authorizationPolicies"), p("authorizationPolicies")))
    )
    return Workload(
        uid=r.text(o.get("uid"), p("uid")),
        name=r.text(o.get("name"), p("name")),
        namespace=r.text(o["namespace"], p("namespace")),
        workload_ips=ips,
        # As upstream's xDS conversion: an empty trust domain or service account means the defaults.
        trust_domain=r.text(o.get("trustDomain"), p("trustDomain")) or trust_domain,
        service_account=r.text(o.get("serviceAccount"), p("serviceAccount")) or "default",
        network=r.text(o.get("network"), p("network")),
        protocol=r.enum(o.get("protocol"), p("protocol"), InboundProtocol, InboundProtocol.TCP),
        network_mode=r.enum(o.get("networkMode"), p("networkMode"), NetworkMode, NetworkMode.STANDARD),
        waypoint=_gateway(r, o.get("waypoint"), p("waypoint")),
        network_gateway=_gateway(r, o.get("networkGateway"), p("networkGateway")),
        workload_name=r.text(o.get("workloadName"), p("workloadName")),
        workload_type=r.text(o.get("workloadType"), p("workloadType")),
        canonical_name=r.text(o.get("canonicalName"), p("canonicalName")),
        canonical_revision=r.text(o.get("canonicalRevision"), p("canonicalRevision")),
        hostname=r.text(o.get("hostname"), p("hostname")),
        node=r.text(o.get("node"), p("node")),
        native_tunnel=r.flag(o.get("nativeTunnel"), p("nativeTunnel")),
        application_tunnel=tunnel,
        authorization_policies=policies,
        status=r.enum(o.get("status"), p("status"), HealthStatus, HealthStatus.HEALTHY),
        cluster_id=r.text(o.get("clusterId"), p("clusterId")),
        locality=locality,
        services=MappingProxyType(services),
        capacity=1 if o.get("capacity") is None else r.integer(o["capacity"], p("capacity")),
    )


# -- services ----------------------------------------------------------------------------------------------------

_SERVICE_FIELDS = {
    "name",
    "namespace",
    "hostname",
    "vips",
    "cidrVips",
    "ports",
    "endpoints",
    "subjectAltNames",
    "waypoint",
    "weightedWaypoints",
    "loadBalancer",
    "ipFamilies",
    "canonical",
    "visibility",
}


def read_service(r: Reader, node: Any, path: str) -> Service:
    o = r.obj(node, path, _SERVICE_FIELDS, frozenset({"name", "namespace", "hostname"}))
    p = partial(_join, path)
    vips = tuple(
        r.parsed(v, f"{p('vips')}[{i}]", NetworkAddress.parse) for i, v in enumerate(r.seq(o.get("vips"), p("vips")))
    )
    cidrs = tuple(
        r.parsed(v, f"{p('cidrVips')}[{i}]", NetworkCidr.parse)
        for i, v in enumerate(r.seq(o.get("cidrVips"), p("cidrVips")))
    )
    sans = tuple(
        r.text(v, f"{p('subjectAltNames')}[{i}]")
        for i, v in enumerate(r.seq(o.get("subjectAltNames"), p("subjectAltNames")))
    )
    endpoints: dict[str, Endpoint] = {}
    if o.get("endpoints") is not None:
        if not isinstance(o["endpoints"], dict):
            raise r.fail(p("endpoints"), f"expected a mapping of workload uid to endpoint, got {_kind(o['endpoints'])}")
        for uid, ep in o["endpoints"].items():
            epath = f"{p('endpoints')}[{_show(uid)}]"
            e = r.obj(ep, epath, {"workloadUid", "port", "status"}, frozenset({"workloadUid"}))
            endpoints[r.text(uid, epath)] = Endpoint(
                workload_uid=r.text(e["workloadUid"], _join(epath, "workloadUid")),
                port=r.port_map(e.get("port"), _join(epath, "port")),
                status=r.enum(e.get("status"), _join(epath, "status"), HealthStatus, HealthStatus.HEALTHY),
            )
    weighted = []
    for i, ww in enumerate(r.seq(o.get("weightedWaypoints"), p("weightedWaypoints"))):
        wpath = f"{p('weightedWaypoints')}[{i}]"
        w = r.obj(ww, wpath, {"destination", "weight"}, frozenset({"destination", "weight"}))
        gw = _gateway(r, w["destination"], _join(wpath, "destination"))
        assert gw is not None
        weighted.append(WeightedWaypoint(gw, r.integer(w["weight"], _join(wpath, "weight"))))
    lb = None
    if o.get("loadBalancer") is not None:
        lpath = p("loadBalancer")
        lbo = r.obj(o["loadBalancer"], lpath, {"routingPreferences", "mode", "healthPolicy"})
        lb = LoadBalancer(
            routing_preferences=tuple(
                r.enum(x, f"{_join(lpath, 'routingPreferences')}[{i}]", LoadBalancerScope)
                for i, x in enumerate(r.seq(lbo.get("routingPreferences"), _join(lpath, "routingPreferences")))
            ),
            mode=r.enum(lbo.get("mode"), _join(lpath, "mode"), LoadBalancerMode, LoadBalancerMode.STANDARD),
            health_policy=r.enum(
                lbo.get("healthPolicy"),
                _join(lpath, "healthPolicy"),
                LoadBalancerHealthPolicy,
                LoadBalancerHealthPolicy.ONLY_HEALTHY,
            ),
        )
    return Service(
        name=r.text(o["name"], p("name")),
        namespace=r.text(o["namespace"], p("namespace")),
        hostname=r.text(o["hostname"], p("hostname")),
        vips=vips,
        cidr_vips=cidrs,
        ports=r.port_map(o.get("ports"), p("ports")),
        endpoints=endpoints,
        subject_alt_names=sans,
        waypoint=_gateway(r, o.get("waypoint"), p("waypoint")),
        weighted_waypoints=tuple(weighted),
        load_balancer=lb,
        ip_families=None if o.get("ipFamilies") is None else r.enum(o["ipFamilies"], p("ipFamilies"), IpFamily),
        canonical=r.flag(o.get("canonical"), p("canonical")),
        visibility=r.enum(o.get("visibility"), p("visibility"), Visibility, Visibility.PUBLIC),
    )


# -- policies ----------------------------------------------------------------------------------------------------

_MATCH_FIELDS = {
    "namespaces",
    "notNamespaces",
    "serviceAccounts",
    "notServiceAccounts",
    "principals",
    "notPrincipals",
    "sourceIps",
    "notSourceIps",
    "destinationIps",
    "notDestinationIps",
    "destinationPorts",
    "notDestinationPorts",
}


def _string_match(r: Reader, node: Any, path: str) -> StringMatch:
    # Upstream's YAML form is a tag (``!Exact x``, read by the loader as ``{Exact: x}``); the map form {Exact: "x"},
    # {Prefix: "x"}, {Suffix: "x"} and Presence (bare, or {Presence: ...}) is accepted too (the JSON dump's form).
    if node == "Presence":
        return StringMatch(StringMatchKind.PRESENCE)
    if isinstance(node, dict) and len(node) == 1:
        ((kind, value),) = node.items()
        if kind == "Presence":
            return StringMatch(StringMatchKind.PRESENCE)
        if kind in ("Exact", "Prefix", "Suffix"):
            return StringMatch(StringMatchKind(kind), r.text(value, _join(path, kind)))
    expected = "!Exact str, !Prefix str, !Suffix str, !Presence (or {Exact: str}, ...)"
    raise r.fail(path, f"expected one of {expected}, got {_show(node)}")


def _match(r: Reader, node: Any, path: str) -> Match:
    o = r.obj(node, path, _MATCH_FIELDS)

    def items(key: str) -> list[tuple[str, Any]]:
        kp = _join(path, key)
        return [(f"{kp}[{i}]", v) for i, v in enumerate(r.seq(o.get(key), kp))]

    def strings(key: str) -> tuple[StringMatch, ...]:
        return tuple(_string_match(r, v, ip) for ip, v in items(key))

    def accounts(key: str) -> tuple[ServiceAccountMatch, ...]:
        out = []
        for ip, v in items(key):
            sa = r.obj(v, ip, {"namespace", "serviceAccount"}, frozenset({"namespace", "serviceAccount"}))
            out.append(
                ServiceAccountMatch(r.text(sa["namespace"], _join(ip, "namespace")), r.text(sa["serviceAccount"], ip))
            )
        return tuple(out)

    def cidrs(key: str) -> tuple[Any, ...]:
        return tuple(r.parsed(v, ip, parse_cidr) for ip, v in items(key))

    def ports(key: str) -> tuple[int, ...]:
        return tuple(r.port(v, ip) for ip, v in items(key))

    return Match(
        namespaces=strings("namespaces"),
        not_namespaces=strings("notNamespaces"),
        service_accounts=accounts("serviceAccounts"),
        not_service_accounts=accounts("notServiceAccounts"),
        principals=strings("principals"),
        not_principals=strings("notPrincipals"),
        source_ips=cidrs("sourceIps"),
        not_source_ips=cidrs("notSourceIps"),
        destination_ips=cidrs("destinationIps"),
        not_destination_ips=cidrs("notDestinationIps"),
        destination_ports=ports("destinationPorts"),
        not_destination_ports=ports("notDestinationPorts"),
    )


def read_policy(r: Reader, node: Any, path: str) -> Authorization:
    o = r.obj(
        node,
        path,
        {"name", "namespace", "scope", "action", "rules", "dryRun"},
        frozenset({"name", "scope", "action"}),
    )
    rules = []
    rpath = _join(path, "rules")
    for i, rule in enumerate(r.seq(o.get("rules"), rpath)):
        clauses = []
        for j, clause in enumerate(r.seq(rule, f"{rpath}[{i}]")):
            cpath = f"{rpath}[{i}][{j}]"
            clauses.append(tuple(_match(r, m, f"{cpath}[{k}]") for k, m in enumerate(r.seq(clause, cpath))))
        rules.append(tuple(clauses))
    return Authorization(
        name=r.text(o["name"], _join(path, "name")),
        namespace=r.text(o.get("namespace"), _join(path, "namespace")),
        scope=r.enum(o["scope"], _join(path, "scope"), Scope),
        action=r.enum(o["action"], _join(path, "action"), Action),
        rules=tuple(rules),
        dry_run=r.flag(o.get("dryRun"), _join(path, "dryRun")),
    )


# -- document ----------------------------------------------------------------------------------------------------


def parse_local_config(text: str, source: str = "LOCAL_XDS", trust_domain: str = DEFAULT_TRUST_DOMAIN) -> LocalConfig:
    """Parse and validate a local config document; raise :class:`LocalConfigError` on the first problem."""
    r = Reader(source)
    try:
        doc = _load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise LocalConfigError(source, where, f"not valid YAML: {problem}") from None
    if doc is None:
        doc = {}
    top = r.obj(doc, "", {"workloads", "services", "policies"})
    workloads = [
        read_workload(r, w, f"workloads[{i}]", trust_domain)
        for i, w in enumerate(r.seq(top.get("workloads"), "workloads"))
    ]
    services = [read_service(r, s, f"services[{i}]") for i, s in enumerate(r.seq(top.get("services"), "services"))]
    policies = [read_policy(r, p, f"policies[{i}]") for i, p in enumerate(r.seq(top.get("policies"), "policies"))]
    _no_duplicates(r, "workloads", [w.uid for w in workloads], "uid")
    _no_duplicates(r, "services", [str(s.key) for s in services], "namespace/hostname")
    _no_duplicates(r, "policies", [p.key for p in policies], "namespace/name")
    update = StateUpdate(workloads=workloads, services=services, policies=policies, replace_all=True)
    return LocalConfig(update=update)


def _no_duplicates(r: Reader, section: str, keys: list[str], what: str) -> None:
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key in seen:
            raise r.fail(f"{section}[{i}]", f"duplicate {what} {key!r} (also {section}[{seen[key]}])")
        seen[key] = i


def load_local_config(path: str | Path, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> LocalConfig:
    """Read and parse ``LOCAL_XDS_PATH``; a missing or unreadable file is a :class:`LocalConfigError` too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise LocalConfigError(str(path), "", f"cannot read local config: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise LocalConfigError(str(path), "", f"not UTF-8 text: {e.reason} at byte {e.start}") from None
    return parse_local_config(text, str(path), trust_domain)

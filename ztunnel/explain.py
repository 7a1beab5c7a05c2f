"""``ztunnel explain``: why a connection goes where it goes, and whether the destination lets it in.

Reads a ztunnel's state from its admin ``/config_dump`` (``--admin URL``) or from a saved dump (``--config-dump
FILE``); upstream Rust ztunnel's dump has the same shape and works too. The state is loaded into the same
:class:`~ztunnel.state.ProxyState` the proxy uses, and both halves of the decision are made by the proxy's own code,
told to record each step:

* outbound, at the source's ztunnel: :func:`ztunnel.proxy.outbound.build_request` with a trace (service VIP, waypoint,
  endpoint candidates and the load-balancing pick, port mapping, HBONE or plain TCP or passthrough, the identities the
  server must present);
* inbound, at the destination's ztunnel: the policies :class:`~ztunnel.state.policy.PolicyStore` finds for the
  destination workload, evaluated by the same compiled :class:`~ztunnel.rbac.Plan` the proxy evaluates (its steps
  recorded), each policy's rules, clauses and matches traced by the same compiled matches
  (:meth:`~ztunnel.rbac.CompiledRules.trace`), then the verdict, the HTTP status and the response flag. A source
  outside the mesh is captured by no ztunnel: only a captured destination's plaintext inbound (15006) checks it.

The load-balancing pick is random, weighted by capacity, as the proxy's: explain shows every candidate's chance, and
the pick a generator seeded with ``--seed`` makes (the proxy's own generator picks independently per connection).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import random
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ztunnel.errors import ZtunnelError
from ztunnel.identity.spiffe import DEFAULT_TRUST_DOMAIN, SPIFFE_PREFIX

# The local config's own field readers (private there): a dump is read by the same code, not a second parser.
from ztunnel.localconfig import LocalConfigError, Reader, read_policy, read_service, read_workload
from ztunnel.net import format_addr
from ztunnel.proxy.common import HttpStatusError, ProxyError, ResponseFlag, guess_inbound_service, services_of
from ztunnel.proxy.inbound import InboundRejected, hostname_target, upstream_port
from ztunnel.proxy.outbound import OutboundProtocol, Request, build_request
from ztunnel.rbac import Action, Authorization, ClauseTrace, Connection, Match, ServiceAccountMatch, compile_rules
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.workload import InboundProtocol, IPAddress, NetworkAddress, Workload, canonical_ip

__all__ = ["Dump", "ExplainError", "explain", "fetch_dump", "load_dump", "main", "read_dump", "render_text"]

# The proxy's own ports, refused as a target (``attempted recursive call to ourselves``) when a dump does not say.
DEFAULT_ILLEGAL_PORTS = (15001, 15006, 15008)
ADMIN_TIMEOUT = 10.0  # seconds: a local admin port answers in milliseconds; a hung one should not hang the operator


class ExplainError(ZtunnelError):
    """Bad input (an unreadable dump, an unknown source or target): the message says what and where."""


# -- loading a config dump -----------------------------------------------------------------------------------------


class _DumpReader(Reader):
    """The local config's reader (same field names, same checks, errors naming the path), lenient about fields it
    does not know: a dump carries more than a local config (and a newer upstream may add fields)."""

    def obj(self, node: Any, path: str, allowed: set[str], required: frozenset[str] = frozenset()) -> dict[str, Any]:
        if isinstance(node, dict):
            node = {k: v for k, v in node.items() if k in allowed}
        return super().obj(node, path, allowed, required)


@dataclass(frozen=True, slots=True)
class Dump:
    """A ztunnel's state, as loaded from its config dump, and the settings explain needs from the dump's ``config``."""

    state: ProxyState
    network: str = ""
    illegal_ports: tuple[int, ...] = DEFAULT_ILLEGAL_PORTS
    source: str = ""  # where it came from (file or URL), for messages
    version: str = ""  # the dumping ztunnel's version string


def load_dump(doc: Any, source: str = "config dump") -> Dump:
    """Build a :class:`Dump` from a parsed ``/config_dump`` document (this project's or upstream's).

    Workloads, services (with their endpoints, as dumped) and policies are read with the local config's field
    readers; an :class:`ExplainError` names ``source`` and the path (``workloads[3].workloadIps[0]``)."""
    try:
        return _load(doc, source)
    except LocalConfigError as e:
        raise ExplainError(str(e)) from None


def _load(doc: Any, source: str) -> Dump:
    r = _DumpReader(source)
    top = r.obj(doc, "", {"workloads", "services", "policies", "config", "version"})
    workloads = []
    for i, raw in enumerate(r.seq(top.get("workloads"), "workloads")):
        # A workload's ``services`` is a list of keys in a dump (none in upstream's); endpoints come from services.
        w = {k: v for k, v in raw.items() if k != "services"} if isinstance(raw, dict) else raw
        workloads.append(read_workload(r, w, f"workloads[{i}]", DEFAULT_TRUST_DOMAIN))
    services = [read_service(r, s, f"services[{i}]") for i, s in enumerate(r.seq(top.get("services"), "services"))]
    policies = [read_policy(r, p, f"policies[{i}]") for i, p in enumerate(r.seq(top.get("policies"), "policies"))]
    state = ProxyState()
    state.apply(StateUpdate(workloads=workloads, services=services, policies=policies))
    config = top.get("config")
    network = ""
    illegal: tuple[int, ...] = DEFAULT_ILLEGAL_PORTS
    if isinstance(config, dict):
        network = r.text(config.get("network"), "config.network")
        if config.get("illegalPorts") is not None:
            ports = r.seq(config["illegalPorts"], "config.illegalPorts")
            illegal = tuple(r.port(p, f"config.illegalPorts[{i}]") for i, p in enumerate(ports))
    version = top.get("version")
    shown = ""
    if isinstance(version, dict):
        shown = " ".join(str(version[k]) for k in ("component", "version") if version.get(k))
    return Dump(state, network, illegal, source, shown)


def _parse_json(text: str, source: str) -> Dump:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ExplainError(f"{source}: not JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    return load_dump(doc, source)


def read_dump(path: str | Path) -> Dump:
    """A config dump saved to a file (``curl localhost:15000/config_dump > dump.json``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ExplainError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ExplainError(f"{path}: not UTF-8 text: {e.reason} at byte {e.start}") from None
    return _parse_json(text, str(path))


def fetch_dump(admin: str, timeout: float = ADMIN_TIMEOUT) -> Dump:
    """The config dump of a running ztunnel: ``admin`` is its admin address (``http://localhost:15000``, or
    ``host:port``)."""
    base = admin if "://" in admin else f"http://{admin}"
    url = base.rstrip("/") + "/config_dump"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        raise ExplainError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ExplainError(f"{url}: cannot fetch the config dump: {reason}") from None
    return _parse_json(text, url)


# -- resolving --from and --to -------------------------------------------------------------------------------------


def _ip(text: str) -> IPAddress | None:
    try:
        return canonical_ip(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return None


def find_source(dump: Dump, spec: str) -> tuple[Workload | None, IPAddress]:
    """The source workload of ``--from`` (an IP, or ``namespace/name``; None for an IP no workload has) and the IP
    its traffic leaves from."""
    state = dump.state
    ip = _ip(spec)
    if ip is not None:
        wl = state.workloads.find_address(NetworkAddress(dump.network, ip))
        if wl is None:  # host-network workloads are not indexed by IP
            wl = next((w for w in state.workloads if ip in w.workload_ips), None)
        return wl, ip
    namespace, sep, name = spec.partition("/")
    if not sep or not namespace or not name:
        raise ExplainError(f"--from {spec!r}: expected an IP address or namespace/name")
    found = [w for w in state.workloads if w.namespace == namespace and w.name == name]
    if not found:
        names = sorted(f"{w.namespace}/{w.name}" for w in state.workloads)
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        raise ExplainError(f"--from {spec}: no workload {spec} in {dump.source} (workloads: {shown or 'none'})")
    wl = found[0]
    if not wl.workload_ips:
        raise ExplainError(f"--from {spec}: workload {spec} has no address to send from")
    return wl, wl.workload_ips[0]


def parse_target(dump: Dump, spec: str, namespace: str, src_ip: IPAddress) -> tuple[IPAddress, int, str | None]:
    """(IP, port, the hostname it was given as) for ``--to``: ``ip:port``, ``[v6]:port`` or ``hostname:port``.

    A hostname is what the mesh's DNS proxy would answer: the VIP of the service with that hostname (the client's
    namespace first, of the source's IP family when it has one), else the address of a workload with that hostname.
    Nothing is looked up in real DNS."""
    host, sep, port_s = spec.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) <= 65535:
        raise ExplainError(f"--to {spec!r}: expected ip:port, [ipv6]:port or hostname:port")
    port = int(port_s)
    ip = _ip(host)
    if ip is not None:
        return ip, port, None
    svc = dump.state.find_service_by_hostname(host, namespace)
    if svc is not None:
        vips = [v.address for v in svc.vips if v.network == dump.network]
        if not vips:
            raise ExplainError(f"--to {spec}: service {svc.namespace}/{host} has no VIP on network {dump.network!r}")
        same = [v for v in vips if v.version == src_ip.version]
        return (same or vips)[0], port, host
    wl = next((w for w in dump.state.workloads if w.hostname == host and w.workload_ips), None)
    if wl is not None:
        return wl.workload_ips[0], port, host
    raise ExplainError(
        f"--to {spec}: no service or workload with hostname {host!r} in {dump.source} (explain does not use DNS: "
        "give the full service hostname, e.g. echo.default.svc.cluster.local, or an IP)"
    )


# -- the decision ----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Recorder:
    """The trace given to the proxy's routing code: each step in order, as JSON-ready dicts."""

    steps: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, step: str, message: str, /, **data: Any) -> None:
        self.steps.append({"step": step, "message": message, **data})


def _workload_json(w: Workload) -> dict[str, Any]:
    return {
        "name": f"{w.namespace}/{w.name}",
        "uid": w.uid,
        "ips": [str(ip) for ip in w.workload_ips],
        "identity": str(w.identity),
        "protocol": w.protocol.value,
        "node": w.node,
        "network": w.network,
    }


@dataclass(frozen=True, slots=True)
class _Route:
    """What the outbound half decided that the inbound half needs, as values: the report's strings (``next_hop``,
    ``authority``, ``service``) are for reading, never parsed back."""

    destination: Workload  # the workload the destination's ztunnel serves (behind the gateway for double HBONE)
    next_hop: IPAddress  # the address dialled: the destination's, a waypoint's, or the network gateway's
    port: int  # the CONNECT authority's port
    service_hostname: str | None  # the service the source named (its `forwarded` header's host), if any
    gateway: bool = False  # double HBONE: the authority is <service_hostname>:<port>, the source is the gateway


def _outbound(
    dump: Dump, source: Workload, src_ip: IPAddress, ip: IPAddress, port: int, seed: int
) -> tuple[dict[str, Any], _Route | None]:
    """The source's half: the report's ``outbound`` section, and for a connection that reaches a ztunnel (HBONE,
    double HBONE) the route its inbound half takes."""
    rec = _Recorder()
    out: dict[str, Any] = {"source": _workload_json(source), "target": format_addr(ip, port), "steps": rec.steps}
    if ip.is_loopback and port in dump.illegal_ports:
        e = ProxyError("attempted recursive call to ourselves")
        out |= {"result": "refused", "error": str(e), "response_flag": e.flag.value}
        return out, None
    try:
        req = build_request(dump.state, source, src_ip, (ip, port), dump.network, random.Random(seed), trace=rec)
    except ProxyError as e:
        out |= {"result": "refused", "error": str(e), "response_flag": e.flag.value}
        return out, None
    dst = req.actual_destination_workload
    waypoint = _waypoint_of(req, rec.steps)
    service = req.intended_destination_service
    if req.protocol is OutboundProtocol.DOUBLE_HBONE:
        assert req.final_workload is not None and service is not None
        gateway = _Route(req.final_workload, req.actual_destination[0], port, service.hostname, gateway=True)
        return out | _double_hbone(req, rec), gateway
    if req.protocol is OutboundProtocol.HBONE:
        result = "hbone"
    elif dst is None:
        result = "passthrough"
    else:
        result = "tcp"
    out |= {
        "result": result,
        "protocol": req.protocol.value,
        "next_hop": format_addr(*req.actual_destination),
        "authority": format_addr(*req.hbone_target) if req.hbone_target is not None else None,
        "destination_workload": _workload_json(dst) if dst is not None else None,
        "service": f"{service.namespace}/{service.hostname}" if service is not None else None,
        "waypoint": waypoint,
        # Only an HBONE peer is verified: plain TCP presents no certificate.
        "expected_identities": [str(i) for i in req.upstream_sans] if result == "hbone" else [],
        "resolve_hostname": req.resolve_hostname,
    }
    route: _Route | None = None
    if result == "hbone":
        assert dst is not None and req.hbone_target is not None
        hostname = service.hostname if service is not None else None
        route = _Route(dst, req.actual_destination[0], req.hbone_target[1], hostname)
    return out, route


def _double_hbone(req: Request, rec: _Recorder) -> dict[str, Any]:
    """The outbound half of a request to another network: double HBONE through that network's gateway."""
    gateway, final, service = req.actual_destination_workload, req.final_workload, req.intended_destination_service
    assert gateway is not None and final is not None
    rec(
        "network",
        f"{final.namespace}/{final.name} is on network {final.network!r}, the source on {req.source.network!r}: "
        f"double HBONE through network gateway {gateway.namespace}/{gateway.name} (outer mTLS to the gateway, "
        "inner mTLS to the destination inside it; the gateway sees only ciphertext)",
        gateway=f"{gateway.namespace}/{gateway.name}",
    )
    return {
        "result": "double-hbone",
        "protocol": req.protocol.value,
        "next_hop": format_addr(*req.actual_destination),
        "authority": req.authority,
        "gateway": _workload_json(gateway),
        "destination_workload": _workload_json(final),
        "service": f"{service.namespace}/{service.hostname}" if service is not None else None,
        "waypoint": None,
        "expected_identities": [str(i) for i in req.upstream_sans],
        "final_expected_identities": [str(i) for i in req.final_sans],
        "resolve_hostname": None,
    }


def _not_captured(source: Workload | None, src_ip: IPAddress, ip: IPAddress, port: int) -> dict[str, Any]:
    who = f"workload {source.namespace}/{source.name} (protocol TCP)" if source is not None else "no workload"
    return {
        "source": _workload_json(source) if source is not None else {"ips": [str(src_ip)]},
        "target": format_addr(ip, port),
        "steps": [
            {
                "step": "capture",
                "message": f"{src_ip} is {who}: not in the mesh, so no ztunnel captures its traffic; it goes out "
                "as plain TCP, and only a ztunnel at the destination may see it",
            }
        ],
        "result": "not-captured",
        "protocol": "TCP",
        "next_hop": format_addr(ip, port),
        "authority": None,
        "destination_workload": None,
        "service": None,
        "waypoint": None,
        "expected_identities": [],
        "resolve_hostname": None,
    }


def _waypoint_of(req: Request, steps: Sequence[Mapping[str, Any]]) -> str | None:
    """The waypoint the request goes to, if it does: the last waypoint step named one and the request is HBONE to it
    with the original destination as authority."""
    named = [s.get("waypoint") for s in steps if s["step"] == "waypoint" and s.get("waypoint")]
    dst = req.actual_destination_workload
    if not named or dst is None or req.protocol is not OutboundProtocol.HBONE:
        return None
    if req.hbone_target is not None and req.hbone_target[0] in dst.workload_ips:
        return None  # straight to the destination (a waypoint was named, but the traffic came from it)
    return f"{dst.namespace}/{dst.name} ({named[-1]})"


def _policy_json(
    p: Authorization, conn: Connection, matched_by_plan: set[str], first_deny: str | None
) -> dict[str, Any]:
    traced = compile_rules(p.rules).trace(conn) if p.rules else ()
    held = any(r.held for r in traced)
    rules = []
    for i, rule in enumerate(traced):
        rules.append(
            {
                "rule": i,
                "held": rule.held,
                "clauses": [_clause_json(p, i, j, c, conn) for j, c in enumerate(rule.clauses)],
            }
        )
    entry: dict[str, Any] = {
        "policy": p.key,
        "action": p.action.value,
        "scope": p.scope.value,
        "dry_run": p.dry_run,
        "matched": held,
        "rules": rules,
    }
    if not p.rules:
        entry["note"] = "no rules: never matches"
    if p.key in matched_by_plan:
        entry["decided"] = True
    if p.action is Action.DENY and not p.dry_run and held and first_deny is not None and p.key != first_deny:
        entry["note"] = f"matches too, but {first_deny} comes first"
    return entry


def _clause_json(p: Authorization, rule: int, index: int, c: ClauseTrace, conn: Connection) -> dict[str, Any]:
    clause = p.rules[rule][index]
    matches = []
    for i, failed in c.matches:
        m: dict[str, Any] = {"match": i, "held": failed is None}
        if failed == "empty":
            m["why"] = "a match with no fields: skipped"
        elif failed is not None:
            m["failed"] = failed
            m["why"] = f"{failed}: {_field_text(clause[i], failed, conn)}"
        matches.append(m)
    out: dict[str, Any] = {"clause": index, "held": c.held, "matches": matches}
    if c.empty:
        out["why"] = "an empty clause: always holds"
    elif not c.held:
        out["why"] = "no match in this clause holds"
    return out


_FIELDS = {
    "destinationIps": "destination_ips",
    "notDestinationIps": "not_destination_ips",
    "sourceIps": "source_ips",
    "notSourceIps": "not_source_ips",
    "destinationPorts": "destination_ports",
    "notDestinationPorts": "not_destination_ports",
    "serviceAccounts": "service_accounts",
    "notServiceAccounts": "not_service_accounts",
    "principals": "principals",
    "notPrincipals": "not_principals",
    "namespaces": "namespaces",
    "notNamespaces": "not_namespaces",
}


def _field_text(match: Match, name: str, conn: Connection) -> str:
    """``9999 is not one of [8080]``: the connection's value of field ``name`` and the match's values."""
    values = getattr(match, _FIELDS[name])
    shown = ", ".join(
        f"{v.namespace}/{v.service_account}" if isinstance(v, ServiceAccountMatch) else str(v) for v in values
    )
    ident = conn.src_identity
    base = name.removeprefix("not")
    base = base[0].lower() + base[1:]
    value: object = {
        "destinationIps": conn.dst_ip,
        "sourceIps": conn.src_ip,
        "destinationPorts": conn.dst_port,
        "serviceAccounts": f"{ident.namespace}/{ident.service_account}" if ident else "no identity",
        "principals": str(ident).removeprefix(SPIFFE_PREFIX) if ident else "no identity",
        "namespaces": ident.namespace if ident else "no identity",
    }[base]
    if name.startswith("not"):
        return f"{value} is one of [{shown}]"
    return f"{value} is not one of [{shown}]"


def _inbound(
    dump: Dump, source: Workload, src_ip: IPAddress, outbound: Mapping[str, Any], route: _Route | None
) -> dict[str, Any]:
    result = outbound.get("result")
    if result == "refused":
        return {
            "applies": False,
            "reason": "the source's ztunnel refuses the connection: nothing reaches a destination",
        }
    if route is None:
        what = "the original destination" if result == "passthrough" else "a workload outside the mesh"
        return {
            "applies": False,
            "reason": f"plain TCP to {what}: no ztunnel receives it, so no policy of a ztunnel applies",
        }
    local = route.destination
    # As the destination's ztunnel sees it: the IP dialled (the next hop; a waypoint's own address when the authority
    # names the service behind it), the port of the :authority.
    steps: list[str] = []
    port = route.port
    if route.gateway:
        # The gateway dials the destination's ztunnel with the inner CONNECT to <service hostname>:<port>: the source
        # is the gateway's address (not looked up, as x-forwarded-network names another network), the identity the
        # client's, the port the workload's target port for that service port.
        assert route.service_hostname is not None
        src_ip = route.next_hop
        dst_ip = local.workload_ips[0]
        try:
            svc, target_port = hostname_target(dump.state, route.service_hostname, port, local)
        except InboundRejected as e:
            return _inbound_refused(local, e)
        steps.append(f"through a network gateway: service port {port} is the workload's port {target_port}")
        port = target_port
    else:
        dst_ip = route.next_hop
    try:
        mapped = upstream_port(local, port, dump.illegal_ports)
    except InboundRejected as e:
        return _inbound_refused(local, e)
    if mapped != port:
        steps.append(f"application tunnel: the workload's port {mapped} instead of {port}")
        port = mapped
    conn = Connection(src_ip, 0, dst_ip, port, source.identity, dump.network)
    report = _authorize(dump, local, conn, steps, hbone=True)
    # destination_service as the destination's ztunnel reports it (upstream's guess_inbound_service): among the
    # services that select the workload, the one the source named in its `forwarded` header's host.
    forwarded_host = route.service_hostname
    # A dump lists no workload's services (upstream's has none): those whose endpoints include it select it.
    selecting = services_of(dump.state, local) or [s for s in dump.state.services if local.uid in s.endpoints]
    candidates = [svc] if route.gateway else selecting
    guessed = guess_inbound_service(candidates, forwarded_host, port, local)
    report["destination_service"] = guessed.hostname if guessed is not None else None
    return report


def _inbound_plaintext(dump: Dump, src_ip: IPAddress, ip: IPAddress, port: int) -> dict[str, Any]:
    """A connection from outside the mesh, to a captured pod: its ztunnel's plaintext inbound (15006) checks policy,
    without an identity, and closes the connection on a denial (no HTTP: nothing to answer)."""
    local = dump.state.workloads.find_address(NetworkAddress(dump.network, ip))
    if local is None or local.protocol is not InboundProtocol.HBONE:
        svc = dump.state.services.get_best_by_vip(NetworkAddress(dump.network, ip), None)
        if svc is not None:
            return {
                "applies": False,
                "reason": f"{ip} is the VIP of service {svc.namespace}/{svc.hostname}: outside the mesh the cluster's "
                "service proxy (kube-proxy) picks the endpoint, not a ztunnel; explain an endpoint's address instead",
                "verdict": "unknown",
            }
        return {"applies": False, "reason": "the destination is not in the mesh either: no ztunnel sees it"}
    if port in dump.illegal_ports:
        return {
            "applies": True,
            "local_workload": _workload_json(local),
            "listener": "inbound plaintext (15006)",
            "verdict": "refused",
            "reason": "attempted recursive call to ourselves",
            "status": None,
            "response_flag": ResponseFlag.NONE.value,
            "policies": [],
        }
    conn = Connection(src_ip, 0, ip, port, None, dump.network)
    return _authorize(dump, local, conn, [], hbone=False)


def _authorize(dump: Dump, local: Workload, conn: Connection, steps: list[str], hbone: bool) -> dict[str, Any]:
    """The policies of ``local`` for ``conn``: the proxy's plan decides, each policy's rules are traced."""
    policies = dump.state.policies.for_workload(local.namespace, local.authorization_policies)
    plan = dump.state.policies.plan(local.namespace, local.authorization_policies)
    said: list[tuple[str, str | None]] = []
    decision = plan.evaluate(conn, recorder=lambda message, p: said.append((message, p.key if p else None)))
    decided = {key for message, key in said if key is not None and not message.startswith("dry-run")}
    first_deny = next((key for message, key in said if message == "deny policy match"), None)
    # Evaluation order, as the plan's: dry-run DENY and ALLOW (reported, never enforced), then DENY, then ALLOW.
    order = [
        (Action.DENY, True),
        (Action.ALLOW, True),
        (Action.DENY, False),
        (Action.ALLOW, False),
    ]
    listed = [
        _policy_json(p, conn, decided, first_deny)
        for action, dry in order
        for p in policies
        if p.action is action and p.dry_run is dry
    ]
    if decision.allowed:
        if not [p for p in policies if p.action is Action.ALLOW and not p.dry_run]:
            why = "no DENY policy matches, and there is no ALLOW policy"
        else:
            why = f"no DENY policy matches, and ALLOW policy {sorted(decided)[0]} does" if decided else "allowed"
    else:
        why = decision.reason
    return {
        "applies": True,
        "local_workload": _workload_json(local),
        "listener": "inbound HBONE (15008)" if hbone else "inbound plaintext (15006)",
        "connection": {
            "source": str(conn.src_ip),
            "destination": format_addr(conn.dst_ip, conn.dst_port),
            "identity": str(conn.src_identity) if conn.src_identity is not None else None,
            "network": dump.network,
        },
        "steps": steps,
        "policies": listed,
        "evaluation": [{"message": m, "policy": k} for m, k in said],
        "dry_run": [
            f"{m.removeprefix('dry-run: ')}{f' ({k})' if k else ''}" for m, k in said if m.startswith("dry-run")
        ],
        "verdict": "allow" if decision.allowed else "deny",
        "reason": why,
        # Over HBONE the CONNECT is answered; a plaintext connection is simply closed on a denial.
        "status": (200 if decision.allowed else 401) if hbone else None,
        "response_flag": ResponseFlag.NONE.value if decision.allowed else ResponseFlag.DENY.value,
    }


def _inbound_refused(local: Workload, e: InboundRejected) -> dict[str, Any]:
    return {
        "applies": True,
        "local_workload": _workload_json(local),
        "listener": "inbound HBONE (15008)",
        "verdict": "refused",
        "reason": str(e),
        "status": e.status,
        "response_flag": e.flag.value,
        "policies": [],
    }


def explain(dump: Dump, source_spec: str, target_spec: str, seed: int = 0) -> dict[str, Any]:
    """Both halves of the decision for a connection from ``source_spec`` to ``target_spec``, as a JSON-ready dict.

    ``verdict`` sums it up: ``allow`` (it connects), ``deny`` (a policy at the destination refuses it: 401, response
    flag DENY) or ``refused`` (the source's ztunnel cannot route it)."""
    source, src_ip = find_source(dump, source_spec)
    ip, port, hostname = parse_target(dump, target_spec, source.namespace if source else "", src_ip)
    if source is None or source.protocol is not InboundProtocol.HBONE:
        out = _not_captured(source, src_ip, ip, port)
        inbound = _inbound_plaintext(dump, src_ip, ip, port)
    else:
        out, route = _outbound(dump, source, src_ip, ip, port, seed)
        inbound = _inbound(dump, source, src_ip, out, route)
    if hostname is not None:
        out["hostname"] = hostname
    if out["result"] == "refused":
        verdict = "refused"
    elif inbound.get("verdict") in ("deny", "refused", "unknown"):
        verdict = inbound["verdict"]
    else:
        verdict = "allow"
    report = {
        "from": source_spec,
        "to": target_spec,
        "dump": {"source": dump.source, "version": dump.version, "network": dump.network},
        "outbound": out,
        "inbound": inbound,
        "verdict": verdict,
    }
    if out["result"] == "refused":
        report["source_error"] = {"error": out["error"], "response_flag": out["response_flag"]}
    elif verdict in ("deny", "refused") and out["result"] != "not-captured":
        # What the source's ztunnel reports for a CONNECT the destination refused: only the status, as a failure.
        err = HttpStatusError(inbound["status"])
        report["source_error"] = {"error": str(err), "response_flag": err.flag.value}
    return report


# -- output ----------------------------------------------------------------------------------------------------------


def render_text(report: Mapping[str, Any]) -> str:
    """The report for people: each step on its own line, reasons after a colon."""
    lines: list[str] = []
    add = lines.append
    dump = report["dump"]
    add(f"explain {report['from']} -> {report['to']}   (state from {dump['source']}{_version(dump)})")
    out = report["outbound"]
    src = out["source"]
    add("")
    add("OUTBOUND (the source's ztunnel)")
    if "name" in src:
        add(f"  source workload   {src['name']} {','.join(src['ips'])} ({src['identity']}, node {src['node'] or '-'})")
    else:
        add(f"  source            {','.join(src['ips'])} (no workload)")
    target = out["target"] + (f" (hostname {out['hostname']})" if out.get("hostname") else "")
    add(f"  target            {target}")
    for step in out["steps"]:
        add(f"  {_step_label(step)}{step['message']}")
        if step["step"] == "pick" and step.get("chances"):
            for uid, chance in step["chances"].items():
                mark = "  <- picked (--seed)" if uid == step.get("picked") else ""
                add(f"  {'':18}{chance:6.1%}  {uid}{mark}")
    if out["result"] == "refused":
        add(f"  => refused: {out['error']}")
    else:
        how = {
            "hbone": "HBONE (mTLS)",
            "double-hbone": "double HBONE (mTLS inside mTLS)",
            "tcp": "plain TCP",
            "passthrough": "passthrough (plain TCP)",
            "not-captured": "not captured: plain TCP",
        }[out["result"]]
        add(f"  => {how} to {out['next_hop']}" + (f", :authority {out['authority']}" if out["authority"] else ""))
        if out["waypoint"]:
            add(f"     through waypoint {out['waypoint']}")
        if out["service"]:
            add(f"     service {out['service']}")
        if out.get("gateway"):
            gw = out["gateway"]
            add(f"     through network gateway {gw['name']}, to {out['destination_workload']['name']}")
        if out["expected_identities"]:
            add(f"     the server must present one of: {', '.join(out['expected_identities'])}")
        if out.get("final_expected_identities"):
            add(f"     the destination (inner TLS) must present one of: {', '.join(out['final_expected_identities'])}")
        if out.get("resolve_hostname"):
            add(f"     (the address is resolved first: {out['resolve_hostname']})")
    inbound = report["inbound"]
    add("")
    add("INBOUND (the destination's ztunnel)")
    if not inbound["applies"]:
        add(f"  not applicable: {inbound['reason']}")
    else:
        local = inbound["local_workload"]
        add(f"  local workload    {local['name']} {','.join(local['ips'])} ({local['identity']})")
        if inbound.get("destination_service"):
            add(f"  service           {inbound['destination_service']} (reported as destination_service)")
        add(f"  listener          {inbound['listener']}")
        conn = inbound.get("connection")
        if conn:
            who = conn["identity"] or "no identity (plaintext)"
            add(f"  connection        {who} from {conn['source']} to {conn['destination']}")
        for step in inbound.get("steps", ()):
            add(f"  {step}")
        if not inbound["policies"]:
            add("  policies          none apply")
        for p in inbound["policies"]:
            dry = " dry-run" if p["dry_run"] else ""
            state = "MATCHES" if p["matched"] else "no match"
            add(f"  policy {p['policy']} ({p['action']}{dry}, {p['scope']}): {state}" + _note(p))
            for rule in p["rules"]:
                add(f"    rule {rule['rule']}: {'holds' if rule['held'] else 'does not hold'}")
                for clause in rule["clauses"]:
                    extra = f" ({clause['why']})" if "why" in clause else ""
                    add(f"      clause {clause['clause']}: {'holds' if clause['held'] else 'fails'}{extra}")
                    for m in clause["matches"]:
                        add(f"        match {m['match']}: {'holds' if m['held'] else m['why']}")
        for d in inbound.get("dry_run", ()):
            add(f"  dry-run           {d}")
        answer = f"HTTP {inbound['status']}" if inbound["status"] is not None else "the connection is closed"
        if inbound["verdict"] == "allow" and inbound["status"] is None:
            answer = "passed to the app"
        add(f"  => {inbound['verdict']}: {inbound['reason']} ({answer}, response flag {inbound['response_flag']})")
    if "source_error" in report:
        src_err = report["source_error"]
        add("")
        add(f"The source's ztunnel logs: {src_err['error']} (response flag {src_err['response_flag']})")
    add("")
    add(f"VERDICT: {report['verdict']}")
    return "\n".join(lines) + "\n"


def _version(dump: Mapping[str, Any]) -> str:
    return f", {dump['version']}" if dump.get("version") else ""


def _note(p: Mapping[str, Any]) -> str:
    if p.get("decided"):
        return " <- decides"
    return f" ({p['note']})" if p.get("note") else ""


def _step_label(step: Mapping[str, Any]) -> str:
    label = step["step"]
    if label in ("candidate", "rank") and step.get("workload"):
        label = f"{label} {step['workload']}"
        return f"{label}\n{'':20}"
    return f"{label:<18}"


# -- the command -----------------------------------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    """``ztunnel explain --from SRC --to DST [--admin URL | --config-dump FILE] [-o text|json] [--seed N]``."""
    parser = argparse.ArgumentParser(
        prog="ztunnel explain",
        description="Explain how a connection is routed and whether policy allows it, from a ztunnel's state.",
    )
    parser.add_argument("--from", dest="source", required=True, help="source workload: its IP, or namespace/name")
    parser.add_argument("--to", dest="target", required=True, help="ip:port, [ipv6]:port or service-hostname:port")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--admin", default=None, help="a running ztunnel's admin address (default localhost:15000)")
    where.add_argument("--config-dump", default=None, help="a saved /config_dump JSON file")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    parser.add_argument("--seed", type=int, default=0, help="seed of the load-balancing pick shown (default 0)")
    args = parser.parse_args(list(argv))
    try:
        dump = read_dump(args.config_dump) if args.config_dump else fetch_dump(args.admin or "localhost:15000")
        report = explain(dump, args.source, args.target, args.seed)
    except ExplainError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    if args.output == "json":
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_text(report))
    return 0

"""The admin API on localhost:15000 (upstream ``admin.rs``).

* ``/config_dump``: workloads, services, policies, staged services, the static (local) config, the effective
  config, certificates (identity, state, chain and roots with serial and validity) and, in-pod, each pod's state,
  in upstream's JSON shape (camelCase), so ``istioctl ztunnel-config``-style tooling can read it;
* ``/logging``: POST ``?level=info`` / ``?level=access=debug,warn`` / ``?reset`` changes log levels at run time;
* ``/quitquitquit``: POST starts a graceful drain and answers at once (200 ``shutdown now``), as upstream;
* ``/connections`` (this project's addition): the open connections, live, as JSON;
* ``/debug/pprof/profile``, ``/debug/pprof/heap``, ``/debug/pprof/heap/profiling``: upstream's profiling endpoints,
  the Python analogue (:mod:`ztunnel.profiling`), of this process and of every data-plane worker (asked over the
  worker channel with a ``Profile`` message; each samples itself on a thread, so no event loop stops);
* ``/``: an index of the above.

Only reachable on localhost (upstream binds 127.0.0.1 and ::1).
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from ztunnel import __version__, profiling, telemetry
from ztunnel.config import Config, SocketAddress
from ztunnel.dns.forwarder import ResolvConf
from ztunnel.http import HttpServer
from ztunnel.identity.manager import CertificateState
from ztunnel.identity.spiffe import Identity
from ztunnel.localconfig import LocalConfig
from ztunnel.rbac import Authorization, Match, StringMatch, StringMatchKind
from ztunnel.state import ProxyState
from ztunnel.state.service import Endpoint, Service
from ztunnel.state.workload import GatewayAddress, NamespacedHostname, Workload

log = logging.getLogger("ztunnel.admin")
T = TypeVar("T")
# (kind, seconds, frequency, activate) -> each worker's ("worker-<i>", answer): the supervisor's ``profile``.
ProfileWorkers = Callable[[str, str, int, int, bool | None], Awaitable[list[tuple[str, Any]]]]

INDEX = """<!doctype html><html><head><title>ztunnel admin</title></head><body>
<h1>ztunnel admin</h1><ul>
<li><a href="/config_dump">/config_dump</a>: workloads, services, policies, certificates, config</li>
<li><a href="/connections">/connections</a>: open connections</li>
<li>/logging (POST): <code>?level=&lt;filter&gt;</code> or <code>?reset</code></li>
<li>/quitquitquit (POST): graceful shutdown</li>
<li><a href="/debug/pprof/profile?seconds=10">/debug/pprof/profile</a>: CPU profile of every process
(<code>?seconds=1-300&amp;frequency=1-1000&amp;process=all|control|worker-N</code>), folded stacks</li>
<li><a href="/debug/pprof/heap">/debug/pprof/heap</a>: live Python allocations by line (after
<code>/debug/pprof/heap/profiling?activate=true</code>)</li>
</ul></body></html>
"""


# -- JSON shapes (upstream's serde output, camelCase, defaults omitted) -----------------------------------------


def _gateway(gw: GatewayAddress | None) -> dict[str, Any] | None:
    if gw is None:
        return None
    dest = gw.destination
    destination: Any = (
        {"namespace": dest.namespace, "hostname": dest.hostname} if isinstance(dest, NamespacedHostname) else str(dest)
    )
    return {"destination": destination, "hboneMtlsPort": gw.hbone_mtls_port}


def workload_json(w: Workload) -> dict[str, Any]:
    out: dict[str, Any] = {
        "uid": w.uid,
        "workloadIps": [str(ip) for ip in w.workload_ips],
        "protocol": w.protocol.value,
        "networkMode": w.network_mode.value,
        "name": w.name,
        "namespace": w.namespace,
        "trustDomain": w.trust_domain,
        "serviceAccount": w.service_account,
        "network": w.network,
        "workloadName": w.workload_name,
        "workloadType": w.workload_type,
        "canonicalName": w.canonical_name,
        "canonicalRevision": w.canonical_revision,
        "hostname": w.hostname,
        "node": w.node,
        "status": w.status.value,
        "clusterId": w.cluster_id,
        "capacity": w.capacity,
    }
    if w.waypoint is not None:
        out["waypoint"] = _gateway(w.waypoint)
    if w.network_gateway is not None:
        out["networkGateway"] = _gateway(w.network_gateway)
    if w.native_tunnel:
        out["nativeTunnel"] = True
    if w.application_tunnel is not None:
        out["applicationTunnel"] = {"protocol": w.application_tunnel.protocol.value, "port": w.application_tunnel.port}
    if w.authorization_policies:
        out["authorizationPolicies"] = list(w.authorization_policies)
    if w.locality.region or w.locality.zone or w.locality.subzone:
        out["locality"] = {"region": w.locality.region, "zone": w.locality.zone, "subzone": w.locality.subzone}
    if w.services:
        out["services"] = [str(k) for k in w.services]
    return {k: v for k, v in out.items() if v != "" or k in ("name", "namespace", "uid")}


def _endpoint(ep: Endpoint) -> dict[str, Any]:
    return {"workloadUid": ep.workload_uid, "port": {str(k): v for k, v in ep.port.items()}, "status": ep.status.value}


def service_json(s: Service) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": s.name,
        "namespace": s.namespace,
        "hostname": s.hostname,
        "vips": [str(v) for v in s.vips],
        "ports": {str(k): v for k, v in s.ports.items()},
        "endpoints": {uid: _endpoint(ep) for uid, ep in s.endpoints.items()},
        "subjectAltNames": list(s.subject_alt_names),
        "canonical": s.canonical,
        "visibility": s.visibility.value,
    }
    if s.cidr_vips:
        out["cidrVips"] = [str(c) for c in s.cidr_vips]
    if s.waypoint is not None:
        out["waypoint"] = _gateway(s.waypoint)
    if s.weighted_waypoints:
        out["weightedWaypoints"] = [
            {"destination": _gateway(w.destination), "weight": w.weight} for w in s.weighted_waypoints
        ]
    if s.load_balancer is not None:
        lb = s.load_balancer
        out["loadBalancer"] = {
            "routingPreferences": [p.value for p in lb.routing_preferences],
            "mode": lb.mode.value,
            "healthPolicy": lb.health_policy.value,
        }
    if s.ip_families is not None:
        out["ipFamilies"] = s.ip_families.value
    return out


def static_config_json(local: LocalConfig | None) -> dict[str, Any]:
    """``staticConfig``: the local config (``LOCAL_XDS_PATH`` / ``LOCAL_XDS``) as parsed, in upstream's
    ``LocalConfig`` shape (defaults filled in; each workload's ``services`` maps ``namespace/hostname`` to its
    port map); upstream's empty ``LocalConfig`` without one. What was loaded at start, which is what is in effect
    (upstream re-reads the file, which it never reloads)."""
    if local is None:
        return {"workloads": [], "policies": [], "services": []}
    update = local.update
    workloads = []
    for w in update.workloads:
        out = workload_json(w)
        out["services"] = {str(k): {str(p): t for p, t in ports.items()} for k, ports in w.services.items()}
        workloads.append(out)
    return {
        "workloads": workloads,
        "policies": [policy_json(p) for p in update.policies],
        "services": [service_json(s) for s in update.services],
    }


def _string_match(m: StringMatch) -> Any:
    return {"Presence": []} if m.kind is StringMatchKind.PRESENCE else {m.kind.value: m.value}


def _match(m: Match) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, values in (
        ("namespaces", m.namespaces),
        ("notNamespaces", m.not_namespaces),
        ("principals", m.principals),
        ("notPrincipals", m.not_principals),
    ):
        if values:
            out[key] = [_string_match(v) for v in values]
    for key, sas in (("serviceAccounts", m.service_accounts), ("notServiceAccounts", m.not_service_accounts)):
        if sas:
            out[key] = [{"namespace": sa.namespace, "serviceAccount": sa.service_account} for sa in sas]
    for key, nets in (
        ("sourceIps", m.source_ips),
        ("notSourceIps", m.not_source_ips),
        ("destinationIps", m.destination_ips),
        ("notDestinationIps", m.not_destination_ips),
    ):
        if nets:
            out[key] = [str(n) for n in nets]
    if m.destination_ports:
        out["destinationPorts"] = list(m.destination_ports)
    if m.not_destination_ports:
        out["notDestinationPorts"] = list(m.not_destination_ports)
    return out


def policy_json(p: Authorization) -> dict[str, Any]:
    return {
        "name": p.name,
        "namespace": p.namespace,
        "scope": p.scope.value,
        "action": p.action.value,
        "rules": [[[_match(m) for m in clause] for clause in rule] for rule in p.rules],
        "dryRun": p.dry_run,
    }


def _cert_json(cert: x509.Certificate) -> dict[str, Any]:
    pem = cert.public_bytes(Encoding.PEM)
    return {
        "pem": base64.b64encode(pem).decode(),
        "serialNumber": str(cert.serial_number),  # decimal, as upstream's x509-parser BigUint prints it
        "validFrom": cert.not_valid_before_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "expirationTime": cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def certificates_json(states: Mapping[Identity, CertificateState]) -> list[dict[str, Any]]:
    out = []
    for identity, st in sorted(states.items(), key=lambda kv: str(kv[0])):
        entry: dict[str, Any] = {"identity": str(identity)}
        if st.certificate is not None:
            entry["state"] = "Available"
            cert = st.certificate
            entry["certChain"] = [_cert_json(c) for c in (cert.cert, *cert.intermediates)]
            entry["rootCerts"] = [_cert_json(c) for c in cert.roots]
        elif st.error is not None:
            entry["state"] = f"Unavailable: {st.error}"
            entry["certChain"], entry["rootCerts"] = [], []
        else:
            entry["state"] = st.status.value  # "Initializing": a fetch is in progress
            entry["certChain"], entry["rootCerts"] = [], []
        out.append(entry)
    return out


class AdminServer:
    """The admin HTTP server; the app passes in what it shows and how to shut down.

    ``connections`` lists the open connections as JSON objects, afresh for each ``/connections`` request: the
    admin server knows nothing of the data plane (the proxy's records render themselves).
    """

    def __init__(
        self,
        config: Config,
        state: ProxyState,
        *,
        certificates: Callable[[], Mapping[Identity, CertificateState]],
        connections: Callable[[], Iterable[Mapping[str, Any]] | Awaitable[Iterable[Mapping[str, Any]]]],
        shutdown: Callable[[], Awaitable[None]],
        local_config: LocalConfig | None = None,
        workload_state: Callable[[], Mapping[str, Any] | Awaitable[Mapping[str, Any]]] | None = None,
        log_level: Callable[[bool, str], None] | None = None,
        profile_workers: ProfileWorkers | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.certificates = certificates
        self.connections = connections
        self.shutdown = shutdown
        self.local_config = local_config
        self.workload_state = workload_state
        # Told of every log filter change made here (the worker processes apply it too).
        self.log_level = log_level
        # Asks the data-plane workers to profile themselves (the supervisor's ``profile``); None: inline data plane.
        self.profile_workers = profile_workers
        self._profiling = False
        # The resolver config is read once, as upstream reads it at start (and a missing file warns once).
        self.resolver = ResolvConf.load().to_json()
        self._http: HttpServer | None = None
        self.addresses: list[tuple[str, int]] = []

    async def config_dump(self) -> dict[str, Any]:
        state = self.state
        dump: dict[str, Any] = {
            "workloads": [workload_json(w) for w in state.workloads],
            "services": [service_json(s) for s in state.services],
            "policies": [policy_json(p) for p in state.policies],
            "stagedServices": {
                str(k): {uid: _endpoint(ep) for uid, ep in eps.items()} for k, eps in state.services.staged.items()
            },
            "staticConfig": static_config_json(self.local_config),
            "version": {"version": __version__, "component": "ztunnel"},
            "config": self.config.to_json(self.resolver),
            "certificates": certificates_json(self.certificates()),
        }
        if self.workload_state is not None:
            dump["workloadState"] = dict(await _maybe_await(self.workload_state()))
        return dump

    async def start(self, addr: SocketAddress) -> None:
        from aiohttp import web

        async def index(request: web.Request) -> web.Response:
            return web.Response(text=INDEX, content_type="text/html")

        async def config_dump(request: web.Request) -> web.Response:
            return web.Response(text=json.dumps(await self.config_dump(), indent=2), content_type="application/json")

        async def connections(request: web.Request) -> web.Response:
            body = [dict(c) for c in await _maybe_await(self.connections())]
            return web.Response(text=json.dumps(body, indent=2), content_type="application/json")

        async def logging_(request: web.Request) -> web.Response:
            if request.method != "POST":
                return web.Response(
                    status=405, text="Only POST is allowed: POST /logging?level=<filter> or POST /logging?reset\n"
                )
            query = request.query
            if not query:
                return web.Response(text=f"current log level is {telemetry.current_level()}\n")
            try:
                level = telemetry.set_level("reset" in query, query.get("level", ""))
            except ValueError as e:
                return web.Response(status=400, text=f"invalid log level: {e}\n")
            if self.log_level is not None:
                self.log_level("reset" in query, query.get("level", ""))
            return web.Response(text=f"current log level is {level}\n")

        async def quit_(request: web.Request) -> web.Response:
            if request.method != "POST":
                return web.Response(status=405, text="Only POST is allowed\n")
            await self.shutdown()
            return web.Response(text="shutdown now\n")

        async def pprof_profile(request: web.Request) -> web.Response:
            q = request.query
            try:
                seconds, frequency = profiling.parse_profile_params(q.get("seconds"), q.get("frequency"))
            except profiling.ProfileError as e:
                return web.Response(status=400, text=f"{e}\n")
            if self._profiling:
                return web.Response(status=503, text="a CPU profile is already being taken; try again later\n")
            self._profiling = True
            try:
                results = await self._profile(q.get("process", "all"), "cpu", seconds, frequency)
            finally:
                self._profiling = False
            if isinstance(results, web.Response):
                return results
            failed = [f"{name}: {v.error}" for name, v in results if isinstance(v, profiling.ProfileFailed)]
            body = profiling.folded([v for _, v in results if isinstance(v, dict)])
            return web.Response(text=body + "".join(f"# {f}\n" for f in failed), content_type="text/plain")

        async def pprof_heap(request: web.Request) -> web.Response:
            results = await self._profile(request.query.get("process", "all"), "heap")
            if isinstance(results, web.Response):
                return results
            failed = [v.error for _, v in results if isinstance(v, profiling.ProfileFailed)]
            if failed and len(failed) == len(results):
                return web.Response(status=500, text=f"{failed[0]}\n")
            text = "".join(v for _, v in results if isinstance(v, str))
            text += "".join(f"# {name}: {v.error}\n" for name, v in results if isinstance(v, profiling.ProfileFailed))
            return web.Response(text=text, content_type="text/plain")

        async def pprof_heap_toggle(request: web.Request) -> web.Response:
            raw = request.query.get("activate")
            if raw not in (None, "true", "false"):
                return web.Response(status=400, text=f"invalid activate value {raw!r}; expected true or false\n")
            activate = None if raw is None else raw == "true"
            results = await self._profile(request.query.get("process", "all"), "heap-profiling", activate=activate)
            if isinstance(results, web.Response):
                return results
            text = "".join(f"{name}: heap profiling active: {str(v).lower()}\n" for name, v in results)
            return web.Response(text=text)

        app = web.Application()
        app.router.add_get("/", index)
        app.router.add_get("/debug/pprof/profile", pprof_profile)
        app.router.add_get("/debug/pprof/heap", pprof_heap)
        app.router.add_route("*", "/debug/pprof/heap/profiling", pprof_heap_toggle)
        app.router.add_get("/config_dump", config_dump)
        app.router.add_get("/connections", connections)
        app.router.add_route("*", "/logging", logging_)
        app.router.add_route("*", "/quitquitquit", quit_)
        self._http = HttpServer(app, name="admin")
        await self._http.start(addr)
        self.addresses = self._http.addresses

    async def _profile(
        self, process: str, kind: str, seconds: int = 0, frequency: int = 0, activate: bool | None = None
    ) -> Any:
        """Profile ``process`` (``all``, ``control``, ``worker-<i>``): this process on a thread, the workers over
        their channel (each samples itself on a thread), all at once. A list of (process, value), or a 404."""
        from aiohttp import web

        workers = ("all", "control") if self.profile_workers is None else None
        if workers is not None and process not in workers:
            return web.Response(status=404, text=f"no process {process!r}: the data plane runs in this process\n")

        async def own() -> list[tuple[str, Any]]:
            if process not in ("all", "control"):
                return []
            try:
                if kind == "cpu":
                    return [("control", await asyncio.to_thread(profiling.cpu_profile, seconds, frequency, "control"))]
                if kind == "heap":
                    return [("control", await asyncio.to_thread(profiling.heap_snapshot, "control"))]
                return [("control", profiling.set_heap_profiling(activate))]
            except profiling.ProfileError as e:
                return [("control", profiling.ProfileFailed(str(e)))]

        async def theirs() -> list[tuple[str, Any]]:
            if self.profile_workers is None or process == "control":
                return []
            return await self.profile_workers(process, kind, seconds, frequency, activate)

        mine, others = await asyncio.gather(own(), theirs())
        results = mine + others
        if not results:
            return web.Response(status=404, text=f"no process {process!r} answered\n")
        return results

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()


async def _maybe_await(value: T | Awaitable[T]) -> T:
    """The providers may answer at once or, with worker processes to ask, later."""
    if inspect.isawaitable(value):
        return await value
    return value


async def wait_or_timeout(task: Awaitable[None], timeout: float) -> None:
    try:
        await asyncio.wait_for(task, timeout)
    except TimeoutError:
        log.warning("shutdown did not finish within %.1fs", timeout)

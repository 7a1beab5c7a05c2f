"""A small control plane: delta ADS and the Istio CA over TLS, serving files in the local config schema.

What it serves
    Address and Authorization resources built from one or more local config files (``ztunnel.localconfig``
    schema, converted by :mod:`ztunnel.standins.istiod.convert`). Each resource's version is a hash of its bytes, so
    an unchanged resource keeps its version across restarts and a reconnecting client that echoes it in
    ``initial_resource_versions`` is not sent it again. The files are polled every 200 ms; a change is parsed and,
    if valid, pushed to every connected client as a delta (changed resources, and removed names). A file that
    does not parse is reported in the log (and :attr:`XdsServer.last_error`) and the last good config stays
    served.

Delta protocol (per stream, :class:`DeltaSession`, sans-IO)
    The first request of a type opens its subscription: no names, or ``*``, is a wildcard; ``*`` subscribed and
    unsubscribed together is "nothing yet" (on-demand clients), after which names are subscribed one by one.
    The first request is always answered, even with nothing, so the client can ACK and report ready. A name the
    client holds that the server does not have is sent back as removed. ACKs and NACKs are recorded (NACKs are
    logged with their ``error_detail``); a NACK does not cause a resend, as istiod.

On-demand clients (``XDS_ON_DEMAND=true``), as istiod serves them
    A subscribed name is a resource name or an address, ``<network>/<ip>``, which resolves (:class:`AddressIndex`)
    to the workloads with that IP or else the service with that VIP plus its endpoint workloads. Those are sent
    with their addresses in ``Resource.aliases`` (how the client matches them to its demand) and follow later
    changes; a name that resolves to nothing is answered as removed, so the client stops waiting. Names the client
    lists in ``initial_resource_versions`` stay subscribed after a reconnect, and the workloads on the client's
    own node (``NODE_NAME`` in its node metadata) are sent without being asked for.

The CA (``CreateCertificate``)
    Signed by a :class:`~ztunnel.identity.ca.LocalCA` under the rules of :class:`ztunnel.standins.istiod.ca.CaPolicy`.

TLS and authentication
    The listener presents a certificate for istiod's identity (``spiffe://<td>/ns/istio-system/sa/istiod``, DNS
    ``istiod.istio-system.svc``, ``localhost`` and the loopback IPs) signed by the same CA; clients trust the
    CA's ``root-cert.pem``. When tokens are configured every call (xDS too) must carry one as
    ``authorization: Bearer <token>``.

In-process API (tests, the demo, the benchmark): :class:`XdsServer` with ``start``/``stop`` (restartable on the
same port), :meth:`XdsServer.set_config` to replace the served config, and :meth:`XdsServer.set_raw_resource` to
serve arbitrary bytes under a name (fault injection: malformed resources for NACK tests).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import itertools
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message

from xds.envoy.service.discovery.v3 import discovery_pb2 as pb
from xds.envoy.service.discovery.v3 import discovery_pb2_grpc as pb_grpc
from xds.istio.v1.auth import ca_pb2, ca_pb2_grpc
from xds.istio.workload import workload_pb2 as wl_pb
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import DEFAULT_TRUST_DOMAIN, Identity
from ztunnel.localconfig import LocalConfig, LocalConfigError, load_local_config, parse_local_config
from ztunnel.net import format_addr
from ztunnel.standins.istiod.ca import DEFAULT_MAX_TTL, CaPolicy, CaRefused, node_identity
from ztunnel.standins.istiod.convert import ConvertError, pack, resources_from_update
from ztunnel.state import StateUpdate
from ztunnel.tasks import TaskGroup
from ztunnel.xds.types import ADDRESS_TYPE

__all__ = [
    "DEFAULT_LISTEN",
    "CaRequestRecord",
    "DeltaSession",
    "Snapshot",
    "VersionedResource",
    "XdsServer",
    "issue_server_certificate",
]

log = logging.getLogger("ztunnel.standins.istiod.server")

DEFAULT_LISTEN = "127.0.0.1:15012"
POLL_INTERVAL = 0.2
# How many past sessions, NACKs, stream headers and CA requests are kept for inspection; older ones are dropped so a
# long-running server does not grow without bound.
HISTORY = 1000
ISTIOD_HOSTNAMES = ("istiod.istio-system.svc", "istiod.istio-system.svc.cluster.local", "localhost")
SERVER_CERT_VALIDITY = timedelta(days=365)


# -- snapshot ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VersionedResource:
    """One resource as served: its version (a hash of its bytes) and its packed payload."""

    version: str
    payload: any_pb2.Any


def _versioned(payload: any_pb2.Any) -> VersionedResource:
    return VersionedResource(hashlib.sha256(payload.value).hexdigest()[:16], payload)


@dataclass(frozen=True)
class AddressIndex:
    """How on-demand Address names resolve to resources, as istiod's ambient index ``Lookup`` does.

    A name is a resource name (workload uid, ``<ns>/<hostname>``) or an address ``<network>/<ip>``. An address
    resolves to the workloads that have it, else to the service with that VIP; a service (by VIP or by name)
    brings its endpoint workloads along, since a client that asked for a VIP needs them to route.
    """

    lookup: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # resource name -> its own aliases (``<network>/<ip>`` of each workload address or service VIP), sent in
    # ``Resource.aliases`` so the client knows which demand a resource answers.
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # node name -> the workloads on it: istiod subscribes an on-demand client to its own node's workloads
    # (``AdditionalPodSubscriptions``), so a ztunnel knows its local pods without asking.
    by_node: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def resolve(self, name: str, served: Collection[str]) -> tuple[str, ...]:
        """The resource names ``name`` stands for (empty if nothing matches)."""
        hit = self.lookup.get(name)
        if hit is not None:
            return hit
        return (name,) if name in served else ()


def _ip(network: str, raw: bytes) -> str | None:
    try:
        return f"{network}/{ipaddress.ip_address(raw)}"
    except ValueError:
        return None


def address_index(resources: Mapping[str, VersionedResource]) -> AddressIndex:
    """Index the Address resources of a snapshot by address, by name and by node (payloads that do not decode,
    e.g. injected faults, are left out)."""
    by_ip: dict[str, list[str]] = {}
    vips: dict[str, str] = {}
    endpoints: dict[str, list[str]] = {}
    services: dict[str, str] = {}
    aliases: dict[str, tuple[str, ...]] = {}
    by_node: dict[str, list[str]] = {}
    for name, res in resources.items():
        try:
            addr = wl_pb.Address.FromString(res.payload.value)
        except DecodeError:
            continue
        if addr.HasField("workload"):
            w = addr.workload
            own = tuple(a for a in (_ip(w.network, raw) for raw in w.addresses) if a is not None)
            for a in own:
                by_ip.setdefault(a, []).append(name)
            for svc_key in w.services:
                endpoints.setdefault(svc_key, []).append(name)
            if w.node:
                by_node.setdefault(w.node, []).append(name)
            aliases[name] = own
        elif addr.HasField("service"):
            svc = addr.service
            own = tuple(a for a in (_ip(v.network, v.address) for v in svc.addresses) if a is not None)
            for a in own:
                vips.setdefault(a, name)
            services[f"{svc.namespace}/{svc.hostname}"] = name
            aliases[name] = own
    lookup: dict[str, tuple[str, ...]] = {}
    for key, name in [*vips.items(), *services.items()]:
        lookup[key] = (name, *endpoints.get(name, ()))
    for key, names in by_ip.items():  # a workload IP wins over a VIP, as istiod's lookup order
        lookup[key] = tuple(names)
    return AddressIndex(lookup, aliases, {node: tuple(names) for node, names in by_node.items()})


@dataclass(frozen=True)
class Snapshot:
    """Everything served at one moment: type URL -> resource name -> versioned resource."""

    version: int
    resources: Mapping[str, Mapping[str, VersionedResource]]
    addresses: AddressIndex = field(default_factory=AddressIndex)

    def of(self, type_url: str) -> Mapping[str, VersionedResource]:
        """The resources of one type URL (empty when none)."""
        return self.resources.get(type_url, {})


def build_snapshot(
    version: int,
    update: StateUpdate | None,
    raw: Mapping[str, Mapping[str, any_pb2.Any | None]],
) -> Snapshot:
    """A snapshot of ``update``'s resources, with ``raw`` overrides (a ``None`` override hides the name)."""
    typed = resources_from_update(update if update is not None else StateUpdate())
    out: dict[str, dict[str, VersionedResource]] = {}
    for type_url, items in typed.items():
        out[type_url] = {name: _versioned(pack(type_url, msg)) for name, msg in items.items()}
    for type_url, overrides in raw.items():
        bucket = out.setdefault(type_url, {})
        for name, payload in overrides.items():
            if payload is None:
                bucket.pop(name, None)
            else:
                bucket[name] = _versioned(payload)
    return Snapshot(version, out, address_index(out.get(ADDRESS_TYPE, {})))


# -- the per-stream protocol (sans-IO) ---------------------------------------------------------------------------


@dataclass
class _Subscription:
    wildcard: bool
    names: set[str] = field(default_factory=set)
    # name -> version the client holds (as far as the server knows).
    sent: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CaRequestRecord:
    """One ``CreateCertificate`` call as received (monotonic time, request, gRPC metadata)."""

    at: float
    request: ca_pb2.IstioCertificateRequest
    metadata: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Nack:
    """A NACK received from a client."""

    type_url: str
    nonce: str
    message: str


class DeltaSession:
    """One client's delta ADS stream: requests and snapshots in, responses out. No I/O.

    ``on_nack`` is called with every NACK received (the server keeps a history for tests and logs).
    """

    def __init__(self, snapshot: Snapshot, peer: str = "", on_nack: Callable[[Nack], None] | None = None) -> None:
        self.snapshot = snapshot
        self.peer = peer
        self.on_nack = on_nack
        self.node_id: str | None = None
        # The client's NODE_NAME (node metadata): an on-demand client is also sent its own node's workloads.
        self.node_name = ""
        self.subscriptions: dict[str, _Subscription] = {}
        self.acks: list[tuple[str, str]] = []
        self.nacks: list[Nack] = []
        self.initial_versions: dict[str, dict[str, str]] = {}
        # Requests without a nonce that change no subscription, which istiod checks for (delta.go: a spontaneous
        # request is a subscription change) and reports; recorded and logged here, still answered as before.
        self.unchanged_requests: list[pb.DeltaDiscoveryRequest] = []
        self._nonces = itertools.count(1)

    def on_request(self, req: pb.DeltaDiscoveryRequest) -> list[pb.DeltaDiscoveryResponse]:
        """Handle one request; returns the responses to send."""
        if req.HasField("node") and self.node_id is None:
            self.node_id = req.node.id
            node_name = req.node.metadata.fields.get("NODE_NAME")
            self.node_name = node_name.string_value if node_name is not None else ""
        type_url = req.type_url
        if req.response_nonce:
            if req.HasField("error_detail") and req.error_detail.message:
                nack = Nack(type_url, req.response_nonce, req.error_detail.message)
                self.nacks.append(nack)
                log.warning("NACK from %s (%s) for %s: %s", self.node_id, self.peer, type_url, nack.message)
                if self.on_nack is not None:
                    self.on_nack(nack)
            else:
                self.acks.append((type_url, req.response_nonce))
        sub = self.subscriptions.get(type_url)
        subscribe = list(req.resource_names_subscribe)
        unsubscribe = list(req.resource_names_unsubscribe)
        if sub is None:
            wildcard = not subscribe or "*" in subscribe
            if "*" in unsubscribe:
                wildcard = False
            explicit = {n for n in subscribe if n != "*"} - set(unsubscribe)
            # What a reconnecting client holds stays subscribed (istiod ``deltaWatchedResources``).
            sub = _Subscription(wildcard, explicit | set(req.initial_resource_versions))
            sub.sent = dict(req.initial_resource_versions)
            self.initial_versions[type_url] = dict(req.initial_resource_versions)
            self.subscriptions[type_url] = sub
            # Always answer the first request: the client ACKs it and only then reports ready.
            return [self._diff(type_url, sub, explicit=explicit)]
        if not subscribe and not unsubscribe:
            return []
        before = (sub.wildcard, frozenset(sub.names))
        if "*" in subscribe:
            sub.wildcard = True
        if "*" in unsubscribe:
            sub.wildcard = False
        new = {n for n in subscribe if n != "*"}
        sub.names |= new
        sub.names -= set(unsubscribe)
        if not req.response_nonce and (sub.wildcard, frozenset(sub.names)) == before:
            self.unchanged_requests.append(req)
            log.warning(
                "request from %s (%s) for %s changes no subscription (subscribe %s, unsubscribe %s)",
                self.node_id,
                self.peer,
                type_url,
                subscribe,
                unsubscribe,
            )
        for name in unsubscribe:
            sub.sent.pop(name, None)
        out = self._diff(type_url, sub, explicit=new)
        return [out] if out.resources or out.removed_resources or new else []

    def on_snapshot(self, snapshot: Snapshot) -> list[pb.DeltaDiscoveryResponse]:
        """The served config changed: the deltas this client needs."""
        self.snapshot = snapshot
        out = []
        for type_url, sub in self.subscriptions.items():
            resp = self._diff(type_url, sub)
            if resp.resources or resp.removed_resources:
                out.append(resp)
        return out

    def _resolve(self, type_url: str, name: str) -> tuple[str, ...]:
        current = self.snapshot.of(type_url)
        if type_url != ADDRESS_TYPE:
            return (name,) if name in current else ()
        return self.snapshot.addresses.resolve(name, current)

    def _wanted(self, type_url: str, sub: _Subscription) -> set[str]:
        current = self.snapshot.of(type_url)
        if sub.wildcard:
            return set(current)
        wanted = {r for n in sub.names for r in self._resolve(type_url, n)}
        if type_url == ADDRESS_TYPE and self.node_name:
            wanted.update(self.snapshot.addresses.by_node.get(self.node_name, ()))
        return wanted

    def _diff(self, type_url: str, sub: _Subscription, explicit: Collection[str] = ()) -> pb.DeltaDiscoveryResponse:
        """What the client needs now. ``explicit`` names were just asked for: they are answered even when the
        client already holds them (istiod re-sends on a request), and with a removal when nothing matches."""
        current = self.snapshot.of(type_url)
        wanted = self._wanted(type_url, sub)
        asked = {r for n in explicit for r in self._resolve(type_url, n)}
        resp = pb.DeltaDiscoveryResponse(
            type_url=type_url, nonce=str(next(self._nonces)), system_version_info=str(self.snapshot.version)
        )
        aliases = self.snapshot.addresses.aliases if type_url == ADDRESS_TYPE and not sub.wildcard else {}
        for name in sorted(wanted):
            res = current[name]
            if name in asked or sub.sent.get(name) != res.version:
                resp.resources.append(
                    pb.Resource(name=name, version=res.version, resource=res.payload, aliases=aliases.get(name, ()))
                )
                sub.sent[name] = res.version
        for name in sorted(sub.sent):
            if name not in wanted:
                resp.removed_resources.append(name)
                del sub.sent[name]
        # Names asked for explicitly that match nothing are answered as removed, so an on-demand client stops
        # waiting ("removed" for a name that never existed is how the xDS spec says "no such resource").
        for name in sorted(explicit):
            if not self._resolve(type_url, name) and name not in resp.removed_resources:
                resp.removed_resources.append(name)
        return resp


# -- TLS ---------------------------------------------------------------------------------------------------------


def issue_server_certificate(
    ca: LocalCA, hostnames: Sequence[str], ips: Sequence[str], identity: Identity
) -> tuple[bytes, bytes]:
    """A serving certificate for the control plane signed by ``ca``: (chain PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC).replace(microsecond=0)
    names: list[x509.GeneralName] = [x509.DNSName(h) for h in dict.fromkeys(hostnames)]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys(ips)]
    names.append(x509.UniformResourceIdentifier(str(identity)))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ca.trust_domain)]))
        .issuer_name(ca.root_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + SERVER_CERT_VALIDITY)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca.root_key, hashes.SHA256())
    )
    chain = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return chain, key_pem


# -- the server --------------------------------------------------------------------------------------------------


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address {listen!r} must be host:port")
    return host.strip("[]"), int(port)


class XdsServer:
    """The local control plane, in process. ``await start()``, then point ztunnels at :attr:`url`."""

    def __init__(
        self,
        ca: LocalCA,
        *,
        config_paths: Sequence[str | Path] = (),
        listen: str = DEFAULT_LISTEN,
        root_cert_path: Path | None = None,
        tokens: Mapping[str, Identity] | None = None,
        trusted_node_identities: Collection[Identity] | None = None,
        hostnames: Sequence[str] = (),
        trust_domain: str | None = None,
        max_ttl: timedelta = DEFAULT_MAX_TTL,
        poll_interval: float = POLL_INTERVAL,
    ) -> None:
        self.ca = ca
        self.trust_domain = trust_domain or ca.trust_domain or DEFAULT_TRUST_DOMAIN
        self.config_paths = [Path(p) for p in config_paths]
        self.host, self.port = _split_listen(listen)
        self.root_cert_path = root_cert_path
        self.hostnames = [*ISTIOD_HOSTNAMES, *hostnames]
        self.poll_interval = poll_interval
        self.policy = CaPolicy(
            ca=ca,
            trust_domain=self.trust_domain,
            tokens=dict(tokens or {}),
            trusted_nodes=(
                set(trusted_node_identities)
                if trusted_node_identities is not None
                else {node_identity(self.trust_domain)}
            ),
            max_ttl=max_ttl,
            served_identities=self._served_identities,
        )
        self.last_error: str | None = None
        self.nacks: list[Nack] = []
        self.sessions: list[DeltaSession] = []
        self.streams_opened = 0
        # gRPC metadata of every xDS stream, in order (tests check the headers clients send).
        self.stream_metadata: list[dict[str, str]] = []
        # CA statistics and fault injection.
        self.ca_requests: list[CaRequestRecord] = []
        self.ca_inflight = 0
        self.ca_max_inflight = 0
        self.ca_gate: asyncio.Event | None = None
        self.fail_ca: str | None = None
        self._update: StateUpdate | None = None
        self._raw: dict[str, dict[str, any_pb2.Any | None]] = {}
        self._versions = itertools.count(1)
        self._snapshot = build_snapshot(0, None, {})
        self._queues: set[asyncio.Queue[pb.DeltaDiscoveryRequest | Snapshot | None]] = set()
        self._server: Any = None
        self._tasks = TaskGroup("xds-server")
        self._stamps: tuple[tuple[int, int, int] | None, ...] = ()
        if self.config_paths:
            self.reload_files(initial=True)

    @classmethod
    def from_ca_dir(cls, ca_dir: str | Path, trust_domain: str = DEFAULT_TRUST_DOMAIN, **kwargs: Any) -> XdsServer:
        """A server whose CA is loaded from (or created in) ``ca_dir``; clients trust ``ca_dir/root-cert.pem``."""
        ca = LocalCA.load_or_create(Path(ca_dir), trust_domain)
        return cls(ca, root_cert_path=Path(ca_dir) / "root-cert.pem", trust_domain=trust_domain, **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``https://host:port``, for ``XDS_ADDRESS`` / ``CA_ADDRESS``."""
        return f"https://{format_addr(self.host, self.port)}"

    @property
    def snapshot(self) -> Snapshot:
        """What is served now."""
        return self._snapshot

    async def start(self) -> None:
        """Bind and serve. After :meth:`stop` it can be started again on the same port."""
        ips = ["127.0.0.1", "::1"]
        try:
            if not ipaddress.ip_address(self.host).is_unspecified:
                ips.append(self.host)
        except ValueError:
            self.hostnames.append(self.host)
        chain, key = issue_server_certificate(
            self.ca, self.hostnames, ips, Identity(self.trust_domain, "istio-system", "istiod")
        )
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 200 * 1024 * 1024),
                # gRPC sets SO_REUSEPORT by default: a second control plane on the same port would silently share it.
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_Ads(self), server)  # type: ignore[no-untyped-call]
        ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(_Ca(self), server)  # type: ignore[no-untyped-call]
        listen = format_addr(self.host, self.port)
        try:
            port = server.add_secure_port(listen, grpc.ssl_server_credentials([(key, chain)]))
        except RuntimeError as e:  # newer gRPC raises instead of returning 0
            port, error = 0, f": {e}"
        else:
            error = ""
        if port == 0:
            raise OSError(f"cannot listen on {listen} (in use, or not a local address){error}")
        self.port = port
        await server.start()
        self._server = server
        if self.config_paths:
            self._tasks.spawn(self._watch(), "watch config files")
        log.info("control plane serving xDS and CA on %s (root certificate %s)", self.url, self.root_cert_path)
        if self.policy.open:
            log.warning("no token configured: any client may connect and request a certificate for any identity")

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving; open streams are cut (clients see the server go away)."""
        await self._tasks.cancel_all(timeout=1.0)
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace)
        self._queues.clear()

    async def __aenter__(self) -> XdsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- config ------------------------------------------------------------------------------------------------

    def set_config(self, config: LocalConfig | StateUpdate | str | None) -> None:
        """Replace the served config (YAML text in the local schema, a parsed one, or nothing) and push it.

        Raises ``LocalConfigError`` (bad YAML) or ``ConvertError`` (no xDS form) and keeps the current config.
        """
        if isinstance(config, str):
            config = parse_local_config(config, "set_config", self.trust_domain)
        update = config.update if isinstance(config, LocalConfig) else config
        self._publish(update)

    def set_raw_resource(self, type_url: str, name: str, resource: Message | bytes | None) -> None:
        """Serve ``resource`` (a message, or raw payload bytes) under ``name``, whatever the config says.

        ``None`` removes the override. For tests: a payload that does not decode, or converts badly, gets NACKed.
        """
        if resource is None:
            self._raw.get(type_url, {}).pop(name, None)
        else:
            value = resource if isinstance(resource, bytes) else resource.SerializeToString(deterministic=True)
            self._raw.setdefault(type_url, {})[name] = any_pb2.Any(type_url=type_url, value=value)
        self._publish(self._update)

    def reload_files(self, initial: bool = False) -> bool:
        """Parse the config files and publish them; on error keep the last good config. True if published."""
        self._stamps = self._file_stamps()
        try:
            self._publish(self._load_files())
        except (LocalConfigError, ConvertError) as e:
            self.last_error = str(e)
            log.error("control plane config not loaded, still serving the previous one: %s", e)
            if initial:
                raise
            return False
        self.last_error = None
        return True

    def _load_files(self) -> StateUpdate:
        merged = StateUpdate(replace_all=True)
        owners: dict[tuple[str, str], Path] = {}
        for path in self.config_paths:
            cfg = load_local_config(path, self.trust_domain)
            u = cfg.update
            keys = (
                [("workload", w.uid or f"{w.namespace}/{w.name}") for w in u.workloads]
                + [("service", str(s.key)) for s in u.services]
                + [("policy", p.key) for p in u.policies]
            )
            for key in keys:
                if key in owners:
                    raise ConvertError(f"{owners[key]} and {path} both define {key[0]} {key[1]!r}")
                owners[key] = path
            merged.workloads += u.workloads
            merged.services += u.services
            merged.policies += u.policies
        return merged

    def _publish(self, update: StateUpdate | None) -> None:
        snapshot = build_snapshot(next(self._versions), update, self._raw)  # raises before anything changes
        self._update, self._snapshot = update, snapshot
        counts = {t.rsplit(".", 1)[-1]: len(r) for t, r in self._snapshot.resources.items()}
        log.info("control plane config version %d: %s", self._snapshot.version, counts)
        for q in list(self._queues):
            q.put_nowait(self._snapshot)

    def _served_identities(self) -> set[Identity]:
        return {w.identity for w in (self._update.workloads if self._update is not None else [])}

    def _file_stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        out: list[tuple[int, int, int] | None] = []
        for p in self.config_paths:
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            if self._file_stamps() != self._stamps:
                self.reload_files()

    # -- gRPC handlers -----------------------------------------------------------------------------------------

    @staticmethod
    def _metadata(context: Any) -> dict[str, str]:
        return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}

    def _authenticate(self, context: Any) -> Identity | None:
        return self.policy.authenticate(self._metadata(context))

    async def _delta(self, context: Any) -> None:
        _remember(self.stream_metadata, self._metadata(context))
        try:
            self._authenticate(context)
        except CaRefused as e:
            await context.abort(e.code, str(e))
        self.streams_opened += 1
        session = DeltaSession(self._snapshot, context.peer(), on_nack=lambda n: _remember(self.nacks, n))
        _remember(self.sessions, session)
        queue: asyncio.Queue[pb.DeltaDiscoveryRequest | Snapshot | None] = asyncio.Queue()
        self._queues.add(queue)

        async def read() -> None:
            while True:
                req = await context.read()
                if req is grpc.aio.EOF:
                    queue.put_nowait(None)
                    return
                queue.put_nowait(req)

        reader = self._tasks.spawn(read(), f"ads reader {context.peer()}")
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                responses = session.on_snapshot(item) if isinstance(item, Snapshot) else session.on_request(item)
                for resp in responses:
                    await context.write(resp)
        finally:
            self._queues.discard(queue)
            reader.cancel()

    async def _create_certificate(self, request: ca_pb2.IstioCertificateRequest, context: Any) -> Any:
        self.ca_inflight += 1
        self.ca_max_inflight = max(self.ca_max_inflight, self.ca_inflight)
        try:
            metadata = self._metadata(context)
            _remember(self.ca_requests, CaRequestRecord(time.monotonic(), request, metadata))
            caller = self.policy.authenticate(metadata)
            if self.ca_gate is not None:
                await self.ca_gate.wait()
            if self.fail_ca is not None:
                raise CaRefused(grpc.StatusCode.UNAVAILABLE, self.fail_ca)
            chain = self.policy.sign(request, caller)
        except CaRefused as e:
            log.info("CreateCertificate refused (%s): %s", e.code.name, e)
            await context.abort(e.code, str(e))
        finally:
            self.ca_inflight -= 1
        return ca_pb2.IstioCertificateResponse(cert_chain=chain)


def _remember(history: list[Any], item: Any) -> None:
    history.append(item)
    if len(history) > HISTORY:
        del history[: len(history) - HISTORY]


class _Ads(pb_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, server: XdsServer) -> None:
        self._server = server

    async def DeltaAggregatedResources(self, request_iterator: Any, context: Any) -> None:
        await self._server._delta(context)

    async def StreamAggregatedResources(self, request_iterator: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "only delta xDS (DeltaAggregatedResources) is served")


class _Ca(ca_pb2_grpc.IstioCertificateServiceServicer):
    def __init__(self, server: XdsServer) -> None:
        self._server = server

    async def CreateCertificate(self, request: Any, context: Any) -> Any:
        return await self._server._create_certificate(request, context)

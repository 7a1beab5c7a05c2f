"""Delta ADS client (upstream ``xds/client.rs``): the subscription state machine and its grpc.aio adapter.

Theory of operation
-------------------
ztunnel holds one bidirectional ``DeltaAggregatedResources`` stream to istiod and watches two type URLs, Address
and Authorization. The protocol state lives in :class:`DeltaAdsState`, which does no I/O: it builds requests and
consumes responses (protobuf messages in, protobuf messages and events out), so every rule below is unit-tested
without a socket. :class:`AdsClient` is the thin adapter that owns the gRPC stream, the reconnect loop and the
readiness token.

* On every new stream the first request of each type carries the node (id and metadata) and, in
  ``initial_resource_versions``, the version of every resource already held, so the server need not resend
  unchanged ones. An empty subscribe list is a wildcard subscription; with ``XDS_ON_DEMAND`` the Address request
  subscribes and unsubscribes ``*`` at once ("subscribe to nothing") and resources are then requested by name
  (``<network>/<ip>`` for an unknown destination). A demand is answered by the first response that names it: as a
  resource, as an alias of one (istiod answers an IP with the workload or service that has it), or as removed.
* Each response is decoded and handed to the type's handler (which applies it to the proxy state as one batch);
  the handler reports the names it rejected. The reply is an ACK (``response_nonce``) or, if anything was
  rejected, a NACK whose ``error_detail.message`` is ``"<name>: <reason>; <name>: <reason>"``. The good resources
  of a NACKed response are applied all the same, and only they are recorded as held: a rejected resource is left
  out of ``initial_resource_versions`` so the server re-sends (and thereby retries) it after a reconnect.
* A response for a type URL nobody watches is ACKed and logged.
* Readiness: each watched, non-on-demand type starts ``UNSYNCED`` and becomes ``SYNCED`` on its first ACK (a NACK
  leaves it unsynced). Once every such type is synced the client is ready, once for its lifetime: an outage later
  does not block readiness again (the last good state keeps being served), as upstream.
* The held-resource map and the state survive reconnects; nothing is cleared when the stream breaks.

Reconnect (upstream ``run_loop``): backoff starts at 10 ms. A failure before the stream delivered anything (the
server is unreachable, TLS or auth failed) doubles it (max 15 s) and is counted as ``ConnectionError``. A stream
that broke with ``UNKNOWN``, ``CANCELLED``, ``DEADLINE_EXCEEDED``, or ``UNAVAILABLE`` because the transport closed
or the server sent GOAWAY (a restart or ``MaxConnectionAge``) reconnects after 10 ms (``Reconnect``). Other gRPC
errors double the backoff (``Error``), and so does a response that does not decode as a
``DeltaDiscoveryResponse`` (upstream's tonic fails the stream with ``Internal``). A stream that ended cleanly
reconnects at once (``Complete``), unless it ended before any response: upstream reconnects at once then too, which
against a server that always does that is a busy loop, so here it counts as a connection failure.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.struct_pb2 import Struct
from google.rpc import status_pb2
from grpc import _common as _grpc_common

from xds.envoy.config.core.v3 import base_pb2
from xds.envoy.service.discovery.v3 import discovery_pb2 as pb
from ztunnel.config import Config
from ztunnel.control import ControlPlaneError, auth_metadata, grpc_target, load_root_pem, secure_channel
from ztunnel.errors import ZtunnelError
from ztunnel.readiness import BlockReady
from ztunnel.tasks import TaskGroup
from ztunnel.xds.wire import describe_decode_error

__all__ = [
    "CONNECT_TIMEOUT",
    "INITIAL_BACKOFF",
    "MAX_BACKOFF",
    "AdsClient",
    "ConnectionTerminationReason",
    "DeltaAdsState",
    "Handler",
    "RejectedConfig",
    "ResourceKey",
    "ResourceRemoved",
    "ResourceUpdated",
    "ResponseHandled",
    "SubscriptionState",
    "XdsSignal",
    "XdsUpdate",
    "build_node",
]

log = logging.getLogger("ztunnel.xds")

INITIAL_BACKOFF = 0.010
MAX_BACKOFF = 15.0
# Upstream's connector gives up on a TCP+TLS connect after 5 s.
CONNECT_TIMEOUT = 5.0
DEFAULT_INSTANCE_IP = "1.1.1.1"


# -- vocabulary --------------------------------------------------------------------------------------------------


class XdsSignal(enum.Enum):
    """The reply to one response."""

    ACK = "ACK"
    NACK = "NACK"


class SubscriptionState(enum.Enum):
    """Where one watched type stands with respect to readiness."""

    UNSYNCED = "unsynced"  # requested, never ACKed: readiness waits for it
    SYNCED = "synced"  # ACKed at least once
    ON_DEMAND = "on-demand"  # resources come by name when asked for; never blocks readiness


# (state, reply sent) -> next state. Every pair is listed; there is no other transition.
TRANSITIONS: Mapping[tuple[SubscriptionState, XdsSignal], SubscriptionState] = {
    (SubscriptionState.UNSYNCED, XdsSignal.ACK): SubscriptionState.SYNCED,
    (SubscriptionState.UNSYNCED, XdsSignal.NACK): SubscriptionState.UNSYNCED,
    (SubscriptionState.SYNCED, XdsSignal.ACK): SubscriptionState.SYNCED,
    (SubscriptionState.SYNCED, XdsSignal.NACK): SubscriptionState.SYNCED,
    (SubscriptionState.ON_DEMAND, XdsSignal.ACK): SubscriptionState.ON_DEMAND,
    (SubscriptionState.ON_DEMAND, XdsSignal.NACK): SubscriptionState.ON_DEMAND,
}


@dataclass(frozen=True, slots=True)
class ResourceKey:
    """A resource by type URL and name."""

    type_url: str
    name: str

    def __str__(self) -> str:
        return f"{self.type_url}/{self.name}"


@dataclass(frozen=True, slots=True)
class RejectedConfig:
    """A resource the client refused; ``str()`` is the NACK fragment ``"<name>: <reason>"``."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


@dataclass(frozen=True, slots=True)
class ResourceUpdated:
    """A decoded resource from a response."""

    name: str
    resource: Message


@dataclass(frozen=True, slots=True)
class ResourceRemoved:
    """A name from a response's ``removed_resources``."""

    name: str


XdsUpdate = ResourceUpdated | ResourceRemoved


class Handler(Protocol):
    """Applies the resources of one type URL. Must not raise: bad resources are returned as rejections."""

    type_url: str
    message_type: type[Message]
    # Authorization is never requested on demand (upstream ``no_on_demand``).
    on_demand_capable: bool

    def handle(self, updates: Sequence[XdsUpdate]) -> list[RejectedConfig]:
        """Apply ``updates`` (resources in response order, then removals); return the rejected names."""
        ...


@dataclass(frozen=True, slots=True)
class ResponseHandled:
    """What receiving one response did, and the ACK/NACK to send for it."""

    type_url: str
    nonce: str
    signal: XdsSignal
    reply: pb.DeltaDiscoveryRequest
    rejected: tuple[RejectedConfig, ...] = ()
    known_type: bool = True
    # True for exactly one response in the client's lifetime: the ACK that completed the initial sync.
    became_ready: bool = False
    demands_answered: tuple[ResourceKey, ...] = ()

    @property
    def error_detail(self) -> str | None:
        """The NACK's ``error_detail.message``, or ``None`` for an ACK."""
        return self.reply.error_detail.message if self.reply.HasField("error_detail") else None


# -- node --------------------------------------------------------------------------------------------------------


def build_node(config: Config) -> base_pb2.Node:
    """The xDS node: ``ztunnel~<ip>~<pod>.<ns>~<ns>.svc.cluster.local`` and its metadata, as upstream.

    Metadata holds ``NAME``, ``NAMESPACE``, ``INSTANCE_IPS`` and ``NODE_NAME``, then the proxy metadata
    (``ISTIO_META_*`` and ProxyConfig ``proxyMetadata`` as strings, ``ISTIO_METAJSON_*`` as typed JSON values).
    """
    fields: dict[str, Any] = {
        "NAME": config.pod_name or "",
        "NAMESPACE": config.pod_namespace or "",
        # Unset: 1.1.1.1; set but empty: empty (upstream's env::var(INSTANCE_IP).unwrap_or(DEFAULT_IP)).
        "INSTANCE_IPS": config.instance_ip if config.instance_ip is not None else DEFAULT_INSTANCE_IP,
        "NODE_NAME": config.node_name or "",
    }
    fields.update(config.proxy_metadata)
    metadata = Struct()
    metadata.update(fields)
    return base_pb2.Node(id=config.node_id, metadata=metadata)


# -- the sans-IO core --------------------------------------------------------------------------------------------


class DeltaAdsState:
    """The delta xDS subscription state: requests out, responses in, no I/O.

    ``known_resources`` (type URL -> name -> version) is what the client holds and echoes in
    ``initial_resource_versions`` on the next stream.
    """

    def __init__(self, node: base_pb2.Node, handlers: Sequence[Handler], on_demand: bool = False) -> None:
        self.node = node
        self.on_demand = on_demand
        self.handlers: dict[str, Handler] = {h.type_url: h for h in handlers}
        self.known_resources: dict[str, dict[str, str]] = {}
        self.subscriptions: dict[str, SubscriptionState] = {}
        for h in handlers:
            self.subscriptions[h.type_url] = (
                SubscriptionState.ON_DEMAND if on_demand and h.on_demand_capable else SubscriptionState.UNSYNCED
            )
        self.ready = not any(s is SubscriptionState.UNSYNCED for s in self.subscriptions.values())
        # Names asked for on demand and not answered yet.
        self.pending_demands: set[ResourceKey] = set()

    def initial_requests(self) -> list[pb.DeltaDiscoveryRequest]:
        """The first request of each watched type, for a new stream."""
        out = []
        for type_url, sub in self.subscriptions.items():
            req = pb.DeltaDiscoveryRequest(type_url=type_url, node=self.node)
            if sub is SubscriptionState.ON_DEMAND:
                # xDS cannot say "subscribe to nothing"; subscribing and unsubscribing the wildcard together does.
                req.resource_names_subscribe.append("*")
                req.resource_names_unsubscribe.append("*")
            req.initial_resource_versions.update(self.known_resources.get(type_url, {}))
            out.append(req)
        return out

    def demand(self, type_url: str, name: str) -> pb.DeltaDiscoveryRequest | None:
        """Ask for one resource by name (on-demand mode). It is answered when a response names it, as a resource,
        an alias of one, or a removal.

        Returns the request to send, or ``None`` when the same name is already pending (one request in flight per
        name; every caller waits for the same answer).
        """
        key = ResourceKey(type_url, name)
        if key in self.pending_demands:
            return None
        self.pending_demands.add(key)
        # Recorded with no version, so a reconnect asks for it again, without clobbering a version already held.
        self.known_resources.setdefault(type_url, {}).setdefault(name, "")
        return pb.DeltaDiscoveryRequest(type_url=type_url, resource_names_subscribe=[name])

    def receive(self, response: pb.DeltaDiscoveryResponse) -> ResponseHandled:
        """Apply one response through its handler and decide the ACK/NACK."""
        type_url = response.type_url
        handler = self.handlers.get(type_url)
        if handler is None:
            reply = pb.DeltaDiscoveryRequest(type_url=type_url, response_nonce=response.nonce)
            return ResponseHandled(type_url, response.nonce, XdsSignal.ACK, reply, known_type=False)

        rejected: list[RejectedConfig] = []
        updates: list[XdsUpdate] = []
        removed = list(response.removed_resources)
        removed_set = set(removed)
        # A name twice in one response is a server bug; which copy is meant is unknowable, so neither applies (as
        # Envoy: "duplicate name found among added/updated resources").
        seen = Counter(res.name for res in response.resources)
        duplicates = {name for name, n in seen.items() if n > 1}
        rejected.extend(RejectedConfig(name, "duplicate resource name in one response") for name in sorted(duplicates))
        for res in response.resources:
            if res.name in duplicates:
                continue
            if not res.HasField("resource"):
                rejected.append(RejectedConfig(res.name, "XDS payload without resource"))
                continue
            try:
                msg = handler.message_type.FromString(res.resource.value)
            except DecodeError as e:
                # upb says only "Wire format was corrupt": find the field and byte offset for the operator.
                where = describe_decode_error(handler.message_type, res.resource.value)
                rejected.append(RejectedConfig(res.name, f"decode: {where or e}"))
                continue
            # A name both updated and removed in one response ends up removed (upstream applies removals last).
            if res.name not in removed_set:
                updates.append(ResourceUpdated(res.name, msg))
        updates.extend(ResourceRemoved(name) for name in removed)
        # Handler rejections first: they are about content; decode failures are about the bytes.
        rejected = [*handler.handle(updates), *rejected]
        rejected_names = {r.name for r in rejected}

        known = self.known_resources.setdefault(type_url, {})
        answered: list[ResourceKey] = []
        for name in removed:
            known.pop(name, None)
            answered.extend(self._answer(ResourceKey(type_url, name)))
        for res in response.resources:
            answered.extend(self._answer(ResourceKey(type_url, res.name)))
            # istiod answers a demand for "<network>/<ip>" with the workload or service that has that address,
            # under its own name, and lists the demanded name among its aliases (pilot workload.go).
            for alias in res.aliases:
                answered.extend(self._answer(ResourceKey(type_url, alias)))
            if res.name not in rejected_names and res.name not in removed_set:
                known[res.name] = res.version

        reply = pb.DeltaDiscoveryRequest(type_url=type_url, response_nonce=response.nonce)
        signal = XdsSignal.ACK
        if rejected:
            signal = XdsSignal.NACK
            reply.error_detail.CopyFrom(status_pb2.Status(message="; ".join(str(r) for r in rejected)))
        sub = self.subscriptions[type_url]
        self.subscriptions[type_url] = TRANSITIONS[(sub, signal)]
        became_ready = False
        if not self.ready and not any(s is SubscriptionState.UNSYNCED for s in self.subscriptions.values()):
            self.ready = became_ready = True
        return ResponseHandled(
            type_url,
            response.nonce,
            signal,
            reply,
            rejected=tuple(rejected),
            became_ready=became_ready,
            demands_answered=tuple(answered),
        )

    def _answer(self, key: ResourceKey) -> list[ResourceKey]:
        if key in self.pending_demands:
            self.pending_demands.discard(key)
            return [key]
        return []


# -- the grpc.aio adapter ----------------------------------------------------------------------------------------


class ConnectionTerminationReason(enum.Enum):
    """Why a stream ended (upstream's ``istio_xds_connection_terminations`` ``reason`` label)."""

    CONNECTION_ERROR = "ConnectionError"
    ERROR = "Error"
    RECONNECT = "Reconnect"
    COMPLETE = "Complete"


class _ConnectFailed(ZtunnelError):
    """The stream never delivered a response: unreachable server, TLS or authentication failure."""


class _BadResponse(ZtunnelError):
    """The server sent bytes that are not a ``DeltaDiscoveryResponse``."""


class _SetupFailed(ZtunnelError):
    """The channel could not be made before any connection: the root certificate (``XDS_ROOT_CA``) does not load,
    or the address does not parse."""


# The ADS method, called with raw bytes out (rather than the generated stub's deserializer): grpc.aio logs a
# traceback and hands back ``None`` for a message its deserializer refuses, so decoding is done here instead.
_ADS_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"


# Substrings of UNAVAILABLE messages that mean "the transport went away under a healthy stream": upstream's
# (from hyper/h2) and gRPC core's wording of the same events.
# "Cancelling all calls" is the GOAWAY debug text of a gRPC-core server shutting down; "Stream removed" is gRPC
# core's text when the server's socket closed as the client wrote (seen as "Stream removed (sendmsg: Broken pipe
# (32))" when a control plane stops mid-stream, the same event as "socket closed" a few ms later).
_TRANSPORT_CLOSED = (
    "transport is closing",
    "received prior goaway",
    "goaway",
    "cancelling all calls",
    "socket closed",
    "connection reset",
    "stream removed",
)
_RECONNECT_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
# A GOAWAY with ENHANCE_YOUR_CALM (gRPC core: "GOAWAY received; Error code: 11; Debug data: too_many_pings") is the
# server pushing back, not a transport going away: upstream's tonic reports it as RESOURCE_EXHAUSTED, an Error that
# backs off, so it is not retried after 10 ms here either.
_PUSHBACK = ("error code: 11", "too_many_pings", "enhance_your_calm")


def _is_reconnect(e: grpc.aio.AioRpcError) -> bool:
    code = e.code()
    if code in _RECONNECT_CODES:
        return True
    details = (e.details() or "").lower()
    return (
        code == grpc.StatusCode.UNAVAILABLE
        and any(s in details for s in _TRANSPORT_CLOSED)
        and not any(s in details for s in _PUSHBACK)
    )


def _describe(code: grpc.StatusCode, details: str | None) -> str:
    """A failed call as upstream's log lines give it (tonic's code and message as Rust's Debug prints them:
    ``status: Unavailable, message: "..."``), so the same grep finds both."""
    name = "".join(part.capitalize() for part in code.name.split("_"))
    text = f"status: {name}, message: {json.dumps(details or '', ensure_ascii=False)}"
    if "authentication failure" in (details or ""):
        text += " (hint: check the control plane logs for more information)"
    return text


# grpc aio's client: when a write is in flight as the server ends the call (istiod refusing a token answers the
# stream's headers at once), the failed send overwrites the call's status with this placeholder, losing what the
# server said. Measured against a server that aborts at once: 189 of 200 calls reported it. The call's first status
# is the real one, so a done-callback keeps it (grpc aio has no synchronous status getter; its status() coroutine
# returns without suspending once the call is done).
_CORE_SEND_FAILED = "Internal error from Core"


class _FirstStatus:
    """The status a gRPC aio call ended with, before a failed concurrent write can overwrite it."""

    def __init__(self, call: Any) -> None:
        self.code: grpc.StatusCode | None = None
        self.details: str | None = None
        call.add_done_callback(self._done)

    def _done(self, call: Any) -> None:
        coro = None
        try:  # a grpc internals change must never break the stream: it only loses the better message
            coro = call._cython_call.status()
            coro.send(None)
        except StopIteration as stop:
            status = stop.value
            self.code = _grpc_common.CYGRPC_STATUS_CODE_TO_STATUS_CODE.get(status.code())
            self.details = status.details()
        except Exception:
            log.debug("cannot read the gRPC call's first status", exc_info=True)
        if coro is not None:
            coro.close()

    def explain(self, e: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str | None]:
        if e.code() == grpc.StatusCode.INTERNAL and e.details() == _CORE_SEND_FAILED and self.code is not None:
            return self.code, self.details
        return e.code(), e.details()


class AdsClient:
    """Runs the delta ADS stream against ``XDS_ADDRESS`` forever, reconnecting with backoff.

    ``ready`` is released after the first ACK of every watched (non-on-demand) type. Run :meth:`run` as an owned
    task; cancelling it closes the stream.
    """

    def __init__(
        self,
        config: Config,
        handlers: Sequence[Handler],
        ready: BlockReady | None = None,
        *,
        address: str | None = None,
    ) -> None:
        address = address or config.xds_address
        if address is None:
            raise ControlPlaneError("XDS_ADDRESS is empty: xDS is disabled")
        grpc_target(address, "XDS_ADDRESS")  # a malformed address fails here, at startup, not in the loop
        self.config = config
        self.address = address
        self.core = DeltaAdsState(build_node(config), handlers, config.xds_on_demand)
        self._ready = ready
        if self.core.ready and ready is not None:
            ready.release()
        self.connection_id = 0
        self.terminations: Counter[ConnectionTerminationReason] = Counter()
        self.last_error: str | None = None
        self.backoff = INITIAL_BACKOFF
        self._outgoing: asyncio.Queue[pb.DeltaDiscoveryRequest] | None = None
        self._demand_waiters: dict[ResourceKey, list[asyncio.Future[None]]] = {}
        # type URL -> [responses, resource payload bytes] (upstream istio_xds_message_total / _bytes_total).
        self.messages: dict[str, list[int]] = {}

    async def run(self) -> None:
        """Connect, serve the stream, and reconnect after it ends, forever."""
        backoff = INITIAL_BACKOFF
        while True:
            self.connection_id += 1
            backoff = await self._run_loop(backoff)
            self.backoff = backoff

    async def demand(self, type_url: str, name: str) -> None:
        """Request one resource on demand and wait until a response names it (as a resource or a removal)."""
        if not self.config.xds_on_demand:
            raise ControlPlaneError("on-demand xDS requests need XDS_ON_DEMAND=true")
        key = ResourceKey(type_url, name)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._demand_waiters.setdefault(key, [])
        waiters.append(fut)
        req = self.core.demand(type_url, name)
        if req is not None:
            log.info("received on demand request %s", key)
            # With no stream up, the core's record of the name (no version) is what asks for it: the next stream's
            # initial request lists it in initial_resource_versions, which subscribes it (as upstream). Asking again
            # explicitly would be a request that changes no subscription, which istiod checks for.
            if self._outgoing is not None:
                self._outgoing.put_nowait(req)
        try:
            await fut
        finally:
            # A caller that gave up (its own timeout) leaves no future behind; the name stays pending.
            if fut in waiters:
                waiters.remove(fut)
            if not waiters and self._demand_waiters.get(key) is waiters:
                del self._demand_waiters[key]

    async def _run_loop(self, backoff: float) -> float:
        """One stream and the wait before the next; returns the backoff to carry over (upstream ``run_loop``)."""
        try:
            await self._run_stream()
        except _ConnectFailed as e:
            backoff = min(MAX_BACKOFF, backoff * 2)
            self._terminated(ConnectionTerminationReason.CONNECTION_ERROR, str(e))
            log.warning("XDS client connection error: %s, retrying in %s", e, _fmt(backoff))
            await asyncio.sleep(backoff)
            return backoff
        except (_BadResponse, _SetupFailed) as e:
            # Upstream: tonic fails the stream with Internal ("failed to decode Protobuf message"), an Error; a root
            # certificate or channel that cannot be made is one of its "other errors", an Error too (retried there at
            # once, without a pause, which would spin on a missing file: here with the backoff).
            backoff = min(MAX_BACKOFF, backoff * 2)
            self._terminated(ConnectionTerminationReason.ERROR, str(e))
            log.warning("XDS client error: %s, retrying in %s", e, _fmt(backoff))
            await asyncio.sleep(backoff)
            return backoff
        except grpc.aio.AioRpcError as e:
            reason = _describe(e.code(), e.details())
            if _is_reconnect(e):
                self._terminated(ConnectionTerminationReason.RECONNECT, reason)
                log.debug("XDS client terminated: %s, retrying in %s", reason, _fmt(INITIAL_BACKOFF))
                backoff = INITIAL_BACKOFF
            else:
                backoff = min(MAX_BACKOFF, backoff * 2)
                self._terminated(ConnectionTerminationReason.ERROR, reason)
                log.warning("XDS client error: gRPC error %s, retrying in %s", reason, _fmt(backoff))
            await asyncio.sleep(backoff)
            return backoff
        self._terminated(ConnectionTerminationReason.COMPLETE, None)
        log.warning("XDS client complete")
        return INITIAL_BACKOFF

    def _terminated(self, reason: ConnectionTerminationReason, error: str | None) -> None:
        self.terminations[reason] += 1
        self.last_error = error

    async def _run_stream(self) -> None:
        cfg = self.config
        try:
            root = load_root_pem(cfg.xds_root_cert, "XDS_ROOT_CA")
            metadata = [*auth_metadata(cfg.auth, cfg.cluster_id), *cfg.xds_headers]
            channel = secure_channel(self.address, root, cfg.alt_xds_hostname, "XDS_ADDRESS")
        except ControlPlaneError as e:
            raise _SetupFailed(str(e)) from None
        outgoing: asyncio.Queue[pb.DeltaDiscoveryRequest] = asyncio.Queue()
        for req in self.core.initial_requests():
            log.debug(
                "sending initial request type_url=%s resources=%d", req.type_url, len(req.initial_resource_versions)
            )
            outgoing.put_nowait(req)

        established = False
        stream_tasks = TaskGroup("xds-stream")
        call: Any = None
        first_status: _FirstStatus | None = None
        try:
            ads = channel.stream_stream(_ADS_METHOD, request_serializer=pb.DeltaDiscoveryRequest.SerializeToString)
            call = ads(metadata=metadata)
            first_status = _FirstStatus(call)
            self._outgoing = outgoing
            stream_tasks.spawn(self._write_requests(call, outgoing), "xds requests")
            await self._wait_connected(channel)
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    if not established:
                        # Upstream reconnects at once after a stream that ended cleanly; one that never said anything
                        # would make that a busy loop against the server, so it is retried with backoff instead.
                        raise _ConnectFailed(f"{self.address} ended the stream without sending a response")
                    return
                try:
                    response = pb.DeltaDiscoveryResponse.FromString(raw)
                except DecodeError as e:
                    where = describe_decode_error(pb.DeltaDiscoveryResponse, raw)
                    raise _BadResponse(
                        f"the server sent {len(raw)} bytes that are not a DeltaDiscoveryResponse ({where or e})"
                    ) from None
                if not established:
                    established = True
                    log.info("Stream established")
                self._handle(response, outgoing)
        except grpc.aio.AioRpcError as e:
            code, details = first_status.explain(e) if first_status is not None else (e.code(), e.details())
            if not established:
                raise _ConnectFailed(
                    f"gRPC connection error connecting to {self.address}: {_describe(code, details)}"
                ) from None
            if code is not e.code():
                raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details) from None
            raise
        finally:
            # Demands not answered on this stream stay in the core's known resources with no version, so the next
            # stream's initial request asks for them again (as upstream), and only there.
            self._outgoing = None
            await stream_tasks.cancel_all(timeout=1.0)
            if call is not None:
                call.cancel()
            await channel.close()

    @staticmethod
    async def _write_requests(call: Any, outgoing: asyncio.Queue[pb.DeltaDiscoveryRequest]) -> None:
        """Send queued requests in order; ends quietly when the call ends (the reader reports why)."""
        while True:
            req = await outgoing.get()
            try:
                await call.write(req)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
                log.debug("stopped sending requests: %s", e)
                return

    async def _wait_connected(self, channel: Any) -> None:
        """Return once the channel is connected or has failed (the call then reports why); time out after 5 s."""
        ready, failed = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                state = channel.get_state(try_to_connect=True)
                while state not in (ready, failed):
                    await channel.wait_for_state_change(state)
                    state = channel.get_state(try_to_connect=True)
        except TimeoutError:
            raise _ConnectFailed(
                f"gRPC connection error connecting to {self.address}: no connection after {CONNECT_TIMEOUT:g}s"
            ) from None

    def _handle(self, response: pb.DeltaDiscoveryResponse, outgoing: asyncio.Queue[pb.DeltaDiscoveryRequest]) -> None:
        """Translate one handled response into I/O: the reply, readiness, demand waiters. No awaits."""
        log.debug(
            "received response type_url=%s size=%d removes=%d",
            response.type_url,
            len(response.resources),
            len(response.removed_resources),
        )
        counts = self.messages.setdefault(response.type_url, [0, 0])
        counts[0] += 1
        counts[1] += sum(len(r.resource.value) for r in response.resources)  # payloads only, as upstream
        handled = self.core.receive(response)
        if not handled.known_type:
            log.error("unknown type type_url=%s; sending ACK", handled.type_url)
        if handled.signal is XdsSignal.NACK:
            log.error(
                "sending response type_url=%s nonce=%s type=NACK error=%s",
                handled.type_url,
                handled.nonce,
                handled.error_detail,
            )
        else:
            log.debug("sending response type_url=%s nonce=%s type=ACK", handled.type_url, handled.nonce)
        outgoing.put_nowait(handled.reply)
        if handled.became_ready and self._ready is not None:
            log.info("xDS initial sync complete")
            self._ready.release()
        for key in handled.demands_answered:
            for fut in self._demand_waiters.pop(key, []):
                if not fut.done():
                    fut.set_result(None)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:g}s"

"""The control <-> worker channel, sans-IO: frames, the messages both ends exchange, and request ids.

A frame is ``length (4 bytes, big-endian) | fd count (2 bytes) | payload``; the payload is one pickled message
(a dataclass below). Pickle is safe here and nowhere else: both ends are this program at the same version, and the
stream is one end of a ``socketpair`` made by the control process and inherited by exactly one worker, so no other
party can write to it (nothing on the network or the filesystem reaches it). It also keeps a 10,000-workload
snapshot cheap to encode (~60 ms) without a second schema of every state type to maintain.

File descriptors (a pod's network namespace, the load board, an accepted socket) travel beside the bytes as
``SCM_RIGHTS``: the sender attaches a frame's fds to the first byte of that frame, and Linux delivers them with (or
before) that byte, never after, so the decoder keeps received fds in arrival order and hands each frame the number
its header announces. A frame whose fds have not arrived by the time its last byte has is a broken channel (the
ancillary data was cut), not a reason to wait.

Who asks what (requests carry a ``request_id`` the answer repeats; each side numbers its own):

- control -> worker: :class:`Start`, :class:`Snapshot`, :class:`Delta`, :class:`CertificatePush`,
  :class:`AddPod` / :class:`DelPod` / :class:`HandIn` (answered by :class:`Ack`), :class:`Drain`, :class:`Query`
  and :class:`Profile` (answered by :class:`Reply`), :class:`SetLogLevel`, and the answers :class:`CertificateReply`,
  :class:`OnDemandDone` and :class:`Ack`;
- worker -> control: :class:`Ready`, :class:`Failed`, :class:`Resync`, :class:`CertificateRequest`,
  :class:`OnDemandRequest`, :class:`HandOff`, and the answers :class:`Ack` and :class:`Reply`.
"""

from __future__ import annotations

import contextlib
import copyreg
import itertools
import os
import pickle
import struct
import types
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ztunnel.config import Config, WorkloadInfo
from ztunnel.errors import ZtunnelError
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity
from ztunnel.inpod.netns import NetnsId
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import Endpoint
from ztunnel.state.workload import NamespacedHostname

HEADER = struct.Struct(">IH")
# A snapshot of 10,000 workloads and 1,000 services pickles to ~8 MiB; 256 MiB bounds a corrupt length field
# without ever limiting a real state.
MAX_FRAME = 256 << 20
# The most fds one frame carries (one: AddPod's netns, Start's load board, HandOff's and HandIn's socket); the
# receiver's ancillary buffer has room for this many.
MAX_FDS = 8


# State objects hold read-only mappings (MappingProxyType), which pickle cannot copy on its own: they travel as a
# dict and come back read-only. Registered once, for this process, when the channel is first imported.
def _read_only(items: dict[Any, Any]) -> types.MappingProxyType[Any, Any]:
    return types.MappingProxyType(items)


copyreg.pickle(types.MappingProxyType, lambda m: (_read_only, (dict(m),)))


class ChannelError(ZtunnelError):
    """The channel's bytes do not make sense: a bad frame, a message that does not decode, missing fds."""


# -- messages ------------------------------------------------------------------------------------------------------


class Message:
    """Base of every message; a message that answers a request also derives from :class:`Response`."""

    __slots__ = ()


class Request(Message):
    """A message whose answer (a :class:`Response` with the same ``request_id``) the sender waits for; the channel
    numbers it when it is sent (every subclass is a dataclass with a ``request_id`` field)."""

    request_id: int


class Response(Message):
    """The answer to the :class:`Request` with the same ``request_id``."""

    request_id: int


@dataclass(slots=True)
class Start(Message):
    """First message to a worker: which worker it is and the control process's configuration. With ``load_board``
    the frame carries the fd of the shared load board (:mod:`ztunnel.workers.balance`): the worker balances its
    inbound HBONE connections with the others."""

    index: int
    config: Config
    on_demand: bool = False  # XDS_ON_DEMAND with an xDS client: ask the control process for unknown addresses
    load_board: bool = False


@dataclass(slots=True)
class Snapshot(Message):
    """The whole state at ``generation``: applied as one replace-all batch. ``staged`` are the endpoints waiting for
    a service that is not known yet (they are not in any batch: the store derives them)."""

    generation: int
    update: StateUpdate
    staged: dict[NamespacedHostname, dict[str, Endpoint]] = field(default_factory=dict)


@dataclass(slots=True)
class Serve(Message):
    """The first xDS sync is in: accept connections. Until then a worker's listeners are bound (their backlog
    queues connections, as upstream's accept loops wait on the sync) but accept nothing. Sent once per worker."""


@dataclass(slots=True)
class Delta(Message):
    """One batch the control process applied, turning its state into ``generation`` (the previous one + 1)."""

    generation: int
    update: StateUpdate


@dataclass(frozen=True, slots=True)
class CertificateData:
    """A workload certificate as PEM text (the chain as istiod sends it, and the PKCS#8 key): x509 and key objects
    do not pickle. Kept in memory only; the private key never touches disk on either side."""

    chain: tuple[str, ...]
    key: str

    @classmethod
    def of(cls, cert: WorkloadCertificate) -> CertificateData:
        return cls(tuple(cert.full_chain_and_roots()), cert.key_pem())

    def certificate(self) -> WorkloadCertificate:
        return WorkloadCertificate.from_pem_chain(self.chain, self.key)


@dataclass(slots=True)
class CertificatePush(Message):
    """``identity`` has a new certificate (a rotation), or none any more (``data`` None: forgotten)."""

    identity: Identity
    data: CertificateData | None


@dataclass(slots=True)
class AddPod(Request):
    """Start ``uid``'s listeners in the network namespace whose fd comes with this frame; answered by an Ack."""

    uid: str
    info: WorkloadInfo
    request_id: int = 0


@dataclass(slots=True)
class DelPod(Request):
    """Close ``uid``'s listeners and connections; the Ack comes once they are closed."""

    uid: str
    request_id: int = 0


@dataclass(slots=True)
class Drain(Message):
    """Shut down: ``graceful`` gives connections ``deadline`` seconds, else everything closes at once."""

    graceful: bool
    deadline: float


@dataclass(slots=True)
class Query(Request):
    """Ask the worker for ``what``: ``connections`` (admin rows), ``metrics`` (metric families) or ``pods``
    (per-pod connections for the config dump). Answered by a Reply."""

    what: str
    request_id: int = 0


@dataclass(slots=True)
class Profile(Request):
    """The admin's profiling endpoints, for this worker (:mod:`ztunnel.profiling`): ``kind`` ``cpu`` (sample its
    stacks for ``seconds`` at ``frequency`` Hz), ``heap`` (a tracemalloc snapshot) or ``heap-profiling`` (switch
    tracemalloc per ``activate``). Answered by a Reply whose value is the folded-stack counts, the snapshot text, or
    whether heap profiling is on; or a :class:`~ztunnel.profiling.ProfileFailed`. The worker samples on a thread,
    so its event loop serves traffic meanwhile."""

    kind: str
    seconds: int = 0
    frequency: int = 0
    activate: bool | None = None
    request_id: int = 0


@dataclass(slots=True)
class SetLogLevel(Message):
    """The admin's ``/logging`` changed the log filter: the same change, in the worker."""

    reset: bool
    spec: str


@dataclass(slots=True)
class CertificateReply(Response):
    """The certificate a worker asked for, or why there is none (``error`` as the provider said it, ``reason`` the
    why alone)."""

    request_id: int
    identity: Identity
    data: CertificateData | None
    error: str | None = None
    reason: str | None = None


@dataclass(slots=True)
class OnDemandDone(Response):
    """The control plane answered the on-demand lookup; its result, if any, came before this as a Delta."""

    request_id: int


# Which proxy of a worker serves a handed-over connection: None for the dedicated proxy; in-pod, the pod's uid and
# the id of the network namespace the socket was accepted in (a pod re-added with a new namespace is another pod).
ProxyKey = tuple[str, NetnsId]


@dataclass(slots=True)
class HandIn(Request):
    """Serve the inbound HBONE connection whose accepted socket comes with this frame, on ``key``'s 15008 listener,
    as if this worker had accepted it (and never hand it on). Answered by an Ack before a byte of it is read: an
    error leaves the socket with the control process, which gives it to another worker."""

    key: ProxyKey | None
    origin: int  # the worker that accepted it
    request_id: int = 0


@dataclass(slots=True)
class Ready(Message):
    """The worker applied its snapshot (at ``generation``) and its listeners are up."""

    generation: int


@dataclass(slots=True)
class Failed(Message):
    """The worker cannot serve (e.g. a port in use) and exits; ``reason`` says why, for the control's log."""

    reason: str


@dataclass(slots=True)
class Resync(Message):
    """A delta did not follow the worker's generation (a bug): send a fresh snapshot."""

    have: int | None
    got: int


@dataclass(slots=True)
class CertificateRequest(Request):
    """The worker needs ``identity``'s certificate."""

    identity: Identity
    request_id: int = 0


@dataclass(slots=True)
class OnDemandRequest(Request):
    """``XDS_ON_DEMAND``: ask the control plane for this Address resource (``<network>/<ip>``, ``<namespace>/
    <hostname>`` or a workload UID; answered by OnDemandDone)."""

    name: str
    request_id: int = 0


@dataclass(slots=True)
class HandOff(Request):
    """This worker accepted an inbound HBONE connection (its socket comes with this frame, not a byte read) and
    asks for it to be served by worker ``target``. Answered by an Ack once some worker took it: no error when
    ``target`` did, else why not (it then went back to this worker, or another, as a HandIn)."""

    target: int
    key: ProxyKey | None
    request_id: int = 0


@dataclass(slots=True)
class Ack(Response):
    """Done (``error`` None) or failed, with why."""

    request_id: int
    error: str | None = None


@dataclass(slots=True)
class Reply(Response):
    """The answer to a Query."""

    request_id: int
    value: Any


# -- state ---------------------------------------------------------------------------------------------------------


def snapshot_of(state: ProxyState) -> Snapshot:
    """The whole of ``state`` as one message (at its current version)."""
    services = state.services
    return Snapshot(
        state.version,
        StateUpdate(
            workloads=list(state.workloads),
            services=list(services),
            policies=list(state.policies),
            replace_all=True,
        ),
        {k: dict(v) for k, v in services.staged.items()},
    )


def apply_snapshot(state: ProxyState, snapshot: Snapshot) -> None:
    """Make ``state`` what the snapshot describes, in one batch (its subscribers see one change)."""
    state.apply(snapshot.update)
    # Staged endpoints of services still unknown: not derivable from the workloads alone (a service removed after
    # listing its own endpoints restages them), so they are copied as they were.
    for key, endpoints in snapshot.staged.items():
        if state.services.get(key) is None:
            state.services.staged.setdefault(key, {}).update(endpoints)


# -- frames --------------------------------------------------------------------------------------------------------


def encode(msg: Message, fds: int = 0) -> bytes:
    """One frame carrying ``msg``; ``fds`` is how many fds the sender attaches to it."""
    if not 0 <= fds <= MAX_FDS:
        raise ChannelError(f"a frame carries at most {MAX_FDS} fds, not {fds}")
    payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > MAX_FRAME:
        raise ChannelError(f"{type(msg).__name__} is {len(payload)} bytes, over the {MAX_FRAME}-byte frame limit")
    return HEADER.pack(len(payload), fds) + payload


class Decoder:
    """Bytes and fds in, ``(message, fds)`` out, in order. The caller owns the fds it gets (and must close them);
    fds still queued when the decoder is closed are closed by it."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._fds: deque[int] = deque()

    def feed(self, data: bytes, fds: Sequence[int] = ()) -> list[tuple[Message, list[int]]]:
        """Take what one read returned; returns every message completed by it. Raises :class:`ChannelError`."""
        self._fds.extend(fds)
        buf = self._buf
        buf += data
        out: list[tuple[Message, list[int]]] = []
        off = 0  # frames are decoded in place and the buffer shifted once, whatever their number
        try:
            while len(buf) - off >= HEADER.size:
                length, nfds = HEADER.unpack_from(buf, off)
                if length > MAX_FRAME or nfds > MAX_FDS:
                    raise ChannelError(f"bad frame header: {length} bytes, {nfds} fds (limits {MAX_FRAME}, {MAX_FDS})")
                end = off + HEADER.size + length
                if len(buf) < end:
                    break
                if len(self._fds) < nfds:
                    raise ChannelError(
                        f"a frame announced {nfds} fds but {len(self._fds)} arrived (ancillary data cut?)"
                    )
                taken = [self._fds.popleft() for _ in range(nfds)]
                start, off = off + HEADER.size, end  # the frame is consumed, whether it decodes or not
                try:
                    with memoryview(buf) as view, view[start:end] as payload:
                        msg = pickle.loads(payload)
                except Exception as e:
                    _close(taken)
                    raise ChannelError(f"a frame of {length} bytes does not decode: {type(e).__name__}: {e}") from None
                if not isinstance(msg, Message):
                    _close(taken)
                    raise ChannelError(f"a frame decoded to {type(msg).__name__}, which is not a channel message")
                out.append((msg, taken))
        finally:
            del buf[:off]
        return out

    @property
    def pending(self) -> int:
        """Bytes of a frame not complete yet (nonzero at EOF: the peer died mid-frame)."""
        return len(self._buf)

    def close(self) -> None:
        _close(self._fds)
        self._fds.clear()
        self._buf.clear()


def _close(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class RequestIds:
    """Numbers one side's requests; answers are matched by the number."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def next(self) -> int:
        return next(self._next)


def describe(msg: Message) -> str:
    """A short name for logs: the type and its request id, if any."""
    rid = getattr(msg, "request_id", None)
    return type(msg).__name__ if rid is None else f"{type(msg).__name__}#{rid}"


__all__ = [
    "HEADER",
    "MAX_FDS",
    "MAX_FRAME",
    "Ack",
    "AddPod",
    "CertificateData",
    "CertificatePush",
    "CertificateReply",
    "CertificateRequest",
    "ChannelError",
    "Decoder",
    "DelPod",
    "Delta",
    "Drain",
    "Failed",
    "HandIn",
    "HandOff",
    "Message",
    "OnDemandDone",
    "OnDemandRequest",
    "ProxyKey",
    "Query",
    "Ready",
    "Reply",
    "Request",
    "RequestIds",
    "Response",
    "Resync",
    "SetLogLevel",
    "Snapshot",
    "Start",
    "apply_snapshot",
    "describe",
    "encode",
    "snapshot_of",
]

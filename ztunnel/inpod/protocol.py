"""ZDS, the protocol between istio-cni's node agent and ztunnel over a SOCK_SEQPACKET unix socket (sans-IO).

Upstream ``inpod/protocol.rs``: one raw protobuf a packet (no length prefix), read into a 1024-byte buffer; a
truncated packet or control message is an error. ztunnel says ``ZdsHello{V1}`` first. An ``add`` carries exactly one
fd (the pod's network namespace) in ``SCM_RIGHTS``; every other message carries none. Every request is answered with
``WorkloadResponse{ack}``, whose non-empty ``error`` is a NACK.

Both roles live here, as h11 and h2 serve client and server, so the two sides cannot drift apart:

* ztunnel (the client, :mod:`ztunnel.inpod.workloadmanager`) sends :func:`encode_hello`, turns each request packet
  into a :class:`WorkloadMessage` with :func:`decode_request` and answers with :func:`encode_ack`;
* the node agent (the server: istio-cni, or :mod:`ztunnel.standins.cni` here) checks the hello with
  :func:`decode_hello`, sends :func:`encode_add`, :func:`encode_keep`, :func:`encode_del` and
  :func:`encode_snapshot_sent`, and reads each answer with :func:`decode_ack`.

Bytes in, values out (and the reverse); no sockets.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from xds.istio.workload.zds import zds_pb2
from ztunnel.config import WorkloadInfo
from ztunnel.errors import ZtunnelError
from ztunnel.xds.wire import describe_decode_error

MAX_PACKET = 1024  # upstream's read buffer; a longer message arrives truncated (MSG_TRUNC) and is refused


class ZdsMessageError(ZtunnelError):
    """A malformed packet. ztunnel answers it with a NACK naming the problem; the node agent closes the connection."""


@dataclass(frozen=True, slots=True)
class AddWorkload:
    uid: str
    info: WorkloadInfo | None
    netns_fd: int  # owned by the receiver now


@dataclass(frozen=True, slots=True)
class KeepWorkload:
    uid: str


@dataclass(frozen=True, slots=True)
class DelWorkload:
    uid: str


@dataclass(frozen=True, slots=True)
class SnapshotSent:
    pass


WorkloadMessage = AddWorkload | KeepWorkload | DelWorkload | SnapshotSent


# -- ztunnel's side: hello, requests in, acks out --------------------------------------------------------------------


def encode_hello() -> bytes:
    """``ZdsHello{version: V1}``, ztunnel's first packet on a new connection."""
    return zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString()


def encode_ack(error: str = "") -> bytes:
    """``WorkloadResponse{ack}``: an ack, or a NACK when ``error`` is not empty."""
    return zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=error)).SerializeToString()


def decode_request(data: bytes, fds: list[int], flags: int) -> WorkloadMessage:
    """One received packet (bytes, fds from SCM_RIGHTS, recvmsg flags) as a message. Closes fds it does not keep.

    Raises :class:`ZdsMessageError` with upstream's wording for truncation, a missing or unexpected fd, a missing
    payload or bytes that are not a ``WorkloadRequest``.
    """
    keep: int | None = None
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ZdsMessageError("received truncated message")
        req = zds_pb2.WorkloadRequest()
        try:
            req.ParseFromString(data)
        except DecodeError as e:
            where = describe_decode_error(zds_pb2.WorkloadRequest, data)  # upb does not say where
            raise ZdsMessageError(f"invalid WorkloadRequest ({len(data)} bytes): {where or e}") from None
        kind = req.WhichOneof("payload")
        if kind is None:
            raise ZdsMessageError("no payload")
        if kind == "add":
            if not fds:
                raise ZdsMessageError("No control message")
            if len(fds) > 1:
                raise ZdsMessageError(f"expected exactly one fd with an add, got {len(fds)}")
            keep = fds[0]
            a = req.add
            info = None
            if a.HasField("workload_info"):
                wi = a.workload_info
                info = WorkloadInfo(name=wi.name, namespace=wi.namespace, service_account=wi.service_account)
            return AddWorkload(a.uid, info, keep)
        if fds:
            raise ZdsMessageError("Unexpected control message")
        if kind == "keep":
            return KeepWorkload(req.keep.uid)
        if kind == "del":
            return DelWorkload(getattr(req, "del").uid)
        return SnapshotSent()
    finally:
        for fd in fds:
            if fd != keep:
                close_fd(fd)


def close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


# -- the node agent's side: hello in, requests out, acks in ----------------------------------------------------------


def decode_hello(data: bytes) -> None:
    """Raise :class:`ZdsMessageError` unless ``data`` is ``ZdsHello{version: V1}``."""
    hello = zds_pb2.ZdsHello()
    try:
        hello.ParseFromString(data)
    except DecodeError as e:
        raise ZdsMessageError(f"malformed ZdsHello ({len(data)} bytes): {e}") from e
    if hello.version != zds_pb2.V1:
        raise ZdsMessageError(f"unsupported ZDS version {hello.version} (this agent speaks V1)")


def encode_add(uid: str, info: WorkloadInfo | None) -> bytes:
    """``WorkloadRequest{add}``; the pod's netns fd goes beside it in ``SCM_RIGHTS``."""
    req = zds_pb2.WorkloadRequest()
    req.add.uid = uid
    if info is not None:
        req.add.workload_info.name = info.name
        req.add.workload_info.namespace = info.namespace
        req.add.workload_info.service_account = info.service_account
    return req.SerializeToString()


def encode_keep(uid: str) -> bytes:
    """``WorkloadRequest{keep}``: in a snapshot, a pod whose netns can no longer be opened."""
    req = zds_pb2.WorkloadRequest()
    req.keep.uid = uid
    return req.SerializeToString()


def encode_del(uid: str) -> bytes:
    req = zds_pb2.WorkloadRequest()
    getattr(req, "del").uid = uid  # `del` is a Python keyword
    return req.SerializeToString()


def encode_snapshot_sent() -> bytes:
    """``WorkloadRequest{snapshot_sent}``: every pod of the snapshot has been sent."""
    req = zds_pb2.WorkloadRequest()
    req.snapshot_sent.SetInParent()
    return req.SerializeToString()


def decode_ack(data: bytes) -> str:
    """The ack's error: "" for an ack, the reason for a NACK. :class:`ZdsMessageError` if ``data`` is no ack."""
    resp = zds_pb2.WorkloadResponse()
    try:
        resp.ParseFromString(data)
    except DecodeError as e:
        raise ZdsMessageError(f"malformed WorkloadResponse ({len(data)} bytes): {e}") from e
    if resp.WhichOneof("payload") != "ack":
        raise ZdsMessageError("WorkloadResponse without an ack")
    return resp.ack.error

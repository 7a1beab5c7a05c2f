"""ZDS, the protocol istio-cni's node agent speaks to ztunnel over a SOCK_SEQPACKET unix socket (sans-IO part).

Upstream ``inpod/protocol.rs``: one raw protobuf a packet (no length prefix), read into a 1024-byte buffer; a
truncated packet or control message is an error. ztunnel says ``ZdsHello{V1}`` first. An ``add`` carries exactly one
fd (the pod's network namespace) in ``SCM_RIGHTS``; every other message carries none. Every request is answered with
``WorkloadResponse{ack}``, whose non-empty ``error`` is a NACK.

This module turns packets into :class:`WorkloadMessage` values and builds the replies; no sockets.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from xds.istio.workload.zds import zds_pb2
from ztunnel.config import WorkloadInfo
from ztunnel.xds.wire import describe_decode_error

MAX_PACKET = 1024  # upstream's read buffer; a longer message arrives truncated (MSG_TRUNC) and is refused


class ZdsMessageError(Exception):
    """A malformed packet: answered with a NACK naming the problem."""


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


def hello() -> bytes:
    return zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString()


def ack(error: str = "") -> bytes:
    return zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=error)).SerializeToString()


def decode(data: bytes, fds: list[int], flags: int) -> WorkloadMessage:
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

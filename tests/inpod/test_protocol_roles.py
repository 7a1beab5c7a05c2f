"""Both roles of the ZDS codec in one sans-IO module (``ztunnel.inpod.protocol``), as h11 and h2 serve client and
server: what the node agent encodes ztunnel decodes, and the other way round. Bytes only, no sockets.

The node agent's side is also pinned against hand-encoded bytes of ``zds.proto``, so the round trip cannot pass by
both sides agreeing on a wrong encoding.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from xds.istio.workload.zds import zds_pb2
from ztunnel.config import WorkloadInfo
from ztunnel.inpod.protocol import (
    AddWorkload,
    DelWorkload,
    KeepWorkload,
    SnapshotSent,
    ZdsMessageError,
    decode_ack,
    decode_hello,
    decode_request,
    encode_ack,
    encode_add,
    encode_del,
    encode_hello,
    encode_keep,
    encode_snapshot_sent,
)

INFO = WorkloadInfo(name="n", namespace="ns", service_account="sa")


@pytest.fixture
def fd() -> Iterator[int]:
    """A real descriptor standing in for a pod's netns (the codec only passes it through)."""
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    yield fd
    os.close(fd)  # decode_request keeps it (the receiver owns it): still open


def test_node_agent_requests_decode_as_ztunnel_reads_them(fd: int) -> None:
    assert decode_request(encode_add("uid-1", INFO), [fd], 0) == AddWorkload("uid-1", INFO, fd)
    assert decode_request(encode_add("uid-2", None), [fd], 0) == AddWorkload("uid-2", None, fd)
    assert decode_request(encode_keep("uid-1"), [], 0) == KeepWorkload("uid-1")
    assert decode_request(encode_del("uid-1"), [], 0) == DelWorkload("uid-1")
    assert decode_request(encode_snapshot_sent(), [], 0) == SnapshotSent()


def test_ztunnel_replies_decode_as_the_node_agent_reads_them() -> None:
    decode_hello(encode_hello())  # no error: V1
    assert decode_ack(encode_ack()) == ""
    assert decode_ack(encode_ack("failed to start proxy")) == "failed to start proxy"


def test_node_agent_encoding_matches_zds_proto() -> None:
    # WorkloadRequest.del is field 2 and DelWorkload.uid is field 2: tag 0x12 twice.
    assert encode_del("u") == b"\x12\x03\x12\x01u"
    assert encode_keep("u") == b"\x2a\x03\x0a\x01u"  # keep is field 5
    assert encode_snapshot_sent() == b"\x1a\x00"  # an empty SnapshotSent, present
    req = zds_pb2.WorkloadRequest.FromString(encode_add("u", INFO))
    assert req.WhichOneof("payload") == "add"
    assert (req.add.uid, req.add.workload_info.name, req.add.workload_info.namespace) == ("u", "n", "ns")
    assert req.add.workload_info.service_account == "sa"
    assert not zds_pb2.WorkloadRequest.FromString(encode_add("u", None)).add.HasField("workload_info")


def test_node_agent_refuses_what_is_not_a_v1_hello_or_an_ack() -> None:
    decode_hello(zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString())
    with pytest.raises(ZdsMessageError, match="unsupported ZDS version 0"):
        decode_hello(b"")
    with pytest.raises(ZdsMessageError, match="malformed ZdsHello"):
        decode_hello(b"\xff\xff")
    assert decode_ack(b"\x0a\x00") == ""
    with pytest.raises(ZdsMessageError, match="without an ack"):
        decode_ack(b"")
    with pytest.raises(ZdsMessageError, match="malformed WorkloadResponse"):
        decode_ack(b"\xff\xff")

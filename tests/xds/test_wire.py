"""``describe_decode_error``: where a protobuf payload is broken, for the NACKs of xDS and ZDS.

A differential fuzz against upb: for random, schema-built and mutated payloads, whenever upb refuses the bytes the
walk finds the problem (so every refusal gets a field path and byte offset). The walk is stricter in one corner
the fuzzing found: upb accepts a field number 0 followed by a byte inside a message with no fields
(``snapshot_sent`` = ``1a 02 00 00``), the walk does not; it is only asked after upb refused, so that is harmless.
"""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import fuzz_settings, mutated, protobufs
from xds.envoy.service.discovery.v3 import discovery_pb2 as pb
from xds.istio.security import authorization_pb2 as sec
from xds.istio.workload import workload_pb2 as wl
from xds.istio.workload.zds import zds_pb2
from ztunnel.xds.wire import describe_decode_error

TYPES: list[type[Message]] = [wl.Address, sec.Authorization, zds_pb2.WorkloadRequest, pb.DeltaDiscoveryResponse]


def payloads(cls: type[Message]) -> st.SearchStrategy[bytes]:
    valid = protobufs(cls, depth=3).map(lambda m: m.SerializeToString())
    return st.one_of(st.binary(max_size=60), valid, mutated(valid, max_ops=4))


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
def test_walk_agrees_with_upb(cls: type[Message]) -> None:
    @fuzz_settings(500)
    @given(payloads(cls))
    def run(data: bytes) -> None:
        try:
            cls.FromString(data)
            refused = False
        except DecodeError:
            refused = True
        where = describe_decode_error(cls, data)
        if refused:
            assert where is not None and " at byte " in where, data
        else:
            assert where is None or "invalid field number 0" in where, (data, where)  # upb's one leniency

    run()


@pytest.mark.parametrize(
    ("cls", "data", "expected"),
    [
        (
            zds_pb2.WorkloadRequest,
            b"\x0a\x05\x0a\x01u",
            "add at byte 0: length 5 runs past the end of its message (3 left)",
        ),
        (
            zds_pb2.WorkloadRequest,
            b"\x0a\x06\x12\x04\x0a\x02\xc3\x28",
            "add.workload_info.name at byte 6: not valid UTF-8",
        ),
        (zds_pb2.WorkloadRequest, b"\x08", "add at byte 1: truncated varint"),
        (zds_pb2.WorkloadRequest, b"\x00\x01", "top level at byte 0: invalid field number 0"),
        (zds_pb2.WorkloadRequest, b"\x0e", "add at byte 0: invalid wire type 6"),
        (zds_pb2.WorkloadRequest, b"\xf8\x01\xff", "field 31 at byte 2: truncated varint"),
        (wl.Address, b"\x0a\x03\x22\x02\x01", "workload.network at byte 2: length 2 runs past the end of its message"),
        (sec.Authorization, b"\x2a\x04\x0a\x02\x12\x00\x2a\x02\x0a\x05", "rules.clauses at byte 8: length 5"),
        (sec.Authorization, b"\x0c", "name at byte 0: end of a group that was not started"),
        (sec.Authorization, b"\x0b\x10\x01", "name at byte 3: group 1 never ended"),
    ],
)
def test_messages_name_the_field_and_byte(cls: type[Message], data: bytes, expected: str) -> None:
    with pytest.raises(DecodeError):
        cls.FromString(data)
    where = describe_decode_error(cls, data)
    assert where is not None and expected in where, where


def test_deep_nesting_is_named() -> None:
    # The schema nests only a few levels; groups nest as deep as the bytes say.
    data = b"\x0b" * 150 + b"\x0c" * 150
    where = describe_decode_error(sec.Authorization, data)
    assert where is not None and "nested deeper than 100" in where
    with pytest.raises(DecodeError):
        sec.Authorization.FromString(data)

"""What the fuzz tests (``tests/**/test_*_fuzz.py``) share: settings that follow the Hypothesis profile, a byte
mutator and protobuf messages built from their descriptors (structure-aware inputs), and an in-process ztunnel on
its own event-loop thread.

Bounded runs (``make test``, the default profile): each test's own example count, derandomized so every run feeds
the same inputs and a failure reproduces, no example database. ``make fuzz`` (``HYPOTHESIS_PROFILE=fuzz``,
registered in ``tests/conftest.py``): every count multiplied by the profile's ``max_examples`` / 100, random
inputs, failures saved in ``.hypothesis/`` and replayed first on the next run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import uvloop
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ztunnel.testing import running_app

T = TypeVar("T")


def fuzzing() -> bool:
    return settings.get_current_profile_name() == "fuzz"


# A live test runs its examples against a listener: bounded at 300 s in `make test`, unbounded under `make fuzz`.
LIVE_TIMEOUT = 0 if fuzzing() else 300


def fuzz_settings(examples: int) -> settings:
    """``examples`` in ``make test``; ``examples`` x ``max_examples / 100`` under ``make fuzz``."""
    if fuzzing():
        profile = settings.default
        assert profile is not None
        return settings(profile, max_examples=examples * max(1, profile.max_examples // 100))
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


# Bytes that sit on boundaries of the formats under test: lengths, versions, enum numbers, varint continuation.
_EDGE_BYTES = st.sampled_from([0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x07, 0x08, 0x0A, 0x7F, 0x80, 0xFE, 0xFF])


@st.composite
def mutated(draw: st.DrawFn, seeds: st.SearchStrategy[bytes], max_ops: int = 4) -> bytes:
    """A seed (a valid message) with up to ``max_ops`` byte-level edits: overwrite, insert, delete, truncate,
    duplicate a slice. Edits near the start are as likely as anywhere: headers are where parsers decide."""
    data = bytearray(draw(seeds))
    for _ in range(draw(st.integers(0, max_ops))):
        op = draw(st.sampled_from(["set", "set", "insert", "delete", "truncate", "duplicate", "append"]))
        at = draw(st.integers(0, len(data)))
        byte = draw(st.one_of(_EDGE_BYTES, st.integers(0, 255)))
        if op == "set" and at < len(data):
            data[at] = byte
        elif op == "insert":
            data[at:at] = bytes([byte]) * draw(st.integers(1, 4))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[at:]
        elif op == "duplicate":
            end = draw(st.integers(at, len(data)))
            data[end:end] = data[at:end]
        elif op == "append":
            data += draw(st.binary(max_size=16))
    return bytes(data)


class AppThread:
    """An in-process ztunnel (:func:`ztunnel.testing.running_app`) on its own uvloop thread, so a synchronous
    Hypothesis test can drive it with blocking sockets. Unhandled loop errors are collected in ``errors``."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.loop = uvloop.new_event_loop()
        self.errors: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-app", daemon=True)
        self._ctx: Any = None
        self.app: Any = None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 20) -> T:
        """Run ``coro`` on the app's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> AppThread:
        self.loop.set_exception_handler(lambda _loop, ctx: self.errors.append(ctx))
        self.thread.start()
        self._ctx = running_app(self.env)
        self.app = self.call(self._ctx.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self._ctx.__aexit__(None, None, None), 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()


def errors_logged(records: list[logging.LogRecord]) -> list[str]:
    """Log records that mean a bug rather than a refused input: ERROR and above, and anything with a traceback."""
    return [r.getMessage() for r in records if r.levelno >= logging.ERROR or r.exc_info]


# -- protobuf messages from their descriptors ------------------------------------------------------------------------

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# Ports and counts sit on these edges: 0, 1, a real port, the last port, the first non-port, the 32-bit limits.
_INT_EDGES = [0, 1, 80, 8080, 15008, 65535, 65536, 2**31 - 1, 2**32 - 1, -1]


def _scalar(fd: FieldDescriptor, strings: st.SearchStrategy[str], blobs: st.SearchStrategy[bytes]) -> Any:
    t = fd.type
    if t == FieldDescriptor.TYPE_STRING:
        return strings
    if t == FieldDescriptor.TYPE_BYTES:
        return blobs
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_ENUM:
        assert fd.enum_type is not None
        known = [v.number for v in fd.enum_type.values]
        # proto3 enums are open: a number the schema does not define survives decoding and must be handled.
        return st.one_of(st.sampled_from(known), st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(allow_nan=True, width=32 if t == FieldDescriptor.TYPE_FLOAT else 64)
    lo, hi = _INT_RANGES[t]
    return st.one_of(st.sampled_from([e for e in _INT_EDGES if lo <= e <= hi]), st.integers(lo, hi))


_TEXT = st.text(max_size=12)
_BLOBS = st.binary(max_size=20)


def protobufs(
    cls: type[Message],
    strings: st.SearchStrategy[str] = _TEXT,
    blobs: st.SearchStrategy[bytes] = _BLOBS,
    depth: int = 4,
) -> st.SearchStrategy[Message]:
    """Messages of ``cls`` with any subset of fields set, to any value their type allows (unknown enum numbers,
    out-of-range ports, odd-length IP bytes...), at most one member of each oneof, nested ``depth`` levels."""

    @st.composite
    def build(draw: st.DrawFn, descriptor: Any, level: int) -> Message:
        msg = message_factory.GetMessageClass(descriptor)()
        chosen_oneofs = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in descriptor.oneofs}
        for fd in descriptor.fields:
            if fd.containing_oneof is not None and chosen_oneofs[fd.containing_oneof.name] != fd.name:
                continue
            is_message = fd.type == FieldDescriptor.TYPE_MESSAGE
            if is_message and level >= depth:
                continue
            if fd.containing_oneof is None and not draw(st.booleans()):
                continue
            if is_message and fd.message_type.GetOptions().map_entry:
                key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
                target = getattr(msg, fd.name)
                for _ in range(draw(st.integers(0, 3))):
                    key = draw(_scalar(key_fd, strings, blobs))
                    if value_fd.type == FieldDescriptor.TYPE_MESSAGE:
                        target[key].CopyFrom(draw(build(value_fd.message_type, level + 1)))
                    else:
                        target[key] = draw(_scalar(value_fd, strings, blobs))
            elif is_message and fd.is_repeated:
                for _ in range(draw(st.integers(0, 3))):
                    getattr(msg, fd.name).add().CopyFrom(draw(build(fd.message_type, level + 1)))
            elif is_message:
                getattr(msg, fd.name).CopyFrom(draw(build(fd.message_type, level + 1)))
            elif fd.is_repeated:
                getattr(msg, fd.name).extend(draw(st.lists(_scalar(fd, strings, blobs), max_size=3)))
            else:
                setattr(msg, fd.name, draw(_scalar(fd, strings, blobs)))
        return msg

    return build(cls.DESCRIPTOR, 0)

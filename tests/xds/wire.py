# mypy: disable-error-code="import-untyped"
"""A tiny, independent protobuf wire-format encoder for building expected bytes by hand.

It knows nothing about the generated classes: field numbers and wire types are spelled out by the caller,
so comparing its output with ``SerializeToString()`` pins the schema's numbers and types.
"""

from __future__ import annotations

from google.protobuf.message import Message

VARINT = 0
I64 = 1
LEN = 2
I32 = 5


def varint(value: int) -> bytes:
    """Base-128 varint; negative values use their 64-bit two's complement, as protobuf int32/int64 do."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint(field_number << 3 | wire_type)


def vint(field_number: int, value: int) -> bytes:
    """A varint field (int32/int64/uint32/bool/enum)."""
    return tag(field_number, VARINT) + varint(value)


def ld(field_number: int, payload: bytes | str) -> bytes:
    """A length-delimited field (string/bytes/embedded message/packed repeated)."""
    data = payload.encode() if isinstance(payload, str) else payload
    return tag(field_number, LEN) + varint(len(data)) + data


def packed(field_number: int, values: list[int]) -> bytes:
    """A packed repeated varint field (proto3's default for repeated scalars)."""
    return ld(field_number, b"".join(varint(v) for v in values))


def assert_wire(message: Message, expected: bytes) -> None:
    """``message`` serializes to exactly ``expected``, and ``expected`` parses back to an equal message
    with nothing left over as unknown fields."""
    got = message.SerializeToString(deterministic=True)
    assert got == expected, f"\n got      {got!r}\n expected {expected!r}"
    parsed = type(message).FromString(expected)
    assert parsed == message
    assert parsed.SerializeToString(deterministic=True) == expected
    # Unknown fields survive a parse/serialize round trip; dropping them must change nothing.
    known_only = type(message)()
    known_only.CopyFrom(parsed)
    known_only.DiscardUnknownFields()
    assert known_only.SerializeToString(deterministic=True) == expected, "bytes contain fields not in the schema"

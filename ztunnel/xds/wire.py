"""Where a protobuf payload is broken: the field path and byte offset for a message protobuf refused.

The protobuf runtime (upb) says only "Wire format was corrupt" or "String field had bad UTF-8". That is no help to
whoever runs the control plane or the node agent, so after a ``DecodeError`` the payload is walked again here,
with the message's descriptor, to name the first problem::

    add.workload_info.name at byte 9: not valid UTF-8
    resources at byte 4: length 300 runs past the end of its message (12 left)

The walk checks what upb checks: keys, varints, lengths, group nesting, UTF-8 in ``string`` fields, packed varints
and nesting depth (upb's limit is 100). Fields it does not know are walked by wire type only, as upb keeps them.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

__all__ = ["MAX_DEPTH", "describe_decode_error"]

MAX_DEPTH = 100  # upb's default recursion limit for nested messages and groups
_VARINT_TYPES = {
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_BOOL,
    FieldDescriptor.TYPE_ENUM,
}
_FIXED = {FieldDescriptor.TYPE_FIXED32: 4, FieldDescriptor.TYPE_SFIXED32: 4, FieldDescriptor.TYPE_FLOAT: 4}
_FIXED |= {FieldDescriptor.TYPE_FIXED64: 8, FieldDescriptor.TYPE_SFIXED64: 8, FieldDescriptor.TYPE_DOUBLE: 8}


class _Broken(Exception):
    def __init__(self, path: str, at: int, problem: str) -> None:
        super().__init__(f"{path or 'top level'} at byte {at}: {problem}")


def describe_decode_error(message_type: type[Message], data: bytes) -> str | None:
    """``"<field path> at byte <n>: <problem>"`` for the first problem in ``data`` read as a ``message_type``, or
    None if none is found."""
    try:
        _walk(message_type.DESCRIPTOR, memoryview(data), 0, len(data), "", 0)
    except _Broken as e:
        return str(e)
    return None


def _varint(buf: memoryview, pos: int, end: int, path: str) -> tuple[int, int]:
    value, shift, start = 0, 0, pos
    while True:
        if pos >= end:
            raise _Broken(path, start, "truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise _Broken(path, start, "varint longer than 10 bytes")


# Descriptors are typed Any: upb's and the pure-Python ones are different classes with one interface.
def _name(descriptor: Any, number: int, path: str) -> tuple[str, FieldDescriptor | None]:
    field = descriptor.fields_by_number.get(number) if descriptor is not None else None
    label = field.name if field is not None else f"field {number}"
    if field is not None and descriptor is not None and descriptor.GetOptions().map_entry:
        label = "key" if number == 1 else "value"
    return (f"{path}.{label}" if path else label), field


def _walk(descriptor: Any, buf: memoryview, pos: int, end: int, path: str, depth: int, group: int = 0) -> int:
    """Walk fields from ``pos`` to ``end``; inside group ``group``, up to and including its end key. Returns the
    position after what was walked."""
    if depth > MAX_DEPTH:
        raise _Broken(path, pos, f"nested deeper than {MAX_DEPTH} messages")
    while pos < end:
        start = pos
        key, pos = _varint(buf, pos, end, path)
        number, wire_type = key >> 3, key & 7
        if number == 0 or number > 2**29 - 1:
            raise _Broken(path, start, f"invalid field number {number}")
        name, field = _name(descriptor, number, path)
        if wire_type == 0:
            _, pos = _varint(buf, pos, end, name)
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            if pos + size > end:
                raise _Broken(name, start, f"{size}-byte value runs past the end ({end - pos} left)")
            pos += size
        elif wire_type == 2:
            length, pos = _varint(buf, pos, end, name)
            if length > end - pos:
                raise _Broken(name, start, f"length {length} runs past the end of its message ({end - pos} left)")
            _check_payload(field, buf, pos, pos + length, name, start, depth)
            pos += length
        elif wire_type == 3:
            sub = field.message_type if field is not None and field.type == FieldDescriptor.TYPE_GROUP else None
            pos = _walk(sub, buf, pos, end, name, depth + 1, group=number)
        elif wire_type == 4:
            if number != group:
                raise _Broken(name, start, "end of a group that was not started")
            return pos
        else:
            raise _Broken(name, start, f"invalid wire type {wire_type}")
    if group:
        raise _Broken(path, pos, f"group {group} never ended")
    return pos


def _check_payload(
    field: FieldDescriptor | None, buf: memoryview, pos: int, end: int, name: str, at: int, depth: int
) -> None:
    if field is None:
        return
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        _walk(field.message_type, buf, pos, end, name, depth + 1)
    elif field.type == FieldDescriptor.TYPE_STRING:
        try:
            bytes(buf[pos:end]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Broken(name, pos + e.start, "not valid UTF-8") from None
    elif field.is_repeated and field.type in _VARINT_TYPES:
        while pos < end:  # packed
            _, pos = _varint(buf, pos, end, name)
    elif field.is_repeated and field.type in _FIXED and (end - pos) % _FIXED[field.type]:
        raise _Broken(name, at, f"packed length {end - pos} is not a multiple of {_FIXED[field.type]}")

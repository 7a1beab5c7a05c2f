"""Every change ztunnel makes to another library's internals, in one place.

Two kinds:

* **Process-wide patches**, installed by :func:`apply`: module attributes of hpack, hyperframe and aiohttp are
  replaced. :func:`apply` runs once, at start (:meth:`ztunnel.app.App.start`, so the ``ztunnel`` command, the demo
  and every in-process app), and in the test session (``tests/conftest.py``) and the micro-benchmarks
  (``bench/micro/conftest.py``). Nothing is patched on import: importing any ztunnel module, the sans-IO HBONE core
  included, leaves the other libraries as they are (``tests/test_thirdparty.py`` checks it in a fresh interpreter).
* **Per-connection adjustments** of h2's internals (:func:`adjust_h2`), made by the HBONE core on each
  ``H2Connection`` it creates; they touch that object only.

Each patch names the versions of its library it was written for: from the lowest that ``pyproject.toml`` admits
(read there) to the next major version, exclusive. Outside that range a patch is not applied and one warning says
which and why; a patch that correctness depends on stops startup instead (:class:`PatchError`). Inside it, each
install still checks the structure it replaces and fails loudly if that is missing. ``tests/test_thirdparty.py``
has one test per patch that fails when the internals it relies on change.

Nothing of ztunnel is imported here: any layer may use this module.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
import struct
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ztunnel.errors import ZtunnelError

log = logging.getLogger("ztunnel.thirdparty")


class PatchError(ZtunnelError):
    """A patch that correctness depends on cannot be applied to the installed library; the message says which
    library, which version and what to do."""


@dataclass(frozen=True, slots=True)
class Patch:
    """One change to another library, and the versions of that library it was written for."""

    name: str  # what is replaced
    distribution: str  # the package whose version is checked
    lowest: tuple[int, ...]  # the oldest version checked (inclusive)
    below: tuple[int, ...]  # the first version not known (exclusive)
    required: bool  # correctness depends on it: outside the range, startup fails
    without: str  # what is lost when it is not applied (the warning's "why")

    @property
    def range(self) -> str:
        return f">={_dotted(self.lowest)},<{_dotted(self.below)}"

    def unsupported(self, version: str | None) -> str | None:
        """Why this patch must not be applied to ``version`` of its library (None: unknown), or None if it may."""
        if version is None:
            return f"{self.distribution}'s version is unknown (no package metadata); written for {self.range}"
        if self.lowest <= _release(version) < self.below:
            return None
        return f"{self.distribution} {version} is outside the versions it was written for ({self.range})"


def _release(version: str) -> tuple[int, ...]:
    """``"4.2.0"`` -> ``(4, 2, 0)``; pre-release and local suffixes (``rc1``, ``+x``) are ignored."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- process-wide patches ---------------------------------------------------------------------------------------

HPACK_DEBUG_LOG = Patch(
    name="hpack.hpack.log (a no-op logger)",
    distribution="hpack",
    lowest=(4, 0),  # h2 4.1 (pyproject's lowest) needs hpack>=4.0; checked in 4.0.0 and 4.2.0
    below=(5,),
    required=False,  # speed only: without it hpack logs nothing either (DEBUG is off), it just costs more
    without="hpack's per-field DEBUG calls stay (~5% of a proxy's CPU per new connection)",
)


class _NoLog:
    """hpack logs every integer and header field it encodes or decodes at DEBUG: about 20 ``Logger.debug`` calls per
    CONNECT, each also an ``isEnabledFor`` check, ~5% of a proxy's CPU per new connection (cProfile, connection-rate
    benchmark; with plain literals below: CPU per new connection ztunnel A 403 -> 341 µs, B 457 -> 390 µs). Nothing
    in ztunnel wants those lines, so hpack's module logger is replaced by this no-op. hpack only ever calls
    ``log.debug`` on it (tests/test_thirdparty.py reads hpack's source to keep that true)."""

    def debug(self, *args: object, **kwargs: object) -> None:
        pass


def _install_hpack_debug_log() -> None:
    import hpack.hpack

    if not isinstance(getattr(hpack.hpack, "log", None), logging.Logger | _NoLog):
        raise PatchError(f"hpack.hpack.log is not a logger in hpack {installed_version('hpack')}")
    hpack.hpack.log = _NoLog()  # type: ignore[assignment]


FRAME_REPR = Patch(
    name="hyperframe.frame.Frame.__repr__ (type and stream id only)",
    distribution="hyperframe",
    lowest=(6, 0),  # h2 4.1 needs hyperframe>=6.0; checked in 6.0.0 and 6.1.0
    below=(7,),
    required=False,  # speed only: a repr is for log lines
    without="h2 hex-encodes every received frame's payload for a trace line nobody reads (~1.5 µs per HEADERS)",
)


def _frame_repr(frame: Any) -> str:
    # h2 formats every frame it receives for a trace line before knowing whether anything logs it
    # (``logger.trace("Received frame: %s", repr(frame))``), and hyperframe's repr hex-encodes the payload: 1.5 µs
    # per HEADERS frame, 0.4 µs per WINDOW_UPDATE, against 0.1 µs for this short form (type and stream are kept).
    return f"{type(frame).__name__}(stream_id={frame.stream_id})"


def _install_frame_repr() -> None:
    import hyperframe.frame

    hyperframe.frame.Frame.__repr__ = _frame_repr  # type: ignore[method-assign]


AIOHTTP_HTTP11_ERRORS = Patch(
    name="aiohttp.web_protocol.ERROR (the placeholder request of an unparsable one says HTTP/1.1)",
    distribution="aiohttp",
    lowest=(3, 9),  # pyproject's lowest; checked in 3.9.0 and 3.14.5
    below=(4,),
    # Required: what the probe and stats ports answer is wire behaviour, which must match upstream (see below).
    required=True,
    without="a request that cannot be parsed on 15000/15020/15021 is answered HTTP/1.0 400, not upstream's HTTP/1.1",
)


def _install_aiohttp_http11_errors() -> None:
    # A request aiohttp cannot parse (plaintext garbage, TLS to a plain port) is answered from a placeholder request
    # that says HTTP/1.0, so the status line reads ``HTTP/1.0 400``. Upstream's hyper answers ``HTTP/1.1 400``, and
    # clients check it (upstream's ``malicious_calls_inpod`` reads exactly that on 15020 and 15021): make the
    # placeholder HTTP/1.1. Only aiohttp servers are affected, and ztunnel's are its only ones.
    from aiohttp import web_protocol
    from aiohttp.http import HttpVersion11

    placeholder = getattr(web_protocol, "ERROR", None)
    if placeholder is None or not hasattr(placeholder, "_replace") or not hasattr(placeholder, "version"):
        raise PatchError(
            f"aiohttp {installed_version('aiohttp')} has no web_protocol.ERROR placeholder request to answer "
            "unparsable requests in HTTP/1.1 (ztunnel/thirdparty.py)"
        )
    if placeholder.version != HttpVersion11:
        web_protocol.ERROR = placeholder._replace(version=HttpVersion11)


_PROCESS_WIDE = (
    (HPACK_DEBUG_LOG, _install_hpack_debug_log),
    (FRAME_REPR, _install_frame_repr),
    (AIOHTTP_HTTP11_ERRORS, _install_aiohttp_http11_errors),
)

# -- per-connection adjustments of h2 ---------------------------------------------------------------------------

H2_CLOSED_STREAMS = Patch(
    name="H2Connection._closed_streams (bounded)",
    distribution="h2",
    lowest=(4, 1),  # pyproject's lowest; checked in 4.1.0 and 4.4.1
    below=(5,),
    # A memory bound, not correctness: without it h2 remembers up to 65,536 closed streams per connection.
    required=False,
    without="each pooled connection may keep up to ~11 MiB of closed-stream records (h2's own bound, 65,536)",
)

HPACK_PLAIN_LITERALS = Patch(
    name="H2Connection.encoder.encode (plain literals, no Huffman coding)",
    distribution="hpack",
    lowest=(4, 0),  # checked in 4.0.0 and 4.2.0
    below=(5,),
    required=False,  # any HPACK decoder accepts both forms; speed only
    without="header values are Huffman-coded (~15% of the receiving proxy's CPU per new connection)",
)

H2_END_STREAM = Patch(
    name="H2Connection END_STREAM without frame objects (_receive_frame, stream state machines, _data_to_send)",
    distribution="h2",
    lowest=(4, 1),  # pyproject's lowest; checked in 4.1.0 and 4.4.1
    below=(5,),
    required=False,  # speed only: without it the same frames go through h2's public calls
    without="each END_STREAM sent or received builds, serializes or parses a frame object (~10 % of h2's work per "
    "stream)",
)

H2_HEADERS = Patch(
    name="H2Connection HEADERS without frame objects (send_headers, _receive_headers_frame, stream state machines)",
    distribution="h2",
    lowest=(4, 1),  # pyproject's lowest; checked in 4.1.0 and 4.4.1
    below=(5,),
    required=False,  # speed only: without it the same header blocks go through h2's public calls
    without="each CONNECT and response builds, serializes or parses HEADERS frame objects and runs h2's generic "
    "header pipeline (~25 % of h2's work per stream)",
)

PATCHES = (*(p for p, _ in _PROCESS_WIDE), H2_CLOSED_STREAMS, HPACK_PLAIN_LITERALS, H2_END_STREAM, H2_HEADERS)

_FRAME_HEADER = struct.Struct(">IBI")  # 24-bit length + 8-bit type as one u32, flags, stream id
_HEADERS, _CONTINUATION = 0x1, 0x9
_END_STREAM, _END_HEADERS = 0x1, 0x4
# Received header names h2's generic pipeline acts on (content-length tracking, cookie joining).
_H2_RECEIVED_SPECIAL = frozenset({b"content-length", b"cookie"})


# h2's names the direct paths use, imported on their first call: importing this module imports no other library,
# and an import statement in each call cost ~0.4 us per name (~10 us per stream lifecycle, both sides, ~10 %).
_h2: Any = None


def _h2_names() -> Any:
    global _h2
    import h2.connection
    import h2.exceptions
    import h2.stream
    import h2.utilities
    import hyperframe.frame

    _h2 = types.SimpleNamespace(
        ConnectionInputs=h2.connection.ConnectionInputs,
        AllowedStreamIDs=h2.connection.AllowedStreamIDs,
        decode_headers=h2.connection._decode_headers,
        StreamInputs=h2.stream.StreamInputs,
        takes_data=(h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL),
        ProtocolError=h2.exceptions.ProtocolError,
        TooManyStreamsError=h2.exceptions.TooManyStreamsError,
        is_informational_response=h2.utilities.is_informational_response,
        validate_headers=h2.utilities.validate_headers,
        DataFrame=hyperframe.frame.DataFrame,
    )
    return _h2


def h2_end_stream_sent(conn: Any, stream_id: int, frame: bytes) -> None:
    """What ``H2Connection.end_stream(stream_id)`` does, with ``frame`` (the 9-byte empty DATA frame with END_STREAM,
    built by the caller) appended to h2's outbound bytes instead of a ``DataFrame`` built and serialized: the
    connection's and the stream's state machines take the same inputs, in the same order, and raise the same errors
    (an unknown or closed stream). Callers check :func:`enabled` (``H2_END_STREAM``) and use ``end_stream``
    otherwise."""
    h = _h2 or _h2_names()
    conn.state_machine.process_input(h.ConnectionInputs.SEND_DATA)
    conn._get_stream_by_id(stream_id).state_machine.process_input(h.StreamInputs.SEND_END_STREAM)
    conn._data_to_send += frame


def h2_end_stream_received(conn: Any, stream_id: int) -> list[Any]:
    """What ``H2Connection.receive_data`` does with an empty DATA frame carrying END_STREAM, without serializing
    it and parsing it back through h2's frame buffer: on a stream that takes DATA, the calls h2's DATA handler makes
    (state machines, flow control, content length); on any other, a frame object to h2's own per-frame handler (a
    closed stream answered as h2 answers it); and a protocol error queues the GOAWAY as
    ``receive_data`` does before it propagates. Returns h2's events."""
    h = _h2 or _h2_names()
    try:
        stream = conn.streams.get(stream_id)
        if stream is not None and stream.state_machine.state in h.takes_data:
            # What _receive_data_frame does for a stream that takes DATA (no StreamClosedError to turn into a
            # RST_STREAM): the connection's input, an empty payload charged to both windows, the stream's inputs.
            events: list[Any] = conn.state_machine.process_input(h.ConnectionInputs.RECV_DATA)
            conn._inbound_flow_control_window_manager.window_consumed(0)
            _, stream_events = stream.receive_data(b"", True, 0)
            return events + list(stream_events)
        return list(conn._receive_frame(h.DataFrame(stream_id, flags=("END_STREAM",))))
    except h.ProtocolError as e:
        conn._terminate_connection(e.error_code)
        raise


def h2_headers_sent(
    conn: Any,
    stream_id: int,
    headers: list[tuple[str, str]],
    end_stream: bool,
    method: bytes | None,
    authority: bytes | None,
    encode: Callable[[Any, list[tuple[str, str]]], bytes],
) -> None:
    """What ``H2Connection.send_headers(stream_id, headers, end_stream)`` does for a request or a final response
    (never an informational one: callers send those through h2), without ``HeadersFrame`` objects and h2's header
    pipeline (UTF-8 re-encoding, validation flags; the HBONE core turns h2's outbound validation off anyway): the
    same stream limit check, the connection's and the stream's state machines take the same inputs in the same order
    (so the same errors, before the compression context changes), then ``encode(conn.encoder, headers)`` makes the
    header block (the caller's HPACK encoding, which must keep ``conn.encoder``'s context right), and the HEADERS
    (+ CONTINUATION) frames are written to h2's outbound bytes.
    ``method``/``authority`` (a request's ``:method``/``:authority``, None for a response) are kept on the stream
    as h2 keeps them. Callers check :func:`enabled` (``H2_HEADERS``)."""
    h = _h2 or _h2_names()
    if stream_id not in conn.streams:
        limit = conn.remote_settings.max_concurrent_streams
        open_now = conn.open_outbound_streams  # h2's count; it also forgets closed streams
        if open_now + 1 > limit:
            raise h.TooManyStreamsError(f"Max outbound streams is {limit}, {open_now} open")
    conn.state_machine.process_input(h.ConnectionInputs.SEND_HEADERS)
    stream = conn._get_or_create_stream(stream_id, h.AllowedStreamIDs(conn.config.client_side))
    machine = stream.state_machine
    machine.process_input(h.StreamInputs.SEND_HEADERS)
    if end_stream:
        machine.process_input(h.StreamInputs.SEND_END_STREAM)
    if machine.trailers_sent and not end_stream:
        raise h.ProtocolError("Trailers must have END_STREAM set.")
    if machine.client and stream._authority is None:
        stream._authority = authority
    stream.request_method = method
    block = encode(conn.encoder, headers)
    size = conn.max_outbound_frame_size
    out = conn._data_to_send
    first = block[:size]
    flags = _END_STREAM if end_stream else 0
    if len(block) <= size:
        out += _FRAME_HEADER.pack(len(first) << 8 | _HEADERS, flags | _END_HEADERS, stream_id)
        out += first
        return
    out += _FRAME_HEADER.pack(len(first) << 8 | _HEADERS, flags, stream_id)
    out += first
    for at in range(size, len(block), size):
        piece = block[at : at + size]
        last = at + size >= len(block)
        out += _FRAME_HEADER.pack(len(piece) << 8 | _CONTINUATION, _END_HEADERS if last else 0, stream_id)
        out += piece


def h2_headers_received(
    conn: Any,
    stream_id: int,
    block: bytes,
    end_stream: bool,
    decode: Callable[[Any, bytes], list[tuple[bytes, bytes]] | None],
) -> list[Any]:
    """What ``H2Connection.receive_data`` does with one HEADERS frame (END_HEADERS set, neither PADDED nor PRIORITY)
    carrying a request that opens a new stream (server) or the response to a request of ours (client), without the
    frame being parsed into an object: the stream limit check, HPACK decoding (``decode(conn.decoder, block)``, or
    where that returns None hpack's, with h2's error mapping), the
    connection's and the stream's state machines, the content-length bookkeeping; an informational response, and
    every response on a connection that validates inbound headers, goes through h2's own ``receive_headers``. A
    protocol error queues the GOAWAY as ``receive_data`` does before it propagates. Returns h2's events.

    The caller must have checked that h2 would not take the frame's stream for a closed one: a request's stream id
    is odd, above every inbound one and unknown to h2, a response's stream is open on our side and has no response
    yet. Callers check :func:`enabled` (``H2_HEADERS``)."""
    h = _h2 or _h2_names()
    try:
        if stream_id not in conn.streams:
            limit = conn.local_settings.max_concurrent_streams
            open_now = conn.open_inbound_streams  # h2's count; it also forgets closed streams
            if open_now + 1 > limit:
                raise h.TooManyStreamsError(f"Max inbound streams is {limit}, {open_now} open")
        # The caller's decoding first (it must leave conn.decoder as hpack would), else hpack's with h2's errors.
        headers: Any = decode(conn.decoder, block)
        if headers is None:
            headers = h.decode_headers(conn.decoder, block)
        events: list[Any] = conn.state_machine.process_input(h.ConnectionInputs.RECV_HEADERS)
        client = conn.config.client_side
        stream = conn._get_or_create_stream(stream_id, h.AllowedStreamIDs(not client))
        config = conn.config
        if (
            config.header_encoding
            or h.is_informational_response(headers)
            or any(name in _H2_RECEIVED_SPECIAL for name, _ in headers)
        ):
            # What h2's generic pipeline does more for (str headers, 1xx, a Content-Length to track, cookies to
            # join): h2's own code, on the block decoded once.
            _, generic_events = stream.receive_headers(headers, end_stream, config.header_encoding)
            return events + list(generic_events)
        machine = stream.state_machine
        stream_events: list[Any] = machine.process_input(h.StreamInputs.RECV_HEADERS)
        if end_stream:
            ended = machine.process_input(h.StreamInputs.RECV_END_STREAM)
            stream_events[0].stream_ended = ended[0]
            stream_events += ended
        if config.validate_inbound_headers and not (client and plainly_valid_response(headers)):
            # h2's own checks of a received block (after the state transitions, as h2 orders them), with the flags
            # h2 would build for a request (server) or a response (client). A response that passes
            # plainly_valid_response passes them too, and skips their per-byte loops.
            headers = list(h.validate_headers(headers, _validation_flags(client)))
        stream_events[0].headers = headers
        return events + stream_events
    except h.ProtocolError as e:
        conn._terminate_connection(e.error_code)
        raise


# A header name of lowercase token characters (RFC 9110 §5.6.2; no colon, no upper case) and a value of visible ASCII
# and inner spaces/tabs that neither starts nor ends with whitespace: what h2's validate_headers accepts of each field
# of a response (its rules: RFC 9113 §8.2.1), in a form a regular expression checks at C speed.
_PLAIN_NAME = re.compile(rb"[a-z0-9!#$%&'*+\-.^_`|~]+")
_PLAIN_VALUE = re.compile(rb"(?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?")
_H2_CONNECTION_HEADERS = frozenset(
    {b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade"}
)


def plainly_valid_response(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a received response's header list certainly passes h2's ``validate_headers`` for a client (one
    ``:status`` first, no other pseudo-header, plain lowercase names, no connection-specific field or TE, values of
    visible ASCII not surrounded by whitespace). False means "ask h2", not "invalid": h2 then raises or accepts
    with its own messages. h2's check walks every byte of every name and value in Python (~11 µs for a 200 with
    baggage, ~13 % of a stream's sans-IO lifecycle); this one is two C regex matches per field.
    ``tests/test_thirdparty.py`` holds it to h2's verdicts."""
    if not headers or headers[0][0] != b":status" or type(headers[0][1]) is not bytes:
        return False
    if not _PLAIN_VALUE.fullmatch(headers[0][1]):
        return False
    for name, value in headers[1:]:
        if (
            type(name) is not bytes
            or type(value) is not bytes
            or not _PLAIN_NAME.fullmatch(name)
            or not _PLAIN_VALUE.fullmatch(value)
            or name in _H2_CONNECTION_HEADERS
            or name == b"te"
        ):
            return False
    return True


@functools.cache
def _validation_flags(client: bool) -> Any:
    """The flags h2 builds to validate a received request (server) or response (client)."""
    from h2.utilities import HeaderValidationFlags

    return HeaderValidationFlags(is_client=client, is_trailer=False, is_response_header=client, is_push_promise=False)


_decisions: dict[str, bool] = {}  # by patch name (a str hashes once; the HBONE core asks per connection)


def enabled(patch: Patch) -> bool:
    """Whether ``patch`` applies to the installed library; decided (and warned about) once per process.

    Raises :class:`PatchError` for a required patch that does not apply."""
    decided = _decisions.get(patch.name)
    if decided is None:
        decided = _decisions[patch.name] = _decide(patch)
    return decided


def _decide(patch: Patch) -> bool:
    reason = patch.unsupported(installed_version(patch.distribution))
    if reason is None:
        return True
    if patch.required:
        raise PatchError(
            f"cannot apply {patch.name}: {reason}, and correctness depends on it ({patch.without}); install a "
            f"version in that range, or update ztunnel/thirdparty.py"
        )
    log.warning("not applying %s: %s; so %s", patch.name, reason, patch.without)
    return False


_applied = False


def apply(*, http_servers: bool = True) -> None:
    """Install the process-wide patches (idempotent) and decide the per-connection ones, so that every warning
    appears at start. Raises :class:`PatchError` (before installing anything) when a required one cannot apply.

    ``http_servers=False``: a process without HTTP servers (a data-plane worker) leaves aiohttp alone, and
    unimported."""
    global _applied
    if _applied:
        return
    wanted = [(p, install) for p, install in _PROCESS_WIDE if http_servers or p is not AIOHTTP_HTTP11_ERRORS]
    usable = [(p, install) for p, install in wanted if enabled(p)]  # may raise: nothing installed yet
    for p in PATCHES:
        if http_servers or p is not AIOHTTP_HTTP11_ERRORS:
            enabled(p)
    for _, install in usable:
        install()
    _applied = True


def adjust_h2(conn: Any, closed_streams: int) -> None:
    """Adjust one new ``h2.connection.H2Connection``: remember at most ``closed_streams`` closed streams, and send
    header values as plain literals. Touches ``conn`` only."""
    if enabled(H2_CLOSED_STREAMS):
        import h2.utilities

        # How many closed streams h2 remembers the ending of (reset or END_STREAM), to answer a late frame on one
        # with RST_STREAM instead of a connection error. h2's own bound is 65,536: ~11 MiB of OrderedDict on every
        # pooled connection that has carried that many streams, for the connection's life (the soak found it).
        conn._closed_streams = h2.utilities.SizeLimitDict(size_limit=closed_streams)
    if enabled(HPACK_PLAIN_LITERALS):
        # Header values are sent as plain literals, not Huffman-coded: hpack's pure-Python Huffman decoder was the
        # biggest single cost of a CONNECT on the receiving side (~15% of its CPU per new connection), while the
        # bytes saved (~20% of a ~100-byte header block, once per stream) are irrelevant. Any HPACK decoder (Rust
        # h2, Envoy) accepts both forms.
        conn.encoder.encode = functools.partial(conn.encoder.encode, huffman=False)

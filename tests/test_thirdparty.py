"""The third-party patches (ztunnel/thirdparty.py): importing ztunnel changes no other library, ``apply()`` does; a
patch outside its library's versions is skipped with a warning or, if correctness depends on it, fails; and one
test per patch fails when the internals it relies on change (each reads or drives the library, not ztunnel)."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import h2.config
import h2.connection
import h2.exceptions
import h2.utilities
import hpack
import hpack.hpack
import hyperframe.frame
import pytest

from ztunnel import thirdparty

ROOT = Path(__file__).resolve().parent.parent

# What each process-wide patch replaces, as seen from a fresh interpreter.
_SNAPSHOT = """
import json, sys
import aiohttp.web_protocol, hpack.hpack, hyperframe.frame

def snapshot():
    return {
        "hpack.hpack.log": id(hpack.hpack.log),
        "hyperframe.frame.Frame.__repr__": id(hyperframe.frame.Frame.__repr__),
        "aiohttp.web_protocol.ERROR": repr(aiohttp.web_protocol.ERROR.version),
    }
"""


def _run(code: str) -> dict[str, dict[str, object]]:
    proc = subprocess.run(
        [sys.executable, "-c", _SNAPSHOT + code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, dict[str, object]] = json.loads(proc.stdout)
    return out


def test_importing_the_sans_io_core_changes_nothing_global() -> None:
    """The HBONE core, the HTTP servers and the app module import without touching hpack, hyperframe or aiohttp;
    ``apply()`` (what App.start runs) then does change each of them, so the snapshot compares what matters."""
    got = _run(
        "before = snapshot()\n"
        "import ztunnel.proxy.hbone.core, ztunnel.proxy.hbone.connection, ztunnel.http, ztunnel.app\n"
        "imported = snapshot()\n"
        "from ztunnel import thirdparty\n"
        "thirdparty.apply()\n"
        "print(json.dumps({'before': before, 'imported': imported, 'applied': snapshot()}))\n"
    )
    assert got["imported"] == got["before"]
    changed = {k for k in got["before"] if got["applied"][k] != got["before"][k]}
    assert changed == set(got["before"]), f"apply() left {set(got['before']) - changed} unpatched"


# -- the version guards -------------------------------------------------------------------------------------------


def test_installed_libraries_are_in_every_patch_range() -> None:
    """A dependency upgraded past a patch's range fails here first (then: check the internals, widen the range)."""
    for patch in thirdparty.PATCHES:
        version = thirdparty.installed_version(patch.distribution)
        assert patch.unsupported(version) is None, (patch.name, version)
        assert thirdparty.enabled(patch), patch.name


def test_a_version_outside_the_range_is_refused_with_the_reason() -> None:
    p = thirdparty.HPACK_DEBUG_LOG
    assert p.unsupported("4.0.0") is None and p.unsupported("4.9.1rc1") is None
    assert p.unsupported("5.0.0") == "hpack 5.0.0 is outside the versions it was written for (>=4.0,<5)"
    assert p.unsupported("3.0.0") == "hpack 3.0.0 is outside the versions it was written for (>=4.0,<5)"
    assert "version is unknown" in (p.unsupported(None) or "")


def _apply_with_versions(versions: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``thirdparty.apply()`` in a fresh interpreter whose package metadata reports ``versions``."""
    code = (
        _SNAPSHOT
        + "import importlib.metadata, logging\n"
        + f"fake = {versions!r}\n"
        + "real = importlib.metadata.version\n"
        + "importlib.metadata.version = lambda d: fake.get(d) or real(d)\n"
        + "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s')\n"
        + "from ztunnel import thirdparty\n"
        + "before = snapshot()\n"
        + "try:\n"
        + "    thirdparty.apply()\n"
        + "    thirdparty.apply()\n"  # idempotent: warns once
        + "except thirdparty.PatchError as e:\n"
        + "    print('PatchError:', e, file=sys.stderr)\n"
        + "after = snapshot()\n"
        + "print(json.dumps({k: after[k] != before[k] for k in before}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def test_a_speed_patch_outside_its_range_is_skipped_with_one_warning() -> None:
    proc = _apply_with_versions({"hpack": "5.0.0"})
    assert proc.returncode == 0, proc.stderr
    changed = json.loads(proc.stdout)
    # hpack's two patches are not applied; the others are.
    assert changed == {
        "hpack.hpack.log": False,
        "hyperframe.frame.Frame.__repr__": True,
        "aiohttp.web_protocol.ERROR": True,
    }
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 2, proc.stderr  # one per hpack patch, not one per apply()
    assert all("hpack 5.0.0 is outside the versions it was written for (>=4.0,<5)" in w for w in warnings)
    assert any("hpack.hpack.log" in w and "DEBUG calls stay" in w for w in warnings)
    assert any("plain literals" in w and "Huffman-coded" in w for w in warnings)


def test_a_required_patch_outside_its_range_fails_before_anything_is_installed() -> None:
    proc = _apply_with_versions({"aiohttp": "4.0.0"})
    assert proc.returncode == 0, proc.stderr
    assert not any(json.loads(proc.stdout).values())  # nothing half-installed
    assert "PatchError: cannot apply aiohttp.web_protocol.ERROR" in proc.stderr
    assert "aiohttp 4.0.0 is outside the versions it was written for (>=3.9,<4)" in proc.stderr
    assert "correctness depends on it" in proc.stderr


# -- hpack.hpack.log ----------------------------------------------------------------------------------------------


def test_hpack_calls_only_debug_on_its_module_logger() -> None:
    """The no-op logger has only ``debug``: any other call hpack made on ``log`` would raise in every CONNECT."""
    source = inspect.getsource(hpack.hpack)
    assert re.search(r"^log = logging\.getLogger\(", source, re.M), "hpack no longer has a module logger `log`"
    assert set(re.findall(r"\blog\.(\w+)", source)) == {"debug"}


def test_hpack_logs_each_header_at_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the patch saves: without it, hpack calls ``log.debug`` for every field it encodes and decodes."""
    calls: list[str] = []

    class Recorder:
        def debug(self, msg: str, *args: object) -> None:
            calls.append(msg)

    monkeypatch.setattr(hpack.hpack, "log", Recorder())
    headers = [(":method", "CONNECT"), (":authority", "10.0.0.1:8080"), ("baggage", "k8s.cluster.name=c")]
    block = hpack.Encoder().encode(headers)
    encoded = len(calls)
    decoded: list[object] = [tuple(h) for h in hpack.Decoder().decode(block)]
    assert decoded == headers
    assert encoded >= len(headers) and len(calls) - encoded >= len(headers), calls


# -- hyperframe.frame.Frame.__repr__ ------------------------------------------------------------------------------


def test_no_frame_type_has_a_repr_of_its_own() -> None:
    """Replacing ``Frame.__repr__`` covers every frame type only while none overrides it."""
    own = [name for name, cls in vars(hyperframe.frame).items() if _is_frame(cls) and "__repr__" in vars(cls)]
    assert own == ["Frame"]


def _is_frame(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, hyperframe.frame.Frame)


def test_h2_formats_every_received_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the patch saves: h2 calls ``repr`` on each frame it receives, logged or not. If this fails, h2 stopped
    doing so and the patch can go."""
    calls: list[str] = []

    def counting_repr(frame: hyperframe.frame.Frame) -> str:
        calls.append(type(frame).__name__)
        return "frame"

    monkeypatch.setattr(hyperframe.frame.Frame, "__repr__", counting_repr)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    client.initiate_connection()
    client.ping(b"12345678")
    server.receive_data(client.data_to_send())
    assert calls == ["SettingsFrame", "PingFrame"]


def test_short_frame_repr_keeps_type_and_stream() -> None:
    assert thirdparty._frame_repr(hyperframe.frame.DataFrame(7, b"x" * 100)) == "DataFrame(stream_id=7)"


# -- aiohttp.web_protocol.ERROR -----------------------------------------------------------------------------------


async def _status_line_for_garbage() -> bytes:
    from aiohttp import web

    runner = web.AppRunner(web.Application(), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"hello world\r\n\r\n")  # upstream's malicious_calls_inpod
        line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        return line
    finally:
        await runner.cleanup()


async def test_aiohttp_answers_unparsable_requests_in_the_placeholders_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patch sets the version of ``web_protocol.ERROR``, the request aiohttp answers a bad one from: the status
    line must follow it (plain aiohttp, none of ztunnel's HTTP code)."""
    from aiohttp import web_protocol
    from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage

    assert isinstance(web_protocol.ERROR, RawRequestMessage)
    monkeypatch.setattr(web_protocol, "ERROR", web_protocol.ERROR._replace(version=HttpVersion10))
    assert (await _status_line_for_garbage()).startswith(b"HTTP/1.0 400 ")
    monkeypatch.setattr(web_protocol, "ERROR", web_protocol.ERROR._replace(version=HttpVersion11))
    assert (await _status_line_for_garbage()).startswith(b"HTTP/1.1 400 ")


# -- per connection: H2Connection._closed_streams and plain literals ----------------------------------------------


def _closed_pair(closed_streams: int, n: int) -> h2.connection.H2Connection:
    """A client that opened and saw the end of ``n`` streams (1, 3, 5, ...), adjusted as the HBONE core does."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    thirdparty.adjust_h2(client, closed_streams=closed_streams)
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    for i in range(n):
        sid = 1 + 2 * i
        client.send_headers(sid, [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "a")], True)
        server.receive_data(client.data_to_send())
        server.send_headers(sid, [(":status", "200")], end_stream=True)
        client.receive_data(server.data_to_send())
    return client


def test_h2_records_closed_streams_in_a_size_limited_dict() -> None:
    """h2 keeps each closed stream's ending in ``_closed_streams``, a ``SizeLimitDict``; the adjustment swaps in a
    smaller one, which h2 must then fill and trim."""
    fresh = h2.connection.H2Connection()
    assert type(fresh._closed_streams) is h2.utilities.SizeLimitDict
    assert fresh._closed_streams._size_limit > 1024  # h2's own bound: what the adjustment lowers
    client = _closed_pair(closed_streams=2, n=5)
    # h2 moves a stream there when it next sweeps its open streams; the oldest have been trimmed away.
    assert len(client._closed_streams) == 2 and set(client._closed_streams) <= {5, 7, 9}


def test_plain_literals_are_sent_unencoded() -> None:
    """``Encoder.encode(..., huffman=False)`` sends values as they are; the default Huffman-codes them."""
    headers = [("x-probe", "abcdefghijkl")]
    assert b"abcdefghijkl" not in hpack.Encoder().encode(headers)
    assert b"abcdefghijkl" in hpack.Encoder().encode(headers, huffman=False)
    conn = h2.connection.H2Connection()
    thirdparty.adjust_h2(conn, closed_streams=8)
    block = conn.encoder.encode(headers)
    assert b"abcdefghijkl" in block
    decoded: list[object] = [tuple(h) for h in hpack.Decoder().decode(block)]
    assert decoded == headers


# -- per stream: END_STREAM without frame objects (H2_END_STREAM) ---------------------------------------------------


def _open_pair() -> tuple[h2.connection.H2Connection, h2.connection.H2Connection, int]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    client.send_headers(1, [(":method", "CONNECT"), (":authority", "10.0.0.1:80")])
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(":status", "200")])
    client.receive_data(server.data_to_send())
    return client, server, 1


def _state(conn: h2.connection.H2Connection, sid: int) -> tuple[object, object]:
    return conn.state_machine.state, conn.streams[sid].state_machine.state


def test_end_stream_sent_directly_is_h2s_end_stream() -> None:
    """Same bytes and the same states as ``H2Connection.end_stream`` (h2 is the oracle), and the same refusal of a
    stream that is already half-closed."""
    oracle, _, sid = _open_pair()
    direct, _, _ = _open_pair()
    oracle.end_stream(sid)
    thirdparty.h2_end_stream_sent(direct, sid, bytes([0, 0, 0, 0, 1, 0, 0, 0, sid]))
    assert direct.data_to_send() == oracle.data_to_send()
    assert _state(direct, sid) == _state(oracle, sid)
    # A second END_STREAM on the half-closed stream: the same error from both.
    again = _outcome(lambda: oracle.end_stream(sid))
    assert again is not None and again == _outcome(lambda: thirdparty.h2_end_stream_sent(direct, sid, b""))


def _outcome(call: Callable[[], object]) -> type[BaseException] | None:
    try:
        call()
    except Exception as e:
        return type(e)
    return None


def test_end_stream_received_directly_is_h2s_receive_data() -> None:
    """Same events and states as the empty END_STREAM DATA frame through ``receive_data``; a second one on the
    half-closed stream is the same error, with the same frames queued for the peer."""
    frame = bytes([0, 0, 0, 0, 1, 0, 0, 0, 1])
    _, oracle, sid = _open_pair()
    _, direct, _ = _open_pair()
    want = oracle.receive_data(frame)
    got = thirdparty.h2_end_stream_received(direct, sid)
    assert [type(e) for e in got] == [type(e) for e in want] == [h2.events.DataReceived, h2.events.StreamEnded]
    assert [e.stream_id for e in got] == [e.stream_id for e in want]  # type: ignore[attr-defined]
    assert _state(direct, sid) == _state(oracle, sid)
    # A second one on the half-closed stream: h2 answers it the same way (a reset of the stream or a connection
    # error), whichever path it took.
    first = _outcome(lambda: oracle.receive_data(frame))
    assert first == _outcome(lambda: thirdparty.h2_end_stream_received(direct, sid))
    assert direct.data_to_send() == oracle.data_to_send()  # the RST_STREAM or GOAWAY h2 queued
    assert _state(direct, sid) == _state(oracle, sid) if sid in oracle.streams else sid not in direct.streams


def test_the_hbone_core_uses_the_direct_end_stream() -> None:
    from ztunnel.proxy.hbone.core import HboneConnection

    assert HboneConnection(True)._end_stream_direct is thirdparty.enabled(thirdparty.H2_END_STREAM) is True


# -- per stream: CONNECT and response HEADERS without frame objects (H2_HEADERS) ---------------------------------------

REQUEST = [(":method", "CONNECT"), (":authority", "10.0.0.1:80"), ("baggage", "k8s.namespace.name=default")]


def _settled_pair() -> tuple[h2.connection.H2Connection, h2.connection.H2Connection]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    return client, server


def _hpack_encode(encoder: hpack.Encoder, headers: list[tuple[str, str]]) -> bytes:
    return bytes(encoder.encode(headers))


def test_headers_sent_directly_are_h2s_send_headers() -> None:
    """Same bytes and states as ``H2Connection.send_headers`` for a request and a response ending the stream (h2
    encoding both blocks), and the same refusal of a second response without END_STREAM."""
    oracle_c, oracle_s = _settled_pair()
    direct_c, direct_s = _settled_pair()
    oracle_c.send_headers(1, REQUEST)
    thirdparty.h2_headers_sent(direct_c, 1, REQUEST, False, b"CONNECT", b"10.0.0.1:80", _hpack_encode)
    wire = oracle_c.data_to_send()
    assert direct_c.data_to_send() == wire
    assert _state(direct_c, 1) == _state(oracle_c, 1)
    assert direct_c.streams[1].request_method == oracle_c.streams[1].request_method == b"CONNECT"
    oracle_s.receive_data(wire)
    direct_s.receive_data(wire)
    oracle_s.send_headers(1, [(":status", "503")], end_stream=True)
    thirdparty.h2_headers_sent(direct_s, 1, [(":status", "503")], True, None, None, _hpack_encode)
    assert direct_s.data_to_send() == oracle_s.data_to_send()
    assert _state(direct_s, 1) == _state(oracle_s, 1)
    again = _outcome(lambda: oracle_s.send_headers(1, [(":status", "200")]))
    assert again is not None
    assert again == _outcome(
        lambda: thirdparty.h2_headers_sent(direct_s, 1, [(":status", "200")], False, None, None, _hpack_encode)
    )


def _no_plain_decode(decoder: object, block: bytes) -> None:
    return None


def test_headers_received_directly_are_h2s_receive_data() -> None:
    """Same events (types, headers, END_STREAM) and states as the HEADERS frame through ``receive_data``, for a
    request, a response ending the stream, and a block hpack rejects (same error, same GOAWAY queued)."""
    sender_c, sender_s = _settled_pair()
    sender_c.send_headers(1, REQUEST)
    request = sender_c.data_to_send()
    _, oracle = _settled_pair()
    _, direct = _settled_pair()
    want = oracle.receive_data(request)
    got = thirdparty.h2_headers_received(direct, 1, request[9:], False, _no_plain_decode)
    assert [type(e) for e in got] == [type(e) for e in want] == [h2.events.RequestReceived]
    assert got[0].headers == want[0].headers  # type: ignore[attr-defined]
    assert _state(direct, 1) == _state(oracle, 1)

    sender_s.receive_data(request)
    sender_s.send_headers(1, [(":status", "200"), ("baggage", "x")], end_stream=True)
    response = sender_s.data_to_send()
    oracle_c, _ = _settled_pair()
    direct_c, _ = _settled_pair()
    for c in (oracle_c, direct_c):
        c.send_headers(1, REQUEST)
    want = oracle_c.receive_data(response)
    got = thirdparty.h2_headers_received(direct_c, 1, response[9:], True, _no_plain_decode)
    assert [type(e) for e in got] == [type(e) for e in want] == [h2.events.ResponseReceived, h2.events.StreamEnded]
    assert got[0].headers == want[0].headers  # type: ignore[attr-defined]
    assert _state(direct_c, 1) == _state(oracle_c, 1)

    garbage = b"\xbf\xff\xff\xff"  # an index far past both tables
    _, oracle = _settled_pair()
    _, direct = _settled_pair()
    frame = len(garbage).to_bytes(3, "big") + bytes([1, 4, 0, 0, 0, 1]) + garbage
    failed = _outcome(lambda: oracle.receive_data(frame))
    assert failed is not None
    assert failed == _outcome(lambda: thirdparty.h2_headers_received(direct, 1, garbage, False, _no_plain_decode))
    assert direct.data_to_send() == oracle.data_to_send()


def test_the_hbone_core_uses_the_direct_headers() -> None:
    from ztunnel.proxy.hbone.core import HboneConnection

    assert HboneConnection(True)._headers_direct is thirdparty.enabled(thirdparty.H2_HEADERS) is True


_CLIENT_RESPONSE = h2.utilities.HeaderValidationFlags(
    is_client=True, is_trailer=False, is_response_header=True, is_push_promise=False
)
# Responses next to the edges of h2's rules: each is either plainly valid or must be left to h2.
_RESPONSES: list[list[tuple[bytes, bytes]]] = [
    [(b":status", b"200")],
    [(b":status", b"200"), (b"baggage", b"k8s.cluster.name=Kubernetes")],
    [(b":status", b"503"), (b"x-empty", b""), (b"x-inner", b"a b\tc"), (b"x-sym", b"!#$%&'*+-.^_`|~")],
    [(b":status", b"200"), (b"Baggage", b"x")],  # upper case name
    [(b":status", b"200"), (b"bag:gage", b"x")],  # colon in a name
    [(b":status", b"200"), (b"", b"x")],  # empty name
    [(b":status", b"200"), (b"x", b" x")],  # leading space
    [(b":status", b"200"), (b"x", b"x\t")],  # trailing tab
    [(b":status", b"200"), (b"x", b"a\rb")],
    [(b":status", b"200"), (b"x", b"a\nb")],
    [(b":status", b"200"), (b"x", b"a\0b")],
    [(b":status", b"200"), (b"x", "é".encode())],  # not ASCII: left to h2 (which accepts it)
    [(b":status", b"200"), (b"te", b"trailers")],  # left to h2 (which accepts it)
    [(b":status", b"200"), (b"te", b"gzip")],
    [(b":status", b"200"), (b"connection", b"close")],
    [(b":status", b"200"), (b"transfer-encoding", b"chunked")],
    [(b":status", b"200"), (b":status", b"200")],  # duplicate pseudo
    [(b"x", b"y"), (b":status", b"200")],  # pseudo after a regular field
    [(b":status", b"200"), (b":method", b"CONNECT")],  # request-only pseudo
    [(b":status", b"200"), (b":custom", b"1")],
    [(b"x", b"y")],  # no :status
    [],
    [(b":status", b" 200")],
]


def _h2_accepts(headers: list[tuple[bytes, bytes]]) -> bool:
    try:
        list(h2.utilities.validate_headers(headers, _CLIENT_RESPONSE))
    except h2.exceptions.ProtocolError:
        return False
    return True


def test_plainly_valid_responses_are_valid_for_h2() -> None:
    """The fast check may only say yes where h2 does (it answers "ask h2" otherwise): on a table of edge cases and
    on random header lists drawn from the bytes that matter to h2's rules."""
    import random

    verdicts = [(thirdparty.plainly_valid_response(r), _h2_accepts(r)) for r in _RESPONSES]
    assert all(h2_ok for fast, h2_ok in verdicts if fast)
    assert [fast for fast, _ in verdicts][:3] == [True, True, True], "the usual responses take the fast path"
    rng = random.Random(17)
    alphabet = b"az09-_:A \t\r\n\0\x7f\xe9!~"
    names = [b":status", b":method", b":custom", b"te", b"connection", b"baggage", b""]
    taken = 0
    for _ in range(5000):
        headers = [(b":status", b"200")] if rng.random() < 0.8 else []
        for _ in range(rng.randrange(4)):
            name = rng.choice(names) if rng.random() < 0.3 else bytes(rng.choices(alphabet, k=rng.randrange(1, 5)))
            value = bytes(rng.choices(alphabet, k=rng.randrange(0, 5)))
            headers.append((name, value))
        if thirdparty.plainly_valid_response(headers):
            taken += 1
            assert _h2_accepts(headers), headers
    assert taken > 100, "the random lists must exercise the fast path too"


def test_a_plain_response_skips_h2s_per_byte_validation_and_a_bad_one_is_still_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ztunnel.proxy.hbone.core import ConnectResponded, HboneConnection, HboneProtocolError

    walked: list[object] = []
    original = h2.utilities._reject_illegal_characters

    def counting(headers: object, flags: object) -> object:
        walked.append(headers)
        return original(headers, flags)  # type: ignore[arg-type]

    monkeypatch.setattr(h2.utilities, "_reject_illegal_characters", counting)

    def exchange(response: list[tuple[str, str]]) -> list[object]:
        client, server = HboneConnection(True), HboneConnection(False)
        client.initiate()
        server.initiate()
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
        server.receive_data(client.data_to_send())
        sid = client.send_connect("10.0.0.2:8080", [("baggage", "k8s.cluster.name=Kubernetes")])
        server.receive_data(client.data_to_send())
        server.send_response(sid, 200, response)
        return list(client.receive_data(server.data_to_send()))

    events = exchange([("baggage", "k8s.cluster.name=Kubernetes")])
    assert [type(e) for e in events] == [ConnectResponded]
    assert walked == [], "h2 walked the bytes of a plainly valid response"
    with pytest.raises(HboneProtocolError, match="Connection-specific header field"):
        exchange([("connection", "close")])
    assert walked, "a response the fast check cannot vouch for goes through h2's validation"

from __future__ import annotations

import asyncio
import io
import ipaddress
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import fuzz_settings
from ztunnel.proxy.common import ResponseFlag
from ztunnel.proxy.connection_manager import ConnectionManager, ConnectionRecord, Direction
from ztunnel.telemetry import (
    MAX_FIELD_CHARS,
    MAX_MESSAGE_CHARS,
    TRACE,
    NonBlockingHandler,
    current_level,
    display,
    dropped_lines,
    enter_span,
    flush_logs,
    log,
    parse_log_filter,
    set_level,
    setup_logging,
    span_id,
)
from ztunnel.testing import EchoServer, TwoNodeMesh, running_app, socks5_connect


def flushed(stream: io.StringIO) -> str:
    """What the stream holds once the log writer thread wrote what was queued."""
    flush_logs()
    return stream.getvalue()


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    yield buf
    setup_logging("info")  # leave the process with the default filter


def test_parse_filter() -> None:
    assert parse_log_filter("info") == (logging.INFO, {})
    assert parse_log_filter("access=debug,warn") == (logging.WARNING, {"access": logging.DEBUG})
    assert parse_log_filter("ztunnel::proxy::inbound=trace") == (None, {"ztunnel.proxy.inbound": TRACE})
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        parse_log_filter("access=loud")
    with pytest.raises(ValueError, match="missing target"):
        parse_log_filter("=debug")


def test_plain_format_escapes_line_breaks_from_peers(stream: io.StringIO) -> None:
    setup_logging("info", json_format=False, stream=stream)
    logging.getLogger("ztunnel.proxy.h2").warning("bad header from %s: %r", "10.0.0.1:5", "a\r\nforged\tinfo\tline")
    logging.getLogger("ztunnel.proxy.h2").warning("raw: %s", "a\nforged")
    lines = flushed(stream).splitlines()
    assert len(lines) == 2, lines
    assert lines[1].endswith("\traw: a\\nforged")


def test_plain_format(stream: io.StringIO) -> None:
    setup_logging("info", json_format=False, stream=stream)
    log(
        logging.getLogger("access"),
        logging.INFO,
        "connection complete",
        **{"src.addr": display("10.0.0.1:1234"), "direction": "inbound", "bytes_sent": 5, "ok": True},
    )
    time, level, scope, message, fields = flushed(stream).rstrip("\n").split("\t")
    assert time.endswith("Z") and "T" in time
    assert (level, scope, message) == ("info", "access", "connection complete")
    # As upstream's tracing fields: Display (%) bare, &str quoted, numbers and booleans bare.
    assert fields == 'src.addr=10.0.0.1:1234 direction="inbound" bytes_sent=5 ok=true'


def test_json_format(stream: io.StringIO) -> None:
    setup_logging("info", json_format=True, stream=stream)
    log(logging.getLogger("ztunnel.proxy.inbound"), logging.WARNING, "connection failed", error="denied")
    record = json.loads(flushed(stream))
    assert record["level"] == "warn"
    assert record["scope"] == "ztunnel::proxy::inbound"
    assert record["message"] == "connection failed"
    assert record["error"] == "denied"
    assert list(record)[:4] == ["level", "time", "scope", "message"]


def test_levels_filter_and_change_at_run_time(stream: io.StringIO) -> None:
    setup_logging("warn,access=info", stream=stream)
    logging.getLogger("ztunnel.app").info("hidden")
    logging.getLogger("access").info("shown")
    assert "hidden" not in flushed(stream) and "shown" in flushed(stream)
    new = set_level(False, "ztunnel::app=debug")
    assert "ztunnel::app=debug" in new and current_level() == new
    logging.getLogger("ztunnel.app").debug("now visible")
    assert "now visible" in flushed(stream)
    with pytest.raises(ValueError):
        set_level(False, "x=nope")
    set_level(True, "")
    logging.getLogger("ztunnel.app").info("hidden again")
    assert "hidden again" not in flushed(stream)


# -- access-log lines as upstream writes them, and untrusted values bounded and escaped ---------------------------

BIDI_AND_FORMAT = [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F)]
OTHER_UNSAFE = ["\x00", "\x1b", "\x7f", "\x85", "\u2028", "\u2029", "\ufeff", "\U000e0001", "\ud800"]


def access_line(fmt_json: bool, **kw: object) -> str:
    """The ``connection complete`` line the real ConnectionManager writes for one inbound HBONE connection."""
    buf = io.StringIO()
    setup_logging("info", json_format=fmt_json, stream=buf)
    try:
        manager = ConnectionManager()
        record = ConnectionRecord(
            direction=Direction.INBOUND,
            src=(ipaddress.ip_address("10.0.0.1"), 1234),
            dst=(ipaddress.ip_address("fd00::2"), 15008),
            hbone_target=str(kw.pop("hbone_target", "10.0.0.2:8080")),
            mtls=True,
        )
        manager.register(record)
        manager.release(record, ResponseFlag.NONE, kw.pop("error", None))  # type: ignore[arg-type]
    finally:
        setup_logging("info")
    (line,) = buf.getvalue().splitlines()
    return line


def test_plain_access_line_prints_addresses_bare_as_upstream() -> None:
    """Upstream's build (62d8265, dedicated mode, examples/localhost.yaml) wrote, through its SOCKS5 to its own 15008:
    ``src.addr=127.0.0.1:57238 src.workload="local" ... dst.addr=127.0.0.1:15008 dst.hbone_addr=127.0.0.1:8080
    ... direction="outbound" bytes_sent=4 bytes_recv=4 duration="25ms"``."""
    fields = access_line(False).split("\t")[4]
    # upstream: src.addr/dst.addr are `%` (Display), dst.hbone_addr `display(..)`: bare; &str and String fields
    # (direction, duration, error) Debug: quoted; byte counts u64: bare.
    assert fields.startswith("src.addr=10.0.0.1:1234 dst.addr=[fd00::2]:15008 dst.hbone_addr=10.0.0.2:8080 ")
    assert re.search(r' direction="inbound" bytes_sent=0 bytes_recv=0 duration="\d+ms"$', fields), fields


def test_json_access_line_holds_addresses_as_strings() -> None:
    record = json.loads(access_line(True))
    assert record["src.addr"] == "10.0.0.1:1234" and record["dst.addr"] == "[fd00::2]:15008"
    assert record["dst.hbone_addr"] == "10.0.0.2:8080" and record["bytes_sent"] == 0


def test_a_40kb_authority_makes_a_bounded_line_saying_what_was_cut() -> None:
    authority = "a" * 40_000 + ".example:80"
    line = access_line(False, hbone_target=authority)
    assert len(line) < MAX_FIELD_CHARS + 1000, len(line)
    # Not a plain token any more once cut: quoted, with the marker inside.
    cut = len(authority) - MAX_FIELD_CHARS
    assert f'dst.hbone_addr="{"a" * MAX_FIELD_CHARS}...<cut {cut} chars>" ' in line
    record = json.loads(access_line(True, hbone_target=authority, error="x" * 50_000))
    assert record["dst.hbone_addr"] == "a" * MAX_FIELD_CHARS + f"...<cut {cut} chars>"
    assert record["error"] == "x" * MAX_FIELD_CHARS + f"...<cut {50_000 - MAX_FIELD_CHARS} chars>"


@pytest.mark.parametrize("char", BIDI_AND_FORMAT + OTHER_UNSAFE, ids=lambda c: f"U+{ord(c):04X}")
def test_control_and_format_characters_never_reach_the_line_raw(char: str) -> None:
    error = f"evil{char}gnp.exe"
    plain = access_line(False, error=error, hbone_target=f"host{char}:80")
    assert char not in plain
    # A string field is Rust's {:?} of the str, as upstream's plain format writes it.
    rust = {"\x00": "\\0"}.get(char, f"\\u{{{ord(char):x}}}")
    assert f'error="evil{rust}gnp.exe"' in plain
    assert f'dst.hbone_addr="host{rust}:80"' in plain  # a Display value needing escapes is quoted
    line = access_line(True, error=error)
    assert char not in line and line.isascii()
    assert json.loads(line)["error"] == error  # the escape decodes back to what was sent


def test_messages_are_escaped_and_bounded(stream: io.StringIO) -> None:
    setup_logging("info", json_format=False, stream=stream)
    logging.getLogger("ztunnel.x").warning("peer said %s", "\u202eevil\ttab" + "m" * 10_000)
    (line,) = flushed(stream).splitlines()
    message = line.split("\t")[3]
    assert message.startswith("peer said \\u{202e}evil\\ttab")
    assert len(message) <= MAX_MESSAGE_CHARS + 30 and message.endswith(" chars>")


# Rust's escapes, undone: what a reader of the plain line recovers.
_UNESCAPE = re.compile(r'\\(u\{([0-9a-f]+)\}|[tnr0"\\])')


def rust_unescape(text: str) -> str:
    simple = {"t": "\t", "n": "\n", "r": "\r", "0": "\0", '"': '"', "\\": "\\"}
    return _UNESCAPE.sub(lambda m: chr(int(m.group(2), 16)) if m.group(2) else simple[m.group(1)], text)


@given(st.text(min_size=0, max_size=3000))
@fuzz_settings(200)
def test_any_value_is_one_printable_bounded_field(value: str) -> None:
    buf = io.StringIO()
    setup_logging("info", json_format=False, stream=buf)
    try:
        log(logging.getLogger("access"), logging.INFO, "m", v=value, d=display(value))
        setup_logging("info", json_format=True, stream=buf)
        log(logging.getLogger("access"), logging.INFO, "m", v=value)
    finally:
        setup_logging("info")
    plain, js = buf.getvalue().split("\n")[:2]
    parts = plain.split("\t")  # the separators are the only tabs, and nothing is unprintable
    assert len(parts) == 5 and all(p.isprintable() for p in parts) and js.isprintable()
    fields = parts[4]
    m = re.fullmatch(r'v="((?:[^"\\]|\\.)*)" d=(.*)', fields)
    assert m is not None, fields
    quoted = m.group(1)
    assert len(quoted) <= MAX_FIELD_CHARS + len("...<cut 9999 chars>")
    marker = re.search(r"\.\.\.<cut (\d+) chars>$", quoted)
    if marker is None:
        assert rust_unescape(quoted) == value
    else:
        kept = rust_unescape(quoted[: marker.start()])
        assert value.startswith(kept) and len(kept) + int(marker.group(1)) == len(value)
    assert m.group(2) in (value, f'"{quoted}"')  # bare only when it is the value itself
    got = json.loads(js)["v"]
    assert got == value if len(value) <= MAX_FIELD_CHARS else got.startswith(value[:MAX_FIELD_CHARS])


# -- spans: the traceparent's trace id ------------------------------------------------------------------------------

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    ("header", "expect"),
    [
        (f"00-{TRACE_ID}-00f067aa0ba902b7-01", TRACE_ID),
        (f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01", TRACE_ID),  # hex, either case; written lowercase
        (f"00-{TRACE_ID}-00f067aa0ba902b7-0", None),  # 54 characters
        (f"00-{TRACE_ID[:-1]}x-00f067aa0ba902b7-01", None),  # not hex
        (f"00_{TRACE_ID}_00f067aa0ba902b7_01", None),
        (None, None),
    ],
)
def test_span_id_is_the_traceparent_trace_id(header: str | None, expect: str | None) -> None:
    got = span_id(header)
    assert re.fullmatch(r"[0-9a-f]{32}", got)
    if expect is not None:
        assert got == expect
    else:
        assert got != span_id(header)  # a fresh random id each time


def test_lines_in_a_span_carry_it_but_access_lines_do_not(stream: io.StringIO) -> None:
    """Upstream writes a task's lines within its span (``scope:inbound{id=.. peer=..}``, a JSON object), and the
    access log outside any span (``parent: None``)."""

    async def one_connection(fmt_json: bool) -> None:
        setup_logging("debug", json_format=fmt_json, stream=stream)
        enter_span("inbound", {"id": span_id(f"00-{TRACE_ID}-00f067aa0ba902b7-01"), "peer": display("10.0.0.1:1234")})
        log(logging.getLogger("ztunnel.proxy.inbound"), logging.DEBUG, "received request", authority="10.0.0.2:80")
        manager = ConnectionManager()
        record = ConnectionRecord(
            direction=Direction.INBOUND,
            src=(ipaddress.ip_address("10.0.0.1"), 1234),
            dst=(ipaddress.ip_address("10.0.0.2"), 15008),
            mtls=True,
        )
        manager.register(record)
        manager.release(record, ResponseFlag.NONE, None)

    async def outside() -> None:
        logging.getLogger("ztunnel.proxy.inbound").debug("no span here")

    async def both(fmt_json: bool) -> None:
        await asyncio.gather(one_connection(fmt_json), outside())  # each a task: the span is the first's alone

    asyncio.run(both(False))
    asyncio.run(both(True))
    lines = flushed(stream).splitlines()
    plain = [line.split("\t") for line in lines if not line.startswith("{")]
    scopes = {p[3]: p[2] for p in plain}
    assert scopes["received request"] == f"ztunnel::proxy::inbound:inbound{{id={TRACE_ID} peer=10.0.0.1:1234}}"
    assert scopes["connection complete"] == "access"
    assert scopes["no span here"] == "ztunnel::proxy::inbound"
    records = {r["message"]: r for r in map(json.loads, (line for line in lines if line.startswith("{")))}
    assert records["received request"]["inbound"] == {"id": TRACE_ID, "peer": "10.0.0.1:1234"}
    assert "inbound" not in records["connection complete"] and "inbound" not in records["no span here"]


async def test_both_ztunnels_log_a_connection_under_one_trace_id(tmp_path: Path, stream: io.StringIO) -> None:
    """The outbound ztunnel's span id is the trace id of the traceparent it sends; the inbound one takes it from
    that header: one id across both ends of a connection."""
    setup_logging("info,ztunnel::proxy::outbound=debug,ztunnel::proxy::inbound=debug", stream=stream)
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    try:
        async with running_app(m.env_a()), running_app(m.env_b()):
            reader, writer = await m.socks5()
            writer.write(b"ping")
            assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
            writer.close()
    finally:
        await echo.stop()
    lines = [line.split("\t") for line in flushed(stream).splitlines()]
    started = [p[2] for p in lines if p[3] == "connection started"]
    received = [p[2] for p in lines if p[3] == "received request"]
    assert len(started) == 1 and len(received) == 1, (started, received)
    (trace_id,) = re.findall(r"^ztunnel::proxy::outbound:outbound\{id=([0-9a-f]{32})\}$", started[0])
    assert re.fullmatch(rf"ztunnel::proxy::inbound:inbound\{{id={trace_id} peer=[0-9.]+:\d+\}}", received[0])


# -- logs never block: a bounded queue and a writer thread --------------------------------------------------------


def test_a_full_queue_drops_and_counts_instead_of_blocking() -> None:
    """stdout is a pipe nobody reads: once the pipe (64 KiB) and the queue (100 lines here) are full, every further
    line is dropped and counted, and logging returns at once (a blocking write would hang this test)."""
    r, w = os.pipe()
    os.set_blocking(w, True)
    out = os.fdopen(w, "w")
    handler = NonBlockingHandler(out, limit=100)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("test.nonblocking")
    logger.propagate = False
    logger.addHandler(handler)
    before = dropped_lines()
    try:
        for i in range(20_000):
            logger.warning("line %d %s", i, "x" * 200)
        # At most the pipe's 64 KiB (~300 lines of 210 bytes), one batch in the writer and the queue got out.
        assert dropped_lines() - before >= 20_000 - 100 - 400
    finally:
        logger.removeHandler(handler)
        os.close(r)  # the writer's blocked write now fails (EPIPE): its lines are counted, and it goes on
        handler.close()
        out.close()


def test_lines_are_written_whole_and_in_order() -> None:
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    handler = NonBlockingHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("test.nonblocking.order")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for i in range(2000):
            logger.warning("%d %s", i, "y" * (i % 300))
        got = b""
        while got.count(b"\n") < 2000:
            got += os.read(r, 1 << 16)
    finally:
        logger.removeHandler(handler)
        handler.close()
        out.close()
        os.close(r)
    lines = got.decode().splitlines()
    assert lines == [f"{i} {'y' * (i % 300)}" for i in range(2000)]


def test_stalled_stdout_does_not_stall_tunnels(tmp_path: Path) -> None:
    """A ztunnel (control process and workers) whose stdout is a pipe nobody reads, with access logs at debug (two
    lines per connection): 400 connections through it all complete. Before, the first ~64 KiB of log lines filled
    the pipe and the next write blocked the event loop: the 118th connection stalled (measured)."""
    m = TwoNodeMesh(tmp_path)
    env = {"PATH": os.environ.get("PATH", ""), **m.env_a(RUST_LOG="info,access=debug")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ztunnel", "proxy"],
        env=env,
        stdout=subprocess.PIPE,  # never read
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        asyncio.run(_many_connections(m, proc, 400))
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


async def _many_connections(m: TwoNodeMesh, proc: subprocess.Popen[bytes], n: int) -> None:
    for _ in range(200):
        if proc.poll() is not None:
            raise AssertionError(f"ztunnel exited with {proc.returncode}")
        try:
            _, writer = await asyncio.open_connection(m.node_a, 15021)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    echo = await EchoServer().start(m.plain, 0)
    try:
        for i in range(n):
            reader, writer = await asyncio.wait_for(socks5_connect((m.node_a, 15080), m.plain, echo.address[1]), 10)
            writer.write(b"ping")
            try:
                assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping", i
            except TimeoutError:
                raise AssertionError(f"connection {i} stalled") from None
            writer.close()
    finally:
        await echo.stop()

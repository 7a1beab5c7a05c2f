from __future__ import annotations

import io
import ipaddress
import json
import logging
import re
from collections.abc import Iterator

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
    current_level,
    display,
    log,
    parse_log_filter,
    set_level,
    setup_logging,
)


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
    lines = stream.getvalue().splitlines()
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
    time, level, scope, message, fields = stream.getvalue().rstrip("\n").split("\t")
    assert time.endswith("Z") and "T" in time
    assert (level, scope, message) == ("info", "access", "connection complete")
    # As upstream's tracing fields: Display (%) bare, &str quoted, numbers and booleans bare.
    assert fields == 'src.addr=10.0.0.1:1234 direction="inbound" bytes_sent=5 ok=true'


def test_json_format(stream: io.StringIO) -> None:
    setup_logging("info", json_format=True, stream=stream)
    log(logging.getLogger("ztunnel.proxy.inbound"), logging.WARNING, "connection failed", error="denied")
    record = json.loads(stream.getvalue())
    assert record["level"] == "warn"
    assert record["scope"] == "ztunnel::proxy::inbound"
    assert record["message"] == "connection failed"
    assert record["error"] == "denied"
    assert list(record)[:4] == ["level", "time", "scope", "message"]


def test_levels_filter_and_change_at_run_time(stream: io.StringIO) -> None:
    setup_logging("warn,access=info", stream=stream)
    logging.getLogger("ztunnel.app").info("hidden")
    logging.getLogger("access").info("shown")
    assert "hidden" not in stream.getvalue() and "shown" in stream.getvalue()
    new = set_level(False, "ztunnel::app=debug")
    assert "ztunnel::app=debug" in new and current_level() == new
    logging.getLogger("ztunnel.app").debug("now visible")
    assert "now visible" in stream.getvalue()
    with pytest.raises(ValueError):
        set_level(False, "x=nope")
    set_level(True, "")
    logging.getLogger("ztunnel.app").info("hidden again")
    assert "hidden again" not in stream.getvalue()


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
    (line,) = stream.getvalue().splitlines()
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

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from ztunnel.telemetry import TRACE, current_level, log, parse_log_filter, set_level, setup_logging


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
        **{"src.addr": "10.0.0.1:1234", "bytes_sent": 5},
    )
    time, level, scope, message, fields = stream.getvalue().rstrip("\n").split("\t")
    assert time.endswith("Z") and "T" in time
    assert (level, scope, message) == ("info", "access", "connection complete")
    assert fields == 'src.addr="10.0.0.1:1234" bytes_sent=5'


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

"""Logging in upstream ztunnel's formats, with ``RUST_LOG``-style filters that can change at run time.

Plain lines are ``<RFC3339 UTC>\\t<level>\\t<scope>\\t<message>\\t<k=v ...>`` and JSON lines are
``{"level","time","scope","message",<fields>}`` (upstream ``telemetry.rs``). The scope is the logger name written
the way upstream writes its tracing targets (``ztunnel::proxy::inbound``); access logs use the scope ``access``.

Structured fields are passed as ``extra={"fields": {...}}`` (see :func:`log`), so the call site pays nothing for
formatting when the level is off: call sites on hot paths check ``logger.isEnabledFor`` first.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_LEVELS = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}
# Libraries whose debug output is per frame or per header (and costly to produce): they stay at warn unless a
# filter names them, as upstream silences hickory's server logs by default.
_QUIET = ("hpack", "h2", "hyperframe", "grpc", "aiohttp.access", "asyncio")
_NAMES = {TRACE: "trace", logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error"}


def parse_log_filter(spec: str) -> tuple[int | None, dict[str, int]]:
    """Parse ``info``, ``access=debug,info`` or ``ztunnel::proxy=trace`` into (default level, per-target levels).

    Targets are written Rust-style (``a::b``) or Python-style (``a.b``); both name the logger ``a.b``. A target
    without ``=`` is taken as a level when it is one (``info``), as tracing's ``Targets`` does.
    """
    default: int | None = None
    targets: dict[str, int] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        target, sep, level = item.partition("=")
        if not sep:
            if target.lower() in _LEVELS:
                default = _LEVELS[target.lower()]
                continue
            # A bare target enables everything for it, as tracing does.
            targets[_logger_name(target)] = TRACE
            continue
        if level.lower() not in _LEVELS:
            raise ValueError(f"unknown log level {level!r} in {item!r}; expected one of {', '.join(_LEVELS)}")
        if not target:
            raise ValueError(f"missing target before '=' in {item!r}")
        targets[_logger_name(target)] = _LEVELS[level.lower()]
    return default, targets


def _logger_name(target: str) -> str:
    return target.strip().replace("::", ".")


def _scope(name: str) -> str:
    return name.replace(".", "::")


def _timestamp(created: float) -> str:
    return _dt.datetime.fromtimestamp(created, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _plain_value(value: Any) -> str:
    # Upstream prints strings with Debug formatting (quoted) and addresses/numbers bare.
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        return "None"
    return str(value)


# Messages quote what peers sent (h2's ProtocolError text holds the illegal header byte, authorities, SNI ...); a
# raw CR/LF there would let a peer forge a log line, so the plain format escapes them as Rust's Debug would.
_LINE_BREAKS = str.maketrans({"\n": "\\n", "\r": "\\r"})


class PlainFormatter(logging.Formatter):
    """``time\\tlevel\\tscope\\tmessage\\tk=v ...``."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record.created)}\t{_NAMES.get(record.levelno, record.levelname.lower())}\t"
        message = record.getMessage()
        if "\n" in message or "\r" in message:
            message = message.translate(_LINE_BREAKS)
        line += f"{_scope(record.name)}\t{message}"
        fields: Mapping[str, Any] | None = getattr(record, "fields", None)
        if fields:
            line += "\t" + " ".join(f"{k}={_plain_value(v)}" for k, v in fields.items())
        if record.exc_info and record.levelno >= logging.ERROR:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``level``, ``time``, ``scope``, ``message``, then the fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "level": _NAMES.get(record.levelno, record.levelname.lower()),
            "time": _timestamp(record.created),
            "scope": _scope(record.name),
            "message": record.getMessage(),
        }
        fields: Mapping[str, Any] | None = getattr(record, "fields", None)
        if fields:
            for k, v in fields.items():
                out[k] = v if isinstance(v, str | int | float | bool) or v is None else str(v)
        if record.exc_info and record.levelno >= logging.ERROR:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class _LogState:
    """The configured default filter and the loggers it touched, so ``reset`` can undo run-time changes."""

    def __init__(self) -> None:
        self.default_spec = "info"
        self.current_spec = "info"
        self.touched: set[str] = set()


_state = _LogState()


def setup_logging(spec: str = "info", json_format: bool = False, stream: TextIO | None = None) -> None:
    """Install one handler on the root logger in the chosen format and apply the ``RUST_LOG``-style filter."""
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(JsonFormatter() if json_format else PlainFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    _state.default_spec = spec
    _apply(spec, reset=True)


def _apply(spec: str, reset: bool) -> None:
    default, targets = parse_log_filter(spec)
    if reset:
        for name in _state.touched:
            logging.getLogger(name).setLevel(logging.NOTSET)
        _state.touched.clear()
        default = logging.INFO if default is None else default
    if default is not None:
        logging.getLogger().setLevel(default)
        for name in _QUIET:
            if name not in targets:
                logging.getLogger(name).setLevel(max(default, logging.WARNING))
                _state.touched.add(name)
    for name, level in targets.items():
        logging.getLogger(name).setLevel(level)
        _state.touched.add(name)


def set_level(reset: bool, spec: str) -> str:
    """Change levels at run time (admin ``/logging``); returns the new effective filter. ``ValueError`` if bad.

    As upstream, the new directives are added to the current ones; ``reset`` starts again from the startup filter.
    """
    base = _state.default_spec if reset else _state.current_spec
    new_spec = f"{base},{spec}" if spec else base
    parse_log_filter(new_spec)  # validate before touching anything
    _apply(new_spec, reset=True)
    _state.current_spec = _normalize(new_spec)
    logging.getLogger("ztunnel.telemetry").info("new log filter is %s", _state.current_spec)
    return _state.current_spec


def current_level() -> str:
    return _state.current_spec


def _normalize(spec: str) -> str:
    default, targets = parse_log_filter(spec)
    parts = [f"{_scope(name)}={_NAMES.get(level, 'off')}" for name, level in sorted(targets.items())]
    if default is not None:
        parts.append(_NAMES.get(default, "off"))
    return ",".join(parts)


def log(logger: logging.Logger, level: int, message: str, **fields: Any) -> None:
    """Log ``message`` with structured ``fields`` (printed as ``k=v`` or JSON keys), if ``level`` is enabled."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"fields": fields})


def get_logger(module: str) -> logging.Logger:
    """The logger for a ztunnel module (``ztunnel.proxy.inbound`` prints as ``ztunnel::proxy::inbound``)."""
    return logging.getLogger(module)


__all__ = [
    "TRACE",
    "JsonFormatter",
    "PlainFormatter",
    "current_level",
    "get_logger",
    "log",
    "parse_log_filter",
    "set_level",
    "setup_logging",
]

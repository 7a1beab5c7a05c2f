"""Logging in upstream ztunnel's formats, with ``RUST_LOG``-style filters that can change at run time.

Plain lines are ``<RFC3339 UTC>\\t<level>\\t<scope>\\t<message>\\t<k=v ...>`` and JSON lines are
``{"level","time","scope","message",<fields>}`` (upstream ``telemetry.rs``). The scope is the logger name written
the way upstream writes its tracing targets (``ztunnel::proxy::inbound``); access logs use the scope ``access``.

Structured fields are passed as ``extra={"fields": {...}}`` (see :func:`log`), so the call site pays nothing for
formatting when the level is off: call sites on hot paths check ``logger.isEnabledFor`` first.

**Spans**, as upstream's tracing spans: a connection's task enters one (:func:`enter_span`: ``inbound{id, peer}``,
``outbound{id}``), and every line logged from that task carries it: ``scope:inbound{id=<trace id> peer=<addr>}`` in
plain lines, an ``"inbound": {...}`` object in JSON lines. The id is the trace id of the connection's
``traceparent`` (:func:`span_id`): inbound, the one the client sent, so both ztunnels' lines of a connection share
it. The span lives in a context variable, which each asyncio task copies when it is created, so concurrent
connections never see each other's. Access-log lines (scope ``access``) are written outside any span, as upstream
writes them (``parent: None``).

**Logs never block the data path** (upstream ``telemetry/nonblocking.rs``): a line is formatted where it is logged
and put on a bounded queue (:data:`BUFFERED_LINES_LIMIT`, 128,000 lines, upstream's); a writer thread writes it to
stdout. When the queue is full (stdout is a pipe nobody reads, a slow terminal, a stalled log shipper) the line is
dropped and counted (``ztunnel_log_lines_dropped_total``), never awaited: a stalled stdout cannot stall the event
loop, so tunnels keep flowing. The writer writes whole lines, at most :data:`WRITE_BATCH` bytes at a time (a pipe
write up to ``PIPE_BUF``, 4,096 bytes, is atomic, so the worker processes sharing stdout never split each other's
lines).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import errno
import json
import logging
import os
import queue
import random
import re
import select
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping
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


# -- untrusted text in log lines ---------------------------------------------------------------------------------
#
# Field values and messages quote what peers sent (a 40 KB ``:authority``, baggage, h2 error text holding the
# offending header bytes, SNI ...). Two rules keep such text from hurting the log:
#
# * Length. Every field value is cut at MAX_FIELD_CHARS characters and every message at MAX_MESSAGE_CHARS, with a
#   marker saying how many characters were cut (``...<cut 39000 chars>``). 1,024 holds any legitimate value: a
#   SPIFFE identity is at most 9 + 253 + 4 + 63 + 4 + 253 = 586 characters (trust domain and service account are
#   DNS subdomains, the namespace a DNS label), a hostname 253 plus a port; a message may describe several of them.
#   So a 40 KB authority now makes a ~1 KB field, not a 100 KB line.
# * Escaping. Control and format characters (Unicode Cc, Cf: CR/LF, ESC, BIDI overrides U+202A-U+202E and
#   isolates U+2066-U+2069, U+200E/F marks ...), separators other than the space (Zl, Zp, Zs) and unassigned, private
#   or surrogate code points never reach the output raw, in either format: in plain lines a string field is written
#   exactly as upstream's tracing writes it, Rust's ``{:?}`` of a ``str`` (quoted; ``\\t \\r \\n \\0 \\" \\\\``;
#   ``\\u{202e}`` for the rest; Rust's "printable" set is the one ``str.isprintable`` implements, and its
#   grapheme-extend escape is approximated by categories Mn and Me); in JSON lines they become ``\\uXXXX`` escapes
#   (upstream's serde_json leaves U+202E raw; JSON readers decode the escape, so only the raw line changes).

MAX_FIELD_CHARS = 1024
MAX_MESSAGE_CHARS = 4096

_DEBUG_ESCAPES = {"\t": "\\t", "\r": "\\r", "\n": "\\n", "\0": "\\0", '"': '\\"', "\\": "\\\\"}


class Display(str):
    """A field value written bare in plain lines, like tracing's ``%value`` (Display) fields: upstream writes
    addresses (``src.addr=10.0.0.1:1234``) and the HBONE authority this way, and strings quoted. A value that is not
    one plain token (it holds a space, a quote, a backslash or a character that is escaped) is quoted after all, so
    a peer cannot forge ``k=v`` pairs through it. JSON lines hold it as a string either way.

    A ``str`` subclass, so everything but the plain formatter (JSON, tests, admin views) sees the plain string."""

    __slots__ = ()


def display(text: str) -> Display:
    """Mark ``text`` to be written bare in plain lines (see :class:`Display`)."""
    return Display(text)


def _cut_marker(cut: int) -> str:
    return f"...<cut {cut} chars>"


def _escape_char(c: str) -> str:
    esc = _DEBUG_ESCAPES.get(c)
    if esc is not None:
        return esc
    if c.isprintable() and (c.isascii() or unicodedata.category(c) not in ("Mn", "Me")):
        return c
    return f"\\u{{{ord(c):x}}}"


def _plain_text(text: str, limit: int) -> tuple[str, bool]:
    """``text`` escaped as Rust's ``{:?}`` escapes a ``str`` (without the quotes), at most ``limit`` characters of
    output plus a cut marker; and whether it was a plain token (nothing escaped, no space) that may go bare."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        if len(text) <= limit:
            return text, " " not in text
        return text[:limit] + _cut_marker(len(text) - limit), False
    escaped = _escaped(text, limit, _escape_char)
    return escaped, escaped == text and " " not in text  # a cut ends in a marker with spaces: never bare


def _escaped(text: str, limit: int, escape: Callable[[str], str]) -> str:
    """The slow path (non-ASCII, or something to escape): ``escape`` of each character, at most ``limit``
    characters of output (escapes grow the text up to 10x, so the budget is on the output), then a cut marker."""
    out: list[str] = []
    used = 0
    for i, c in enumerate(text):
        esc = escape(c)
        used += len(esc)
        if used > limit:
            out.append(_cut_marker(len(text) - i))
            break
        out.append(esc)
    return "".join(out)


def _escape_message_char(c: str) -> str:
    # A message has no quotes around it to break out of: quotes and backslashes stay as they are.
    return c if c in ('"', "\\") else _escape_char(c)


def _plain_value(value: Any) -> str:
    # As upstream's plain format: strings Debug-formatted (quoted, escaped), numbers and booleans bare (Rust's
    # ``true``/``false``), Display values bare when they are one plain token.
    if isinstance(value, Display):
        text, bare = _plain_text(value, MAX_FIELD_CHARS)
        return text if bare else f'"{text}"'
    if isinstance(value, str):
        return f'"{_plain_text(value, MAX_FIELD_CHARS)[0]}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if value is None:
        return "None"
    text, bare = _plain_text(str(value), MAX_FIELD_CHARS)
    return text if bare else f'"{text}"'


def _plain_message(message: str) -> str:
    # Upstream writes the message bare (Display); here it is escaped as a string would be, minus the quote and
    # backslash escapes (a message has no quotes around it to break out of), and cut at MAX_MESSAGE_CHARS.
    if message.isascii() and message.isprintable() and len(message) <= MAX_MESSAGE_CHARS:
        return message
    return _escaped(message, MAX_MESSAGE_CHARS, _escape_message_char)


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + _cut_marker(len(text) - limit)


def _json_escape_nonprintable(line: str) -> str:
    """``json.dumps`` escapes C0 controls, ``"`` and ``\\`` only: escape every other character ``str.isprintable``
    refuses (DEL, C1, BIDI controls, U+2028 ...) as ``\\uXXXX`` (a surrogate pair above U+FFFF)."""
    out: list[str] = []
    for c in line:
        if c.isprintable():
            out.append(c)
            continue
        cp = ord(c)
        if cp > 0xFFFF:
            cp -= 0x10000
            out.append(f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04x}")
        else:
            out.append(f"\\u{cp:04x}")
    return "".join(out)


class PlainFormatter(logging.Formatter):
    """``time\\tlevel\\tscope\\tmessage\\tk=v ...``; untrusted text bounded and escaped (see above)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record.created)}\t{_NAMES.get(record.levelno, record.levelname.lower())}\t"
        line += f"{_scope(record.name)}{_plain_span(getattr(record, 'span', None))}"
        line += f"\t{_plain_message(record.getMessage())}"
        fields: Mapping[str, Any] | None = getattr(record, "fields", None)
        if fields:
            line += "\t" + " ".join(f"{k}={_plain_value(v)}" for k, v in fields.items())
        if record.exc_info and record.levelno >= logging.ERROR:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``level``, ``time``, ``scope``, ``message``, then the fields; untrusted text bounded
    and escaped (see above)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "level": _NAMES.get(record.levelno, record.levelname.lower()),
            "time": _timestamp(record.created),
            "scope": _scope(record.name),
            "message": _bounded(record.getMessage(), MAX_MESSAGE_CHARS),
        }
        fields: Mapping[str, Any] | None = getattr(record, "fields", None)
        if fields:
            for k, v in fields.items():
                if isinstance(v, str):
                    out[k] = _bounded(v, MAX_FIELD_CHARS)
                elif isinstance(v, int | float | bool) or v is None:
                    out[k] = v
                else:
                    out[k] = _bounded(str(v), MAX_FIELD_CHARS)
        span: Span | None = getattr(record, "span", None)
        if span is not None:
            out[span[0]] = {
                k: v if isinstance(v, int | float | bool) else _bounded(str(v), MAX_FIELD_CHARS)
                for k, v in span[1].items()
            }
        if record.exc_info and record.levelno >= logging.ERROR:
            out["exception"] = self.formatException(record.exc_info)
        line = json.dumps(out, ensure_ascii=False)
        return line if line.isprintable() else _json_escape_nonprintable(line)


# -- spans ----------------------------------------------------------------------------------------------------------

Span = tuple[str, Mapping[str, Any]]
_span_rng = random.Random()
# ``version-traceid-parentid-flags``, 2-32-16-2 hex digits (55 characters): one C match instead of a split, a list
# and a set per field (8 Python calls per inbound stream).
_TRACEPARENT = re.compile(r"[0-9a-fA-F]{2}-([0-9a-fA-F]{32})-[0-9a-fA-F]{16}-[0-9a-fA-F]{2}")


def span_id(traceparent: str | None) -> Display:
    """The span id of a connection's access record: the trace id (32 hex digits) of the W3C ``traceparent`` the
    peer sent, as upstream's inbound does; a new random one when it is missing or malformed (upstream requires 55
    characters and four hex fields ``version-traceid-parentid-flags``)."""
    if traceparent is not None:
        m = _TRACEPARENT.fullmatch(traceparent)
        if m is not None:
            return Display(m.group(1).lower())  # the 32 hex digits as upstream writes them (lowercase)
    return Display(f"{_span_rng.getrandbits(128):032x}")  # written bare, as upstream's %id


_current_span: contextvars.ContextVar[Span | None] = contextvars.ContextVar("ztunnel_log_span", default=None)


def enter_span(name: str, fields: Mapping[str, Any]) -> None:
    """Log everything the current task logs from now on within the span ``name{fields}`` (a connection's task calls
    it once, at its start; the task's context ends with it)."""
    _current_span.set((name, fields))


class _SpanFilter(logging.Filter):
    """Attaches the current task's span to each record, except access-log lines (upstream: ``parent: None``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        span = _current_span.get()
        if span is not None and record.name != "access" and not hasattr(record, "span"):
            record.span = span
        return True


def _plain_span(span: Span | None) -> str:
    if span is None:
        return ""
    name, fields = span
    inner = " ".join(f"{k}={_plain_value(v)}" for k, v in fields.items())
    return f":{name}{{{inner}}}" if inner else f":{name}"


# -- the non-blocking writer ----------------------------------------------------------------------------------------

BUFFERED_LINES_LIMIT = 128_000  # upstream DEFAULT_BUFFERED_LINES_LIMIT
WRITE_BATCH = 4096  # PIPE_BUF: one write of whole lines up to this size is atomic on a pipe
_dropped = [0]  # lines dropped because the queue was full (or stdout is gone), this process


def dropped_lines() -> int:
    """Log lines this process dropped because its stdout did not keep up (``ztunnel_log_lines_dropped_total``)."""
    return _dropped[0]


class NonBlockingHandler(logging.Handler):
    """Formats on the caller's thread, queues the line (bounded), and a writer thread writes it: see the module
    docstring. ``flush`` waits (bounded) until what was queued is written."""

    def __init__(self, stream: TextIO, limit: int = BUFFERED_LINES_LIMIT) -> None:
        super().__init__()
        self.addFilter(_SpanFilter())
        self.stream = stream
        self.limit = limit
        try:
            self._fd: int | None = stream.fileno()
            stream.flush()  # what the stream buffered before is written before our lines
        except (AttributeError, OSError, ValueError):
            self._fd = None  # an in-memory stream (tests): written with its own write()
        self._start()

    def _start(self) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue(self.limit)
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def after_fork(self) -> None:
        """In a forked child: a fresh queue and writer (the parent's thread does not exist here, and its queue's
        lock may have been held at the fork). Lines the parent had queued are the parent's to write."""
        self._start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:
            self.handleError(record)
            return
        self._idle.clear()
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            _dropped[0] += 1

    def _run(self) -> None:
        q = self._queue
        while True:
            if q.empty():
                self._idle.set()
            line = q.get()
            if line is None:
                self._idle.set()
                return
            batch, stop = [line.encode("utf-8", "backslashreplace")], False
            size = len(batch[0])
            while size < WRITE_BATCH:
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                data = nxt.encode("utf-8", "backslashreplace")
                if size + len(data) > WRITE_BATCH:
                    self._write(b"".join(batch))
                    batch, size = [], 0
                batch.append(data)
                size += len(data)
            if batch:
                self._write(b"".join(batch))
            if stop:
                self._idle.set()
                return

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            try:
                self.stream.write(data.decode("utf-8", "replace"))
                self.stream.flush()
            except Exception:
                _dropped[0] += data.count(b"\n")
            return
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._fd, view)
            except BlockingIOError:  # stdout shared with a non-blocking terminal: wait until it takes more
                select.select([], [self._fd], [], 1.0)
                continue
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                _dropped[0] += bytes(view).count(b"\n")  # EPIPE, EBADF...: nowhere to write
                return
            view = view[n:]

    def flush(self, timeout: float = 1.0) -> None:
        """Wait up to ``timeout`` seconds for the queued lines to be written (never longer: stdout may be stalled,
        and exiting must not wait for it)."""
        if threading.current_thread() is self._thread:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._idle.wait(max(0.0, deadline - time.monotonic())) and self._queue.empty():
                return
            time.sleep(0.001)

    def close(self) -> None:
        self.flush()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        super().close()


def _reinit_after_fork() -> None:
    for h in logging.getLogger().handlers:
        if isinstance(h, NonBlockingHandler):
            h.after_fork()


os.register_at_fork(after_in_child=_reinit_after_fork)


def flush_logs(timeout: float = 1.0) -> None:
    """Wait (at most ``timeout`` s per handler) until the queued log lines are written."""
    for h in logging.getLogger().handlers:
        if isinstance(h, NonBlockingHandler):
            h.flush(timeout)


class _LogState:
    """The configured default filter and the loggers it touched, so ``reset`` can undo run-time changes."""

    def __init__(self) -> None:
        self.default_spec = "info"
        self.current_spec = "info"
        self.touched: set[str] = set()


_state = _LogState()


def setup_logging(spec: str = "info", json_format: bool = False, stream: TextIO | None = None) -> None:
    """Install one handler on the root logger in the chosen format and apply the ``RUST_LOG``-style filter."""
    # Neither format writes the process id, and LogRecord asks os.getpid() for it on every record: a system call
    # per access-log line (one per connection and side).
    logging.logProcesses = False
    handler = NonBlockingHandler(stream or sys.stdout)
    handler.setFormatter(JsonFormatter() if json_format else PlainFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()  # a NonBlockingHandler writes what it queued first (bounded)
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
    "BUFFERED_LINES_LIMIT",
    "MAX_FIELD_CHARS",
    "MAX_MESSAGE_CHARS",
    "TRACE",
    "Display",
    "JsonFormatter",
    "NonBlockingHandler",
    "PlainFormatter",
    "current_level",
    "display",
    "dropped_lines",
    "enter_span",
    "flush_logs",
    "get_logger",
    "log",
    "parse_log_filter",
    "set_level",
    "setup_logging",
    "span_id",
]

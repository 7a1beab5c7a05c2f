"""Prometheus metrics with upstream's names, labels and HELP text, served on 15020 (upstream ``metrics.rs``).

The proxy does not use prometheus-client: a metric child is a plain object with a ``value`` field, found once per
connection (``family.child(labels)``) and incremented with ``child.value += n`` (~30 ns; prometheus-client's
``labels(**kw).inc()`` is ~5 µs with 23 labels and its cached child ~0.3 µs behind a lock, measured on these
machines), and the families are written in its text format at scrape time (:func:`render`), which also lets a
family carry label sets of different shapes, as upstream's optional locality labels need. Not importing it keeps
2.1 MiB of objects out of every data-plane worker (docs/process-model.md); the tests hold its parser and its
output as the oracle of ours.

Stable metrics (no "unstable" in HELP, exactly upstream's set that applies to a Python process): ``istio_build``,
the four ``istio_tcp_*`` series, ``process_open_fds`` and ``process_max_fds``. Upstream also exports ``tokio_*``
runtime gauges, which describe the Rust async runtime; in their place each process reports its event loop's lag
and tasks and its garbage-collection pauses (:class:`RuntimeMetrics`), and the log lines it dropped. Every other
metric says "unstable" in its HELP, as upstream requires of non-stable metrics.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import logging
import os
import resource
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import NamedTuple, Protocol

from ztunnel import __version__
from ztunnel.config import SocketAddress
from ztunnel.http import HttpServer
from ztunnel.telemetry import dropped_lines

log = logging.getLogger("ztunnel.metrics")

Labels = tuple[tuple[str, str], ...]


class Sample(NamedTuple):
    """One sample of a family, as prometheus-client's ``Sample`` (its first three fields): the data-plane workers
    do not import prometheus-client (2.1 MiB of objects in every worker: docs/process-model.md, "A worker's idle
    memory"), so the families they expose are these."""

    name: str
    labels: dict[str, str]
    value: float


class Metric:
    """One metric family at scrape time, with prometheus-client's ``Metric`` attributes (``name``,
    ``documentation``, ``type``, ``unit``, ``samples``); its name gets ``_<unit>`` appended unless it ends so, as
    there. What :func:`render` writes and :mod:`ztunnel.metrics_merge` merges."""

    __slots__ = ("documentation", "name", "samples", "type", "unit")

    def __init__(self, name: str, documentation: str, typ: str, unit: str = "") -> None:
        if unit and not name.endswith("_" + unit):
            name += "_" + unit
        self.name = name
        self.documentation = documentation
        self.type = typ
        self.unit = unit
        self.samples: list[Sample] = []


class Collector(Protocol):
    """Something with families of its own to write beside the registry's (the DNS proxy's metrics)."""

    def collect(self) -> Iterable[Metric]: ...


class Child:
    """One labelled series: a bare number the hot path adds to."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class Family:
    """A metric family: ``counter`` or ``gauge``, children keyed by their label tuples (order is kept on output)."""

    def __init__(self, name: str, help: str, kind: str = "counter", unit: str = "") -> None:
        self.name = name
        self.help = help
        self.kind = kind
        self.unit = unit
        self.children: dict[Labels, Child] = {}

    def child(self, labels: Labels = ()) -> Child:
        c = self.children.get(labels)
        if c is None:
            c = self.children[labels] = Child()
        return c

    def samples(self) -> Iterator[tuple[str, Labels, float]]:
        """(sample name, labels, value) of every child, in insertion order (what :meth:`metric` writes)."""
        name = self.name + "_total" if self.kind == "counter" else self.name
        for labels, c in self.children.items():
            yield name, labels, c.value

    def metric(self) -> Metric:
        m = Metric(self.name, self.help, self.kind, self.unit)
        m.samples = [Sample(n, dict(labels), v) for n, labels, v in self.samples()]
        return m


class Histogram:
    """A histogram family with fixed buckets (event-loop lag, GC pauses, DNS upstream latency). With a ``unit``
    the name ends in ``_<unit>``, as prometheus-client names it."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Iterable[float], unit: str = "") -> None:
        if unit and not name.endswith("_" + unit):
            name += "_" + unit
        self.name = name
        self.help = help
        self.unit = unit
        self.buckets = tuple(sorted(buckets))
        self.children: dict[Labels, list[float]] = {}

    def observe(self, labels: Labels, value: float) -> None:
        c = self.children.get(labels)
        if c is None:
            c = self.children[labels] = [0.0] * (len(self.buckets) + 2)  # bucket counts, +Inf, sum
        for i, b in enumerate(self.buckets):
            if value <= b:
                c[i] += 1
        c[-2] += 1
        c[-1] += value

    def samples(self) -> Iterator[tuple[str, Labels, float]]:
        """(sample name, labels, value): per child its buckets (``le`` last), ``+Inf``, ``_count``, ``_sum``."""
        bucket, les = self.name + "_bucket", [_fmt(b) for b in self.buckets]
        for labels, c in self.children.items():
            for i, le in enumerate(les):
                yield bucket, (*labels, ("le", le)), c[i]
            yield bucket, (*labels, ("le", "+Inf")), c[-2]
            yield self.name + "_count", labels, c[-2]
            yield self.name + "_sum", labels, c[-1]

    def metric(self) -> Metric:
        m = Metric(self.name, self.help, "histogram", self.unit)
        m.samples = [Sample(n, dict(labels), v) for n, labels, v in self.samples()]
        return m


def _fmt(v: float) -> str:
    return repr(float(v))


class Registry:
    """Our families, callbacks computed at scrape time, and the families of other parts (``extra`` collectors)."""

    def __init__(self, istio_version: str = "") -> None:
        self.families: list[Family | Histogram] = []
        self.dynamic: list[Callable[[], Iterable[Metric]]] = []
        # Other components' families (the DNS proxy's), written after ours.
        self.extra: list[Collector] = []
        build = self.family("istio_build", "Istio component build info", "gauge")
        build.child((("component", "ztunnel"), ("tag", istio_version or __version__))).value = 1
        RUNTIME.ensure_started()  # the registry of a running process: its loop is probed from now on

    def family(self, name: str, help: str, kind: str = "counter", unit: str = "") -> Family:
        f = Family(name, help, kind, unit)
        self.families.append(f)
        return f

    def histogram(self, name: str, help: str, buckets: Iterable[float]) -> Histogram:
        h = Histogram(name, help, buckets)
        self.families.append(h)
        return h

    def collect(self) -> Iterator[Metric]:
        """Our families, then the callbacks' and the process's (without the extra registries)."""
        for f in self.families:
            yield f.metric()
        yield from self._computed()

    def _computed(self) -> Iterator[Metric]:
        for cb in self.dynamic:
            try:
                yield from cb()
            except Exception:  # a broken callback must not break the scrape
                log.exception("metrics callback failed")
        yield from _process_fds()
        yield from _log_drops()
        yield from RUNTIME.metrics()

    def computed(self) -> Iterator[Metric]:
        """The families made at scrape time, in exposition order after our own: callbacks, the process's
        descriptors, then the extra collectors' families."""
        yield from self._computed()
        for extra in self.extra:
            yield from extra.collect()

    def exposed(self) -> Iterator[Metric]:
        """Every family ``/metrics`` shows, in its order: our families, then :meth:`computed`."""
        for f in self.families:
            yield f.metric()
        yield from self.computed()


def _process_fds() -> Iterator[Metric]:
    try:
        open_fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        return
    m = Metric("process_open_fds", "Number of open file descriptors.", "gauge")
    m.samples.append(Sample("process_open_fds", {}, float(open_fds)))
    yield m
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    m = Metric("process_max_fds", "Maximum number of open file descriptors.", "gauge")
    m.samples.append(Sample("process_max_fds", {}, float(soft)))
    yield m


# -- runtime health (in place of upstream's tokio_* gauges) -------------------------------------------------------

LAG_INTERVAL = 0.25  # how often the loop-lag probe wakes: 4 wakeups a second, nothing measurable
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


class RuntimeMetrics:
    """This process's event loop and interpreter, for ``/metrics`` (one per process: :data:`RUNTIME`).

    - ``ztunnel_event_loop_lag_seconds`` (histogram): how late a timer due every :data:`LAG_INTERVAL` seconds
      fired. Anything that holds the loop (a slow callback, a blocking call, a long GC) shows here; a healthy loop
      stays under a millisecond;
    - ``ztunnel_event_loop_tasks`` (gauge): the asyncio tasks alive on the loop (a task leak grows it);
    - ``ztunnel_gc_pause_seconds`` (histogram, label ``generation``): each garbage collection, timed by
      ``gc.callbacks``: the interpreter stops everything else meanwhile;
    - with ``process_open_fds`` (already exported) these replace upstream's ``tokio_*`` runtime metrics.

    In the multi-process mode every process has its own and the control process's ``/metrics`` sums them (the
    histograms are then the distribution over every loop, the tasks all of them). The lag probe is started on the
    running loop by :meth:`ensure_started` (the metrics registry of each process calls it), and again on a new
    loop if the process runs another (tests do).
    """

    def __init__(self) -> None:
        self.lag = Histogram(
            "ztunnel_event_loop_lag_seconds",
            "How late the event loop ran a timer due every 250 ms, in seconds (unstable)",
            LAG_BUCKETS,
        )
        self.gc_pause = Histogram(
            "ztunnel_gc_pause_seconds",
            "Time the Python garbage collector paused the process, in seconds (unstable)",
            GC_BUCKETS,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._gc_started = 0.0
        self._gc_installed = False

    def ensure_started(self) -> None:
        """Start the lag probe on the running loop (no-op without one, or when it already runs there)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if not self._gc_installed:
            gc.callbacks.append(self._on_gc)
            self._gc_installed = True
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        self._loop = loop
        self._task = loop.create_task(self._probe(), name="runtime metrics: event-loop lag probe")

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        observe = self.lag.observe
        while True:
            due = loop.time() + LAG_INTERVAL
            await asyncio.sleep(LAG_INTERVAL)
            observe((), max(0.0, loop.time() - due))

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self.gc_pause.observe(
                (("generation", str(info.get("generation", -1))),), time.perf_counter() - self._gc_started
            )
            self._gc_started = 0.0

    def metrics(self) -> Iterator[Metric]:
        self.ensure_started()
        yield self.lag.metric()
        loop = self._loop
        tasks = Metric("ztunnel_event_loop_tasks", "Tasks alive on the event loop (unstable)", "gauge")
        if loop is not None and not loop.is_closed():
            try:
                n = len(asyncio.all_tasks(loop))
            except RuntimeError:  # the set changed while counted (another thread's loop): next scrape
                n = 0
            tasks.samples.append(Sample("ztunnel_event_loop_tasks", {}, float(n)))
        yield tasks
        yield self.gc_pause.metric()


RUNTIME = RuntimeMetrics()


def _log_drops() -> Iterator[Metric]:
    m = Metric(
        "ztunnel_log_lines_dropped",
        "Log lines dropped because stdout did not take them fast enough (unstable)",
        "counter",
    )
    m.samples.append(Sample("ztunnel_log_lines_dropped_total", {}, float(dropped_lines())))
    yield m


# -- encoding and the 15020 server -------------------------------------------------------------------------------

OPENMETRICS = "application/openmetrics-text"
# Upstream's two Content-Types, byte for byte (``metrics/server.rs::content_type``). The body is OpenMetrics text
# either way, as upstream's prometheus-client writes it; only the header follows the Accept header.
OPENMETRICS_TYPE = "application/openmetrics-text;charset=utf-8;version=1.0.0"
PLAINTEXT_TYPE = "text/plain; charset=utf-8"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if v == int(v) and abs(v) < 2**53:
        return str(int(v))
    return repr(float(v))


def _write(metrics: Iterable[Metric]) -> bytes:
    """OpenMetrics text exposition with labels in the order they were given.

    prometheus-client's encoders sort label names; upstream writes CommonTrafficLabels in struct order, which
    dashboards and diffs of scrapes rely on, so the (small) writer is our own. As upstream's prometheus-client
    (0.24.1+), a family with no series is left out entirely (no HELP/TYPE lines).
    """
    out: list[str] = []
    for m in metrics:
        if not m.samples:
            continue
        family = m.name  # OpenMetrics names a counter family without _total; its samples carry it
        out.append(f"# HELP {family} {_escape_help(m.documentation)}\n")
        out.append(f"# TYPE {family} {m.type}\n")
        if m.unit:
            out.append(f"# UNIT {family} {m.unit}\n")
        for s in m.samples:
            if s.labels:
                labels = ",".join(f'{k}="{_escape_value(v)}"' for k, v in s.labels.items())
                out.append(f"{s.name}{{{labels}}} {_number(s.value)}\n")
            else:
                out.append(f"{s.name} {_number(s.value)}\n")
    out.append("# EOF\n")
    return "".join(out).encode()


def wants_openmetrics(accept: str) -> bool:
    """Upstream's Accept check: some media range (``,``-separated, parameters after ``;``) is OpenMetrics."""
    return any(r.split(";", 1)[0].strip().lower() == OPENMETRICS for r in accept.split(","))


def encode(registry: Registry, accept: str = "", accept_encoding: str = "") -> tuple[bytes, dict[str, str]]:
    """The scrape body and headers of ``registry``'s families (:meth:`Registry.exposed`): see :func:`render`."""
    return render(registry.exposed(), accept, accept_encoding)


def render(metrics: Iterable[Metric], accept: str = "", accept_encoding: str = "") -> tuple[bytes, dict[str, str]]:
    """The scrape body and headers: OpenMetrics text, labelled as such when the Accept header asks for it and as
    ``text/plain`` otherwise (upstream); gzip when accepted."""
    body = _write(metrics)
    headers = {"Content-Type": OPENMETRICS_TYPE if wants_openmetrics(accept) else PLAINTEXT_TYPE}
    if "gzip" in accept_encoding:
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    return body, headers


class StatsServer:
    """``/metrics`` and ``/stats/prometheus`` on 15020; anything else is 404, as upstream.

    What a scrape shows is ``registry``'s families, or what ``collect`` returns when given: the control process of
    the multi-process mode passes the families merged from its workers (:mod:`ztunnel.metrics_merge`), which it
    has to ask them for, hence a coroutine.
    """

    def __init__(self, registry: Registry, collect: Callable[[], Awaitable[Iterable[Metric]]] | None = None) -> None:
        self.registry = registry
        self.collect = collect
        self._http: HttpServer | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        return self._http.address if self._http is not None else None

    async def start(self, addr: SocketAddress) -> None:
        from aiohttp import web

        async def metrics(request: web.Request) -> web.Response:
            families = self.registry.exposed() if self.collect is None else await self.collect()
            body, headers = render(
                families,
                ",".join(request.headers.getall("Accept", ())),
                request.headers.get("Accept-Encoding", ""),
            )
            return web.Response(body=body, headers=headers)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/stats/prometheus", metrics)
        self._http = HttpServer(app, name="stats")
        await self._http.start(addr)

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()

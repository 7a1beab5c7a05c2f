"""One ``/metrics`` for many processes: a data-plane worker's metric families as a picklable :class:`Snapshot`, and
the control process's merge of its workers' snapshots with its own families.

Why not prometheus-client's multiprocess mode: the data path increments the project's own
:class:`~ztunnel.metrics.Child` (``child.value += n``, ~30 ns; a prometheus-client child behind its lock is ~0.3 µs
and ``labels(...).inc()`` ~5 µs with 23 labels); multiprocess mode only works with prometheus-client's own metric
classes, each backed by an mmap'd file per process and metric type that every increment writes to, and a different
collector that reads all those files at scrape time. The families here cost the data path nothing; the cost is at
scrape time (the control process asks each worker for its snapshot).

The merge, by kind of family:

* **counters and histograms** (and summaries) are summed per (sample name, labels) over the live workers and what
  workers that exited had counted (:meth:`MetricsMerger.exited`): a restart never makes a counter go backwards
  and never loses a series;
* **gauges** are summed over the live workers and the control process (each holds its own share, e.g. its open
  sockets or descriptors); a dead worker's gauges are dropped (its sockets are gone);
* **families that describe one process** (``istio_build``, ``process_max_fds``: the limit each process has) come
  from the control process only.

Family order, label order and sample order are those of the inputs, so the merge of one worker and the control
process is, byte for byte, what one process would show with the same samples: families the control process does not
have are placed after the family that precedes them in the worker's own list (every worker's list starts with
``istio_build`` and has the process families, which anchor them). Workers run the same program at the same version,
so one label set always comes in one order; series are matched on the label tuple as given.

Per-worker load is the merger's own (unstable) families, with a ``worker`` label (the worker's index):
``ztunnel_worker_connections_opened_total`` (its ``istio_tcp_connections_opened``, all reporters),
``ztunnel_worker_sockets_open`` (its ``istio_tcp_sockets_open``) and ``ztunnel_worker_cpu_seconds_total`` (the
worker process's user + system CPU); counters include the index's earlier incarnations.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ztunnel.metrics import Labels, Metric, Registry, Sample

# Kinds whose samples only ever grow: kept for a worker that exited, and summed with its successors'.
CUMULATIVE = frozenset({"counter", "histogram", "summary"})
# Families that describe one process rather than work done: the control process's own value is the answer.
CONTROL_ONLY = frozenset({"istio_build", "process_max_fds"})

OPENED = "istio_tcp_connections_opened_total"
SOCKETS_OPEN = "istio_tcp_sockets_open"
WORKER_OPENED = "ztunnel_worker_connections_opened"
WORKER_SOCKETS = "ztunnel_worker_sockets_open"
WORKER_CPU = "ztunnel_worker_cpu_seconds"

SampleTuple = tuple[str, Labels, float]


@dataclass(frozen=True, slots=True)
class FamilySnapshot:
    """One metric family: its name (without ``_total``), HELP text, kind, unit and samples."""

    name: str
    help: str
    kind: str
    unit: str
    samples: tuple[SampleTuple, ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one process exposes, taken at one moment: picklable, to cross the control channel.

    ``pid`` tells incarnations of a worker index apart; ``cpu_seconds`` is the process's user + system CPU.
    """

    families: tuple[FamilySnapshot, ...] = ()
    pid: int = 0
    cpu_seconds: float = 0.0


EMPTY = Snapshot()


def snapshot(registry: Registry) -> Snapshot:
    """Every family ``registry`` exposes (:meth:`~ztunnel.metrics.Registry.exposed`: its own families, callbacks,
    process descriptors, the extra collectors such as the DNS metrics), in exposition order.

    The project's own families are read from their children directly (label tuples are shared between the families
    of one connection, so pickle writes each label set once); the rest go through :class:`~ztunnel.metrics.Metric`.
    """
    out = [FamilySnapshot(f.name, f.help, f.kind, f.unit, tuple(f.samples())) for f in registry.families]
    for m in registry.computed():
        samples = tuple((s.name, tuple(s.labels.items()), float(s.value)) for s in m.samples)
        out.append(FamilySnapshot(m.name, m.documentation, m.type, m.unit, samples))
    return Snapshot(tuple(out), os.getpid(), cpu_now())


def retain(kept: Snapshot | None, last: Snapshot) -> Snapshot:
    """What an exited worker leaves behind: ``kept`` (its index's earlier incarnations) plus the cumulative families
    of its ``last`` snapshot (gauges dropped), and the CPU seconds of both."""
    families = _merge_families([(kept or EMPTY).families, [f for f in last.families if f.kind in CUMULATIVE]])
    return Snapshot(tuple(families), 0, (kept or EMPTY).cpu_seconds + last.cpu_seconds)


def merge(
    control: Snapshot,
    live: Mapping[int, Snapshot],
    retained: Mapping[int, Snapshot] | None = None,
    per_worker: bool = True,
) -> list[Metric]:
    """The exposition families: ``control``'s own, the ``live`` workers' (by index) and what exited workers counted
    (``retained``, by index, built with :func:`retain`), merged as the module says; then, with ``per_worker``, the
    ``ztunnel_worker_*`` families. Pure: the inputs are not changed."""
    retained = retained or {}
    sources: list[Iterable[FamilySnapshot]] = [control.families]
    sources += [[f for f in retained[i].families if f.kind in CUMULATIVE] for i in sorted(retained)]
    sources += [[_without_samples(f) if f.name in CONTROL_ONLY else f for f in live[i].families] for i in sorted(live)]
    out = [_metric(f) for f in _merge_families(sources)]
    if per_worker and (live or retained):
        out += _per_worker(live, retained)
    return out


@dataclass
class MetricsMerger:
    """The control process's view of its workers' metrics: each live worker's last snapshot and what exited workers
    counted. Feed it every snapshot a worker sends (:meth:`update`, from the periodic poll and each scrape) and every
    exit (:meth:`exited`); :meth:`families` gives what ``/metrics`` shows."""

    live: dict[int, Snapshot] = field(default_factory=dict)
    retained: dict[int, Snapshot] = field(default_factory=dict)

    def update(self, worker: int, snap: Snapshot) -> None:
        """A fresh snapshot of worker ``worker``. One from another process than the last (a restart whose exit was
        not reported) first retains what the previous one counted."""
        last = self.live.get(worker)
        if last is not None and last.pid != snap.pid:
            self.exited(worker)
        self.live[worker] = snap

    def exited(self, worker: int) -> None:
        """Worker ``worker`` is gone: its last snapshot's counters and histograms are kept, its gauges dropped.
        What it counted after that snapshot is lost (at most one poll interval)."""
        last = self.live.pop(worker, None)
        if last is not None:
            self.retained[worker] = retain(self.retained.get(worker), last)

    def families(self, control: Snapshot) -> list[Metric]:
        """The merged exposition families, ``control`` being the control process's own :func:`snapshot`."""
        return merge(control, self.live, self.retained)


# -- the merge -----------------------------------------------------------------------------------------------------


@dataclass
class _Family:
    name: str
    help: str
    kind: str
    unit: str
    values: dict[tuple[str, Labels], float] = field(default_factory=dict)


def _merge_families(sources: Iterable[Iterable[FamilySnapshot]]) -> list[FamilySnapshot]:
    """Families summed per (sample name, labels), in :func:`family_order`."""
    acc: dict[str, _Family] = {}
    lists: list[list[str]] = []
    for source in sources:
        names = []
        for f in source:
            fam = acc.get(f.name)
            if fam is None:
                fam = acc[f.name] = _Family(f.name, f.help, f.kind, f.unit)
            names.append(f.name)
            values = fam.values
            for name, labels, value in f.samples:
                key = (name, labels)
                values[key] = values.get(key, 0.0) + value
        lists.append(names)
    return [
        FamilySnapshot(f.name, f.help, f.kind, f.unit, tuple((n, lb, v) for (n, lb), v in f.values.items()))
        for f in (acc[name] for name in family_order(lists))
    ]


def family_order(lists: list[list[str]]) -> list[str]:
    """One order of every name that keeps each list's own order (when the lists agree; they do, being one program's).

    A topological sort of "follows in some list", depth first: after a name, what follows it in the latest list
    that continues from it comes next. So a family only a worker has lands right after the family that precedes
    it in the worker's list (the TCP families after ``istio_build``, before the control process's own, as one
    process registers them), and a list alone comes out unchanged. Names of lists that contradict each other come
    in order of first appearance where the sort is stuck.
    """
    first: dict[str, int] = {}
    successors: dict[str, list[str]] = {}
    preds: dict[str, int] = {}
    for names in lists:
        for name in names:
            first.setdefault(name, len(first))
            successors.setdefault(name, [])
            preds.setdefault(name, 0)
        for a, b in itertools.pairwise(names):
            if b not in successors[a]:
                successors[a].append(b)
                preds[b] += 1
    out: list[str] = []
    done: set[str] = set()
    stack = [n for n in reversed(first) if preds[n] == 0]
    while len(out) < len(first):
        if not stack:  # contradicting lists: take the earliest name left
            stack.append(next(n for n in first if n not in done))
        name = stack.pop()
        if name in done:
            continue
        done.add(name)
        out.append(name)
        for s in successors[name]:
            preds[s] -= 1
            if preds[s] == 0 and s not in done:
                stack.append(s)
    return out


def _without_samples(f: FamilySnapshot) -> FamilySnapshot:
    return FamilySnapshot(f.name, f.help, f.kind, f.unit, ())


def _metric(f: FamilySnapshot) -> Metric:
    m = Metric(f.name, f.help, f.kind, f.unit)
    m.samples = [Sample(name, dict(labels), value) for name, labels, value in f.samples]
    return m


def _sum(snap: Snapshot, sample: str) -> float:
    return sum(v for f in snap.families for name, _, v in f.samples if name == sample)


def _per_worker(live: Mapping[int, Snapshot], retained: Mapping[int, Snapshot]) -> list[Metric]:
    opened = Metric(WORKER_OPENED, "Connections opened by each data-plane worker process (unstable)", "counter")
    sockets = Metric(WORKER_SOCKETS, "Open TCP sockets in each data-plane worker process (unstable)", "gauge")
    cpu = Metric(WORKER_CPU, "User and system CPU of each data-plane worker process (unstable)", "counter", "seconds")
    for i in sorted(live.keys() | retained.keys()):
        labels = {"worker": str(i)}
        now, kept = live.get(i, EMPTY), retained.get(i, EMPTY)
        opened.samples.append(Sample(WORKER_OPENED + "_total", labels, _sum(now, OPENED) + _sum(kept, OPENED)))
        if i in live:
            sockets.samples.append(Sample(WORKER_SOCKETS, labels, _sum(now, SOCKETS_OPEN)))
        cpu.samples.append(Sample(WORKER_CPU + "_total", labels, now.cpu_seconds + kept.cpu_seconds))
    return [opened, sockets, cpu]


def cpu_now() -> float:
    """This process's user + system CPU seconds (what :func:`snapshot` records)."""
    times = os.times()
    return times.user + times.system

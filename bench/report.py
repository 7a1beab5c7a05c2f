"""From samples to answers: medians and spread, pairwise ratios, the issue's targets, Markdown, PNG charts.

Every sample is one measurement of one (scenario, case, mode, repetition). Summaries are the median over
repetitions with the min-max range as the spread. Ratios are computed **pair by pair**: for each repetition, mode
X's value divided by Envoy's (or direct's) value *of the same repetition*, measured minutes apart at most; the
median and range of those per-repetition ratios are reported, not the ratio of the medians. A machine that
slows down during a run then moves both sides of each ratio together.
"""

from __future__ import annotations

import operator
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.processes import label as variant_label
from bench.processes import short_label
from bench.topology import PATH_PROXIES

MODE_ORDER = ("direct", "tcp", "hbone", "envoy", "hbone-ns", "upstream", "loop", "upstream-loop", "ztunnel")
MODE_COLORS = {
    "direct": "#9e9e9e",
    "tcp": "#64b5f6",
    "hbone": "#1565c0",
    "envoy": "#e65100",
    "ztunnel": "#1565c0",
    "hbone-ns": "#0d47a1",
    "upstream": "#2e7d32",
    "loop": "#5c6bc0",
    "upstream-loop": "#81c784",
}
# Upstream's modes are divided into their partner only (the same namespaced shape with this ztunnel).
UPSTREAM_REFERENCES = {"upstream": "hbone-ns", "upstream-loop": "loop"}


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    better: str  # "higher" or "lower"
    fmt: str = ".2f"
    chart: bool = True
    table: bool = True  # False: summarized and compared, shown in the process-model section only


METRICS: dict[str, tuple[Metric, ...]] = {
    "throughput": (
        Metric("gbps", "Gbit/s", "higher"),
        Metric("gbit_per_cpu_s", "Gbit per proxy CPU-second", "higher"),
        Metric("fairness", "slowest / fastest stream", "higher", chart=False),
        Metric("proxy_cpu_s_per_gbit", "proxy CPU seconds per Gbit", "lower", ".3f", chart=False, table=False),
        Metric("proxy_kernel_cpu_s_per_gbit", "proxy CPU seconds per Gbit in the kernel", "lower", ".3f", chart=False),
        Metric("proxy_user_cpu_s_per_gbit", "proxy CPU seconds per Gbit in user space", "lower", ".3f", chart=False),
        Metric(
            "proxy_cores", "proxy cores used (all processes on the path)", "higher", ".2f", chart=False, table=False
        ),
    ),
    "latency": (
        Metric("p50", "p50 µs", "lower", ".0f"),
        Metric("p90", "p90 µs", "lower", ".0f"),
        Metric("p99", "p99 µs", "lower", ".0f"),
        Metric("p99.9", "p99.9 µs", "lower", ".0f"),
        Metric("proxy_cpu_us_per_rt", "proxy CPU µs per round trip", "lower", ".1f", chart=False),
    ),
    "connrate": (
        Metric("rate", "connections/s", "higher", ",.0f"),
        Metric("conn_per_cpu_s", "connections per proxy CPU-second", "higher", ",.0f"),
        Metric("conn_p50_us", "p50 µs per connection", "lower", ".0f", chart=False),
        Metric("conn_p99_us", "p99 µs per connection", "lower", ".0f", chart=False),
        Metric("proxy_cpu_us_per_conn", "proxy CPU µs per connection", "lower", ".0f", chart=False, table=False),
        Metric("proxy_kernel_us_per_conn", "proxy CPU µs per connection in the kernel", "lower", ".0f", chart=False),
        Metric("proxy_user_us_per_conn", "proxy CPU µs per connection in user space", "lower", ".0f", chart=False),
        Metric(
            "proxy_cores", "proxy cores used (all processes on the path)", "higher", ".2f", chart=False, table=False
        ),
        Metric(
            "worker_share_min", "smallest worker's share of its ztunnel's worker CPU", "higher", ".2f", False, False
        ),
        Metric("worker_share_max", "largest worker's share of its ztunnel's worker CPU", "lower", ".2f", False, False),
    ),
    "memory": (
        Metric("rss_mib", "RSS MiB per proxy (all its processes)", "lower", ".1f"),
        Metric("pss_mib", "PSS MiB per proxy (all its processes)", "lower", ".1f", chart=False),
        Metric("per_conn_kib", "KiB per idle tunnel (all proxies on the path)", "lower", ".2f"),
        Metric("per_conn_kib_max_proxy", "KiB per idle tunnel (worst single proxy)", "lower", ".2f", chart=False),
    ),
    "controlplane": (
        Metric("apply_s", "push -> ACK, s", "lower", ".3f"),
        Metric("apply_ztunnel_cpu_s", "ztunnel CPU s for the push", "lower", ".3f", chart=False),
        Metric("remove_s", "removal push -> ACK, s", "lower", ".3f", chart=False),
        Metric("inproc_total_s", "in-process decode+convert+apply, s", "lower", ".3f", chart=False),
        Metric("us_per_check", "µs per inbound check", "lower", ".1f"),
        Metric("plan_ms", "ms to compile the plan, cold", "lower", ".1f", chart=False),
        Metric("replan_ms", "ms to regroup the plan after a policy change", "lower", ".1f", chart=False),
    ),
}
SCENARIO_TITLES = {
    "throughput": "Throughput (long streams)",
    "latency": "Latency (request/response on an open connection)",
    "connrate": "Connection rate (new connection + 1-byte echo + close, 8 concurrent)",
    "memory": "Memory",
    "controlplane": "Control plane",
}
SCENARIOS = tuple(METRICS)


def _sorted_modes(modes: Iterable[str]) -> list[str]:
    return sorted(set(modes), key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER else len(MODE_ORDER))


def _spread(values: Sequence[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": list(values),
    }


def summarize(samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Median and range over repetitions of every (scenario, case, metric, mode, process model)."""
    groups: dict[tuple[str, str, str, str, str | None], list[float]] = defaultdict(list)
    for s in samples:
        if s["metrics"].get("failed"):
            continue
        for m in METRICS.get(s["scenario"], ()):
            v = s["metrics"].get(m.key)
            if isinstance(v, int | float):
                groups[(s["scenario"], s["case"], m.key, s["mode"], s.get("workers"))].append(float(v))
    return [
        {"scenario": sc, "case": case, "metric": key, "mode": mode, "workers": w, **_spread(vals)}
        for (sc, case, key, mode, w), vals in groups.items()
    ]


def ratios(
    samples: Sequence[Mapping[str, Any]], references: Sequence[str] = ("envoy", "direct", "upstream", "upstream-loop")
) -> list[dict[str, Any]]:
    """Per-repetition ratios of each mode to each reference mode (within one process model), then their median and
    range. Upstream's modes are the reference of their partner mode only (:data:`UPSTREAM_REFERENCES`)."""
    by_key: dict[tuple[str, str, str, int, str | None], dict[str, float]] = defaultdict(dict)
    for s in samples:
        if s["metrics"].get("failed"):
            continue
        for m in METRICS.get(s["scenario"], ()):
            v = s["metrics"].get(m.key)
            if isinstance(v, int | float):
                by_key[(s["scenario"], s["case"], m.key, int(s["rep"]), s.get("workers"))][s["mode"]] = float(v)
    pairs: dict[tuple[str, str, str, str, str, str | None], list[float]] = defaultdict(list)
    for (sc, case, key, _rep, w), values in by_key.items():
        for ref in references:
            base = values.get(ref)
            if not base:
                continue
            for mode, v in values.items():
                if mode != ref and UPSTREAM_REFERENCES.get(ref, mode) == mode:
                    pairs[(sc, case, key, mode, ref, w)].append(v / base)
    return [
        {"scenario": sc, "case": case, "metric": key, "mode": mode, "vs": ref, "workers": w, **_spread(vals)}
        for (sc, case, key, mode, ref, w), vals in pairs.items()
    ]


# Process models compared with each other (``--workers``): each against 1 worker and against the inline process.
VARIANT_REFERENCES = ("1", "inline")
IDLE_PSS = ("processes", "idle, all processes of a ztunnel", "pss_bytes", "ztunnel")


def variant_ratios(
    samples: Sequence[Mapping[str, Any]], processes: Sequence[Mapping[str, Any]] = ()
) -> list[dict[str, Any]]:
    """Per-repetition ratios of each process model to 1 worker and to the inline process, for the same scenario,
    case, metric and mode; and of each ztunnel's idle PSS (all its processes) to the inline process's, per
    repetition and ztunnel (the first start of each repetition and process model)."""
    by_key: dict[tuple[str, str, str, str, int], dict[str, float]] = defaultdict(dict)
    for s in samples:
        if s["metrics"].get("failed") or s.get("workers") is None:
            continue
        for m in METRICS.get(s["scenario"], ()):
            v = s["metrics"].get(m.key)
            if isinstance(v, int | float):
                by_key[(s["scenario"], s["case"], m.key, s["mode"], int(s["rep"]))][s["workers"]] = float(v)
    for record in processes:
        if record.get("workers") is None:
            continue
        for proxy, found in record["proxies"].items():
            if proxy.startswith("ztunnel") and found["pss_bytes"]:
                values = by_key[(*IDLE_PSS[:3], proxy, int(record["rep"]))]
                values.setdefault(record["workers"], float(found["pss_bytes"]))
    pairs: dict[tuple[str, str, str, str, str, str], list[float]] = defaultdict(list)
    for (sc, case, key, mode, _rep), values in by_key.items():
        pooled = IDLE_PSS[3] if sc == IDLE_PSS[0] else mode  # both ztunnels' idle ratios together
        for ref in VARIANT_REFERENCES:
            base = values.get(ref)
            if not base:
                continue
            for w, v in values.items():
                if w != ref and not (ref == "1" and w == "inline"):  # inline is the baseline, not compared
                    pairs[(sc, case, key, pooled, w, ref)].append(v / base)
    return [
        {"scenario": sc, "case": case, "metric": key, "mode": mode, "workers": w, "vs_workers": ref, **_spread(vals)}
        for (sc, case, key, mode, w, ref), vals in pairs.items()
    ]


def _find(rows: Iterable[Mapping[str, Any]], **match: str | None) -> Mapping[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def variants_of(rows: Iterable[Mapping[str, Any]]) -> list[str | None]:
    """The process models in ``rows`` (samples or summaries), in order of first appearance; [None] without any."""
    seen: dict[str | None, None] = {}
    for r in rows:
        seen.setdefault(r.get("workers"), None)
    return list(seen) or [None]


_COMPARE: Mapping[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}


def _target(name: str, row: Mapping[str, Any] | None, op: str, limit: float, goal: str) -> dict[str, Any]:
    """A target row from a summary or ratio row; "n/a" (met None) when the run has no such row."""
    if row is None:
        return {"target": name, "value": None, "spread": None, "limit": goal, "met": None}
    value = row["median"]
    met = _COMPARE[op](value, limit)  # an unknown operator is a KeyError, not a silent "<"
    return {
        "target": name,
        "value": round(value, 3),
        "spread": [round(row["min"], 3), round(row["max"], 3)],
        "limit": goal,
        "met": met,
    }


# (target, scenario, case, metric, operator, limit): hbone over envoy, pair by pair.
ENVOY_TARGETS = (
    ("HBONE throughput, 1 stream", "throughput", "1 stream", "gbps", ">=", 1.0),
    ("HBONE throughput per CPU-second, 1 stream", "throughput", "1 stream", "gbit_per_cpu_s", ">=", 1.0),
    ("latency p50, 64 B", "latency", "64 B", "p50", "<=", 1.2),
    ("latency p99, 64 B", "latency", "64 B", "p99", "<=", 1.5),
    ("latency p50, 1 KiB", "latency", "1 KiB", "p50", "<=", 1.2),
    ("latency p99, 1 KiB", "latency", "1 KiB", "p99", "<=", 1.5),
    ("connection rate", "connrate", "8 concurrent", "rate", ">=", 1.0),
    ("idle RSS (per proxy, all its processes)", "memory", "idle", "rss_mib", "<", 1.0),
)


def targets(
    ratio_rows: Sequence[Mapping[str, Any]],
    summary_rows: Sequence[Mapping[str, Any]],
    variant_rows: Sequence[Mapping[str, Any]] = (),
    processes: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The issues' targets, checked on this run's pairwise medians: hbone vs envoy (per process model when the run
    compares several), then the worker processes' (2 workers against 1 worker and the inline process)."""
    out: list[dict[str, Any]] = []
    for w in variants_of(summary_rows):
        if w is not None and not any(r.get("workers") == w for r in ratio_rows):
            continue  # the idle-only inline baseline
        suffix = f" ({variant_label(w)})" if w is not None else ""
        for name, scenario, case, metric, op, limit in ENVOY_TARGETS:
            r = _find(ratio_rows, scenario=scenario, case=case, metric=metric, mode="hbone", vs="envoy", workers=w)
            if r is not None:
                out.append(_target(name + suffix, r, op, limit, f"{op} {limit:g}x Envoy"))
        per_conn = [
            r
            for r in summary_rows
            if r["scenario"] == "memory"
            and r["metric"] == "per_conn_kib"
            and r["mode"] == "hbone"
            and r.get("workers") == w
        ]
        out.extend(
            _target(
                f"added memory per idle tunnel, {r['case']} (both ztunnels together){suffix}", r, "<=", 4.0, "<= 4 KiB"
            )
            for r in per_conn
        )
    out += worker_targets(summary_rows, variant_rows, processes)
    return out


def _workers_found(processes: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    """{process model: the worker processes each of its ztunnel starts had}."""
    out: dict[str, list[int]] = defaultdict(list)
    for rec in processes:
        if rec.get("workers") is not None:
            out[rec["workers"]] += [p["workers"] for name, p in rec["proxies"].items() if name.startswith("ztunnel")]
    return out


def worker_targets(
    summary_rows: Sequence[Mapping[str, Any]],
    variant_rows: Sequence[Mapping[str, Any]],
    processes: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Issue 16's targets for 2 data-plane workers, per ztunnel mode that ran with 2 workers: each worker 35-65 %
    of its ztunnel's worker CPU under the 8-concurrent connection load; more than 1.2 cores used by the proxies in
    the 8-stream case; CPU per connection and per Gbit at most 1.1x of 1 worker; and the idle PSS of all of a
    ztunnel's processes at most 1.5x the inline process's."""
    out: list[dict[str, Any]] = []
    two = "2"
    modes = [m for m in ("tcp", "hbone") if any(r["mode"] == m and r.get("workers") == two for r in summary_rows)]
    wrong = [
        f"{variant_label(w)}: {', '.join(sorted(set(map(str, counts))))} worker process(es)"
        for w, counts in _workers_found(processes).items()
        if w in (two, "1") and any(n != int(w) for n in counts)
    ]
    if wrong:
        # The ztunnel ignored ZTUNNEL_WORKER_THREADS (or its workers died): the numbers describe something else.
        why = "not measurable: the ztunnels ran with " + "; ".join(wrong)
        names = [f"CPU split, proxy cores, CPU per connection and per Gbit, {m} (2 workers)" for m in modes]
        names.append("idle PSS of a ztunnel (control + workers), 2 workers ÷ inline process")
        return [{"target": n, "value": None, "spread": None, "limit": why, "met": None} for n in names]
    for mode in modes:
        split = _find(
            summary_rows, scenario="connrate", case="8 concurrent", metric="worker_share_min", mode=mode, workers=two
        )
        cores = _find(
            summary_rows, scenario="throughput", case="8 streams", metric="proxy_cores", mode=mode, workers=two
        )
        per_conn = _find(
            variant_rows,
            scenario="connrate",
            case="8 concurrent",
            metric="proxy_cpu_us_per_conn",
            mode=mode,
            workers=two,
            vs_workers="1",
        )
        per_gbit = _find(
            variant_rows,
            scenario="throughput",
            case="8 streams",
            metric="proxy_cpu_s_per_gbit",
            mode=mode,
            workers=two,
            vs_workers="1",
        )
        out += [
            _target(
                f"CPU split between workers, 8 concurrent connections, {mode} (2 workers): smallest share",
                split,
                ">=",
                0.35,
                "each worker 35-65 % (smallest >= 0.35)",
            ),
            _target(f"proxy cores used, 8 streams, {mode} (2 workers)", cores, ">", 1.2, "> 1.2 cores"),
            _target(f"proxy CPU per connection, {mode}, 2 workers ÷ 1 worker", per_conn, "<=", 1.1, "<= 1.1x"),
            _target(f"proxy CPU per Gbit, 8 streams, {mode}, 2 workers ÷ 1 worker", per_gbit, "<=", 1.1, "<= 1.1x"),
        ]
    if any(r.get("workers") == two for r in processes):
        sc, case, metric, mode = IDLE_PSS
        row = _find(variant_rows, scenario=sc, case=case, metric=metric, mode=mode, workers=two, vs_workers="inline")
        out.append(
            _target("idle PSS of a ztunnel (control + workers), 2 workers ÷ inline process", row, "<=", 1.5, "<= 1.5x")
        )
    return out


# (target, scenario, case, metric, operator, limit): this ztunnel over upstream in the same namespaced shape.
UPSTREAM_TARGETS = (
    (
        "CPU per new connection (SOCKS5 + HBONE stream + 1-byte echo + close)",
        "connrate",
        "8 concurrent",
        "proxy_cpu_us_per_conn",
        "<=",
        1.5,
    ),
    ("connections/s, 8 concurrent", "connrate", "8 concurrent", "rate", ">=", 0.7),
    ("1-stream throughput per proxy CPU-second", "throughput", "1 stream", "gbit_per_cpu_s", ">=", 0.8),
    ("latency p50, 64 B", "latency", "64 B", "p50", "<=", 1.1),
    ("latency p99, 64 B", "latency", "64 B", "p99", "<=", 1.3),
)
UPSTREAM_SHAPES = (("hbone-ns", "upstream", "two nodes"), ("loop", "upstream-loop", "self-loop"))
WORKER_PSS = ("processes", "idle", "worker_pss_vs_upstream")


def worker_pss_ratios(processes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per start (repetition and process model): the idle PSS of this ztunnel's largest data-plane process (a
    worker; the whole process when it runs inline) on the namespaced pair, over the mean PSS of upstream's whole
    processes started beside it; median and range over the repetitions."""
    values: dict[str | None, list[float]] = defaultdict(list)
    for rec in processes:
        proxies = rec["proxies"]
        ours = [proxies[p] for p in ("ztunnel-ns-a", "ztunnel-ns-b") if p in proxies]
        theirs = [proxies[p]["pss_bytes"] for p in ("upstream-a", "upstream-b") if p in proxies]
        if not ours or not theirs or not all(theirs):
            continue
        workers = [
            v for found in ours for name, v in found["pss_by_process"].items() if name.startswith("w") and v
        ] or [found["pss_bytes"] for found in ours]
        values[rec.get("workers")].append(max(workers) / statistics.fmean(theirs))
    return [
        {"scenario": WORKER_PSS[0], "case": WORKER_PSS[1], "metric": WORKER_PSS[2], "workers": w, **_spread(v)}
        for w, v in values.items()
    ]


def upstream_targets(
    ratio_rows: Sequence[Mapping[str, Any]], processes: Sequence[Mapping[str, Any]] = ()
) -> list[dict[str, Any]]:
    """Issue 17's targets against upstream ztunnel (medians of per-repetition ratios), per shape (two nodes,
    self-loop) and process model: CPU per new connection <= 1.5x, connections/s >= 0.7x, 1-stream throughput per
    CPU-second >= 0.8x, p50 <= 1.1x, p99 <= 1.3x, memory per idle tunnel <= 1x; and the idle PSS of one data-plane
    worker <= 2x upstream's whole process."""
    out: list[dict[str, Any]] = []
    pss = worker_pss_ratios(processes)
    for w in variants_of([*ratio_rows, *pss]):
        suffix = f", {variant_label(w)}" if w is not None else ""
        for ours, ref, shape in UPSTREAM_SHAPES:
            rows = [r for r in ratio_rows if r["mode"] == ours and r["vs"] == ref and r.get("workers") == w]
            if not rows:
                continue
            for name, scenario, case, metric, op, limit in UPSTREAM_TARGETS:
                r = _find(rows, scenario=scenario, case=case, metric=metric)
                if r is not None:
                    out.append(_target(f"{name} ({shape}{suffix})", r, op, limit, f"{op} {limit:g}x upstream"))
            out.extend(
                _target(f"memory per idle tunnel, {r['case']} ({shape}{suffix})", r, "<=", 1.0, "<= 1x upstream")
                for r in rows
                if r["scenario"] == "memory" and r["metric"] == "per_conn_kib"
            )
        row = _find(pss, workers=w)
        if row is not None:
            out.append(
                _target(
                    f"idle PSS of one data-plane worker ÷ upstream's whole process{suffix}",
                    row,
                    "<=",
                    2.0,
                    "<= 2x upstream",
                )
            )
    return out


# -- Markdown ------------------------------------------------------------------------------------------------------


def _fmt(value: float, fmt: str) -> str:
    return format(value, fmt)


def _cell(row: Mapping[str, Any] | None, fmt: str) -> str:
    if row is None:
        return "n/a"
    if row["n"] == 1:
        return _fmt(row["median"], fmt)
    return f"{_fmt(row['median'], fmt)} ({_fmt(row['min'], fmt)}-{_fmt(row['max'], fmt)})"


def _ratio_cell(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return "n/a"
    if row["n"] == 1:
        return f"{row['median']:.2f}"
    return f"{row['median']:.2f} ({row['min']:.2f}-{row['max']:.2f})"


def _cases(samples: Sequence[Mapping[str, Any]], scenario: str) -> list[str]:
    seen: dict[str, None] = {}
    for s in samples:
        if s["scenario"] == scenario:
            seen.setdefault(s["case"], None)
    return list(seen)


RATIO_COLUMNS = (
    ("hbone", "envoy"),
    ("tcp", "direct"),
    ("hbone", "direct"),
    ("envoy", "direct"),
    ("hbone-ns", "upstream"),
    ("loop", "upstream-loop"),
)


def scenario_table(
    scenario: str,
    samples: Sequence[Mapping[str, Any]],
    summary_rows: Sequence[Mapping[str, Any]],
    ratio_rows: Sequence[Mapping[str, Any]],
    workers: str | None = None,
) -> list[str]:
    """One scenario's table, of the samples of process model ``workers`` (None: a run without ``--workers``)."""
    samples = [s for s in samples if s.get("workers") == workers]
    summary_rows = [r for r in summary_rows if r.get("workers") == workers]
    ratio_rows = [r for r in ratio_rows if r.get("workers") == workers]
    modes = _sorted_modes(s["mode"] for s in samples if s["scenario"] == scenario)
    if not modes:
        return []
    ratio_cols = [
        (m, ref)
        for m, ref in RATIO_COLUMNS
        if m in modes and ref in modes and any(r["mode"] == m and r["vs"] == ref for r in ratio_rows)
    ]
    head = ["case", "metric", *modes, *(f"{m} ÷ {ref}" for m, ref in ratio_cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in _cases(samples, scenario):
        for metric in (m for m in METRICS[scenario] if m.table):
            cells = [_find(summary_rows, scenario=scenario, case=case, metric=metric.key, mode=m) for m in modes]
            if all(c is None for c in cells):
                continue
            rcells = [
                _ratio_cell(_find(ratio_rows, scenario=scenario, case=case, metric=metric.key, mode=m, vs=ref))
                for m, ref in ratio_cols
            ]
            arrow = "↑" if metric.better == "higher" else "↓"
            lines.append(
                "| "
                + " | ".join([case, f"{metric.label} {arrow}", *(_cell(c, metric.fmt) for c in cells), *rcells])
                + " |"
            )
    return lines


def process_model_section(doc: Mapping[str, Any]) -> list[str]:
    """With ``--workers``: per ztunnel mode and process model, the worker processes found, how the CPU was split
    between them, the cores used, the CPU per connection and per Gbit, and the idle memory (PSS of all of a
    ztunnel's processes), then the same against 1 worker and against the inline process."""
    meta = doc["meta"]
    variants = [*meta.get("workers", []), *meta.get("workers_idle_only", [])]
    if not variants:
        return []
    summary, processes = doc["summary"], doc.get("processes", [])
    modes = [m for m in ("tcp", "hbone") if any(r["mode"] == m and r.get("workers") for r in summary)]

    def cell(mode: str, w: str, scenario: str, case: str, metric: str, fmt: str) -> str:
        r = _find(summary, scenario=scenario, case=case, metric=metric, mode=mode, workers=w)
        return _cell(r, fmt) if r is not None else "n/a"

    def idle_pss(mode: str, w: str) -> str:
        values = [
            rec["proxies"][p]["pss_bytes"] / 2**20
            for rec in processes
            if rec.get("workers") == w
            for p in PATH_PROXIES[mode]
            if p in rec["proxies"]
        ]
        return _cell(_spread(values), ".1f") if values else "n/a"

    def found(mode: str, w: str) -> str:
        counts = sorted(
            {
                rec["proxies"][p]["workers"]
                for rec in processes
                if rec.get("workers") == w
                for p in PATH_PROXIES[mode]
                if p in rec["proxies"]
            }
        )
        return ", ".join(map(str, counts)) or "n/a"

    out = [
        "## Process models (`--workers`)",
        "",
        "Each ztunnel ran with `ZTUNNEL_WORKER_THREADS=N` (N workers beside a control process) or as one process "
        "(`inline`, `ZTUNNEL_INLINE_DATA_PLANE=true`). Worker processes are found by the `--index N` on their "
        "command line; worker shares are each worker's part of its ztunnel's worker CPU under the 8-concurrent "
        "connection load; cores are CPU seconds per second of the proxies on the path (all their processes); "
        "idle PSS is per ztunnel, all its processes, right after start.",
        "",
        "| mode | process model | workers found per ztunnel | worker shares, 8 concurrent conns (smallest, largest) "
        "| proxy cores, 8 streams | proxy CPU µs per connection | proxy CPU s per Gbit, 8 streams "
        "| idle PSS MiB per ztunnel |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        for w in variants:
            shares = (
                f"{cell(mode, w, 'connrate', '8 concurrent', 'worker_share_min', '.2f')}, "
                f"{cell(mode, w, 'connrate', '8 concurrent', 'worker_share_max', '.2f')}"
            )
            out.append(
                f"| {mode} | {variant_label(w)} | {found(mode, w)} | {shares} "
                f"| {cell(mode, w, 'throughput', '8 streams', 'proxy_cores', '.2f')} "
                f"| {cell(mode, w, 'connrate', '8 concurrent', 'proxy_cpu_us_per_conn', '.0f')} "
                f"| {cell(mode, w, 'throughput', '8 streams', 'proxy_cpu_s_per_gbit', '.3f')} "
                f"| {idle_pss(mode, w)} |"
            )
    rows = [
        r
        for r in doc.get("variant_ratios", [])
        if (r["metric"], r["case"]) in _VARIANT_RATIO_LABELS and r["mode"] in ("tcp", "hbone", "ztunnel")
    ]
    if rows:
        out += ["", "| ratio | case | mode | process models | median (range) |", "|---|---|---|---|---|"]
        for r in rows:
            out.append(
                f"| {_VARIANT_RATIO_LABELS[(r['metric'], r['case'])]} | {r['case']} | {r['mode']} "
                f"| {variant_label(r['workers'])} ÷ {variant_label(r['vs_workers'])} | {_ratio_cell(r)} |"
            )
    return [*out, ""]


# The process models' ratios the section shows: (metric, case) -> what it is.
_VARIANT_RATIO_LABELS = {
    ("proxy_cpu_us_per_conn", "8 concurrent"): "proxy CPU per connection ↓",
    ("rate", "8 concurrent"): "connection rate ↑",
    ("proxy_cpu_s_per_gbit", "8 streams"): "proxy CPU per Gbit ↓",
    ("gbps", "8 streams"): "throughput ↑",
    ("p50", "64 B"): "latency p50 ↓",
    ("pss_bytes", IDLE_PSS[1]): "idle PSS of a ztunnel ↓",
}


def _target_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    out = ["| target | this run | range | goal | met |", "|---|---|---|---|---|"]
    for t in rows:
        value, spread = ("n/a", "") if t["value"] is None else (t["value"], "{}-{}".format(*t["spread"]))
        met = "n/a" if t["met"] is None else "yes" if t["met"] else "**no**"
        out.append(f"| {t['target']} | {value} | {spread} | {t['limit']} | {met} |")
    return [*out, ""]


def _rep_label(condition: Mapping[str, Any]) -> str:
    """A repetition as the report names it: ``2``, or ``2 (2 workers)`` in a run comparing process models."""
    w = condition.get("workers")
    return f"{condition['rep']} ({variant_label(w)})" if w else str(condition["rep"])


def markdown(doc: Mapping[str, Any], charts: Mapping[str, str]) -> str:
    """The whole report: header with the machine, targets, one table (and chart) per scenario, notes."""
    env = doc["environment"]
    meta = doc["meta"]
    out = [
        f"# ztunnel benchmark — {meta['started']}",
        "",
        f"Profile `{meta['profile']}`, topology `{meta['topology']}`, {meta['repetitions']} repetition(s), "
        f"modes interleaved (order rotated each repetition); {meta['duration_s']:.0f} s in all.",
        "",
        f"Machine: {env['cpu_model']}, {env['cores']} cores ({env['usable_cores']} usable), "
        f"{env['mem_total_mib']} MiB, Linux {env['kernel']}. Python {env['python']}, "
        f"uvloop {env['packages'].get('uvloop')}, h2 {env['packages'].get('h2')}, {env['openssl']}, "
        f"Envoy {env['envoy'] or 'not found'}. ztunnel at {str(env['git_commit'])[:12]}"
        + (f" (+{env['git_dirty_files']} uncommitted files)" if env["git_dirty_files"] else "")
        + ".",
        "",
        f"**Clients, server and proxies share these {env['usable_cores']} cores**: absolute numbers are capped by the "
        "machine; compare modes through the ratios, which are computed pair by pair within each repetition. "
        "Cells are the median over repetitions with the (min-max) range; ↑ higher is better, ↓ lower is better.",
        "",
    ]
    noisy = [c for c in doc.get("conditions", []) if c.get("foreign_cpu_share", 0) + c.get("steal_share", 0) > 0.1]
    if doc.get("conditions"):
        shares = ", ".join(
            f"{_rep_label(c)}: {c.get('foreign_cpu_share', 0) + c.get('steal_share', 0):.0%}"
            for c in doc["conditions"]
            if "foreign_cpu_share" in c
        )
        if shares:
            out += [f"Share of the machine taken by other processes or the hypervisor, per repetition: {shares}.", ""]
    if noisy:
        out += [
            f"**Warning: repetition(s) {', '.join(_rep_label(c) for c in noisy)} ran while other processes used more "
            "than 10% of the machine; their numbers are unreliable. Rerun on a quiet machine.**",
            "",
        ]
    if doc.get("targets"):
        out += ["## Targets (medians of per-repetition values and ratios)", "", *_target_table(doc["targets"])]
    if doc.get("targets_upstream"):
        out += [
            "## Targets vs upstream ztunnel (medians of per-repetition ratios)",
            "",
            "This ztunnel over upstream's binary, each in the same network-namespaced shape (two nodes: `hbone-ns` "
            "÷ `upstream`; upstream's self-loop recipe: `loop` ÷ `upstream-loop`).",
            "",
            *_target_table(doc["targets_upstream"]),
        ]
    out += process_model_section(doc)
    for scenario in SCENARIOS:
        tables = []
        for w in variants_of(s for s in doc["samples"] if s["scenario"] == scenario):
            table = scenario_table(scenario, doc["samples"], doc["summary"], doc["ratios"], w)
            if table:
                tables += ([f"### {variant_label(w)}", ""] if w is not None else []) + [*table, ""]
        if not tables:
            continue
        out += [f"## {SCENARIO_TITLES[scenario]}", "", *tables]
        if scenario in charts:
            out += [f"![{scenario}]({charts[scenario]})", ""]
    if doc.get("skipped"):
        out += ["## Skipped", ""]
        out += [f"- {s['what']}: {s['reason']}" for s in doc["skipped"]]
        out.append("")
    if doc.get("log_issues"):
        out += ["## Warnings and errors in proxy logs", ""]
        for issue in doc["log_issues"]:
            out.append(f"- {issue['process']} (repetition {issue.get('rep', '?')}): {issue['count']} line(s), e.g.")
            out += [f"  - `{e}`" for e in issue["examples"][:3]]
        out.append("")
    sample_errors = [s for s in doc["samples"] if s["metrics"].get("errors")]
    if sample_errors:
        out += ["## Failed samples and client-side errors (failed samples are left out of the tables)", ""]
        for s in sample_errors[:30]:
            state = "FAILED" if s["metrics"].get("failed") else "errors"
            errors = s["metrics"]["errors"]
            shown = errors[:3] if isinstance(errors, list) else errors
            out.append(f"- {s['scenario']} / {s['case']} / {s['mode']} / rep {s['rep']}: {state}: {shown}")
        if len(sample_errors) > 30:
            out.append(f"- ... {len(sample_errors) - 30} more in results.json")
        out.append("")
    if doc.get("notes"):
        out += ["## Notes", ""]
        out += [f"- {n}" for n in doc["notes"]]
        out.append("")
    return "\n".join(out)


# -- charts --------------------------------------------------------------------------------------------------------


_HATCHES = ("", "//", "..", "xx", "\\\\", "--")


def column_label(mode: str, workers: str | None) -> str:
    """A chart's name for a mode under a process model: ``hbone``, ``hbone 2w``, ``hbone inline``."""
    return mode if workers is None else f"{mode} {short_label(workers)}"


def _sorted_labels(labels: Iterable[str]) -> list[str]:
    """Chart labels in mode order, then as given."""
    given = list(labels)

    def key(text: str) -> tuple[int, int]:
        mode = text.split(maxsplit=1)[0]
        return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), given.index(text))

    return sorted(given, key=key)


def charts(doc: Mapping[str, Any], outdir: Path, prefix: str = "") -> dict[str, str]:
    """One PNG per scenario (a panel per charted metric: cases on x, a bar per mode with min-max whiskers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: dict[str, str] = {}
    summary = doc["summary"]
    for scenario in SCENARIOS:
        metrics = [
            m
            for m in METRICS[scenario]
            if m.chart and any(r["scenario"] == scenario and r["metric"] == m.key for r in summary)
        ]
        if not metrics:
            continue
        fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics) + 0.6, 3.8), squeeze=False)
        for ax, metric in zip(axes[0], metrics, strict=True):
            rows = [r for r in summary if r["scenario"] == scenario and r["metric"] == metric.key]
            cases = [c for c in _cases(doc["samples"], scenario) if any(r["case"] == c for r in rows)]
            # A bar per mode, and per process model when the run compared several (hatched by model).
            variants = variants_of(rows)
            columns = [(m, w) for m in _sorted_modes(r["mode"] for r in rows) for w in variants]
            columns = [(m, w) for m, w in columns if any(r["mode"] == m and r.get("workers") == w for r in rows)]
            width = 0.8 / max(1, len(columns))
            for i, (mode, w) in enumerate(columns):
                xs, ys, lo, hi = [], [], [], []
                for j, case in enumerate(cases):
                    r = _find(rows, case=case, mode=mode, workers=w)
                    if r is None:
                        continue
                    xs.append(j + (i - (len(columns) - 1) / 2) * width)
                    ys.append(r["median"])
                    lo.append(r["median"] - r["min"])
                    hi.append(r["max"] - r["median"])
                ax.bar(
                    xs,
                    ys,
                    width,
                    yerr=[lo, hi],
                    capsize=2,
                    label=column_label(mode, w),
                    color=MODE_COLORS.get(mode),
                    hatch=_HATCHES[variants.index(w) % len(_HATCHES)] if w is not None else None,
                )
            ax.set_xticks(range(len(cases)))
            ax.set_xticklabels(cases, fontsize=8)
            arrow = "higher is better" if metric.better == "higher" else "lower is better"
            ax.set_title(f"{metric.label}\n({arrow})", fontsize=9)
            ax.tick_params(axis="y", labelsize=8)
            ax.grid(axis="y", alpha=0.3)
        handles: dict[str, Any] = {}
        for ax in axes[0]:
            for h, text in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(text, h)
        ordered = _sorted_labels(handles)
        fig.legend([handles[m] for m in ordered], ordered, loc="upper right", fontsize=8, ncols=min(len(ordered), 6))
        fig.suptitle(SCENARIO_TITLES[scenario], fontsize=10, x=0.02, ha="left")
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        name = f"{prefix}{scenario}.png"
        fig.savefig(outdir / name, dpi=110)
        plt.close(fig)
        written[scenario] = name
    return written

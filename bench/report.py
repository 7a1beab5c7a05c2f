"""From samples to answers: medians and spread, pairwise ratios, the issue's targets, Markdown, PNG charts.

Every sample is one measurement of one (scenario, case, mode, repetition). Summaries are the median over
repetitions with the min-max range as the spread. Ratios are computed **pair by pair**: for each repetition, mode
X's value divided by Envoy's (or direct's) value *of the same repetition*, measured minutes apart at most; the
median and range of those per-repetition ratios are reported, not the ratio of the medians. A machine that
slows down during a run then moves both sides of each ratio together.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODE_ORDER = ("direct", "tcp", "hbone", "envoy", "ztunnel")
MODE_COLORS = {"direct": "#9e9e9e", "tcp": "#64b5f6", "hbone": "#1565c0", "envoy": "#e65100", "ztunnel": "#1565c0"}


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    better: str  # "higher" or "lower"
    fmt: str = ".2f"
    chart: bool = True


METRICS: dict[str, tuple[Metric, ...]] = {
    "throughput": (
        Metric("gbps", "Gbit/s", "higher"),
        Metric("gbit_per_cpu_s", "Gbit per proxy CPU-second", "higher"),
        Metric("fairness", "slowest / fastest stream", "higher", chart=False),
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
    ),
    "memory": (
        Metric("rss_mib", "RSS MiB per proxy process", "lower", ".1f"),
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
    """Median and range over repetitions of every (scenario, case, metric, mode)."""
    groups: dict[tuple[str, str, str, str], list[float]] = defaultdict(list)
    for s in samples:
        if s["metrics"].get("failed"):
            continue
        for m in METRICS.get(s["scenario"], ()):
            v = s["metrics"].get(m.key)
            if isinstance(v, int | float):
                groups[(s["scenario"], s["case"], m.key, s["mode"])].append(float(v))
    return [
        {"scenario": sc, "case": case, "metric": key, "mode": mode, **_spread(vals)}
        for (sc, case, key, mode), vals in groups.items()
    ]


def ratios(
    samples: Sequence[Mapping[str, Any]], references: Sequence[str] = ("envoy", "direct")
) -> list[dict[str, Any]]:
    """Per-repetition ratios of each mode to each reference mode, then their median and range."""
    by_key: dict[tuple[str, str, str, int], dict[str, float]] = defaultdict(dict)
    for s in samples:
        if s["metrics"].get("failed"):
            continue
        for m in METRICS.get(s["scenario"], ()):
            v = s["metrics"].get(m.key)
            if isinstance(v, int | float):
                by_key[(s["scenario"], s["case"], m.key, int(s["rep"]))][s["mode"]] = float(v)
    pairs: dict[tuple[str, str, str, str, str], list[float]] = defaultdict(list)
    for (sc, case, key, _rep), values in by_key.items():
        for ref in references:
            base = values.get(ref)
            if not base:
                continue
            for mode, v in values.items():
                if mode != ref:
                    pairs[(sc, case, key, mode, ref)].append(v / base)
    return [
        {"scenario": sc, "case": case, "metric": key, "mode": mode, "vs": ref, **_spread(vals)}
        for (sc, case, key, mode, ref), vals in pairs.items()
    ]


def _find(rows: Iterable[Mapping[str, Any]], **match: str) -> Mapping[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def targets(ratio_rows: Sequence[Mapping[str, Any]], summary_rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, checked on this run's pairwise medians (hbone vs envoy)."""
    out: list[dict[str, Any]] = []

    def ratio_target(name: str, scenario: str, case: str, metric: str, op: str, limit: float) -> None:
        r = _find(ratio_rows, scenario=scenario, case=case, metric=metric, mode="hbone", vs="envoy")
        if r is None:
            return
        value = r["median"]
        met = value >= limit if op == ">=" else value <= limit if op == "<=" else value < limit
        out.append(
            {
                "target": name,
                "value": round(value, 3),
                "spread": [round(r["min"], 3), round(r["max"], 3)],
                "limit": f"{op} {limit:g}x Envoy",
                "met": met,
            }
        )

    ratio_target("HBONE throughput, 1 stream", "throughput", "1 stream", "gbps", ">=", 1.0)
    ratio_target("HBONE throughput per CPU-second, 1 stream", "throughput", "1 stream", "gbit_per_cpu_s", ">=", 1.0)
    for case in ("64 B", "1 KiB"):
        ratio_target(f"latency p50, {case}", "latency", case, "p50", "<=", 1.2)
        ratio_target(f"latency p99, {case}", "latency", case, "p99", "<=", 1.5)
    ratio_target("connection rate", "connrate", "8 concurrent", "rate", ">=", 1.0)
    ratio_target("idle RSS (per proxy process)", "memory", "idle", "rss_mib", "<", 1.0)
    per_conn = [
        r for r in summary_rows if r["scenario"] == "memory" and r["metric"] == "per_conn_kib" and r["mode"] == "hbone"
    ]
    out.extend(
        {
            "target": f"added memory per idle tunnel, {r['case']} (both ztunnels together)",
            "value": round(r["median"], 2),
            "spread": [round(r["min"], 2), round(r["max"], 2)],
            "limit": "<= 4 KiB",
            "met": r["median"] <= 4.0,
        }
        for r in per_conn
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


RATIO_COLUMNS = (("hbone", "envoy"), ("tcp", "direct"), ("hbone", "direct"), ("envoy", "direct"))


def scenario_table(
    scenario: str,
    samples: Sequence[Mapping[str, Any]],
    summary_rows: Sequence[Mapping[str, Any]],
    ratio_rows: Sequence[Mapping[str, Any]],
) -> list[str]:
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
        for metric in METRICS[scenario]:
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
            f"{c['rep']}: {c.get('foreign_cpu_share', 0) + c.get('steal_share', 0):.0%}"
            for c in doc["conditions"]
            if "foreign_cpu_share" in c
        )
        if shares:
            out += [f"Share of the machine taken by other processes or the hypervisor, per repetition: {shares}.", ""]
    if noisy:
        out += [
            f"**Warning: repetition(s) {', '.join(str(c['rep']) for c in noisy)} ran while other processes used more "
            "than 10% of the machine; their numbers are unreliable. Rerun on a quiet machine.**",
            "",
        ]
    if doc.get("targets"):
        out += ["## Targets (hbone vs envoy, medians of per-repetition ratios)", ""]
        out += ["| target | this run | range | goal | met |", "|---|---|---|---|---|"]
        for t in doc["targets"]:
            lo, hi = t["spread"]
            out.append(
                f"| {t['target']} | {t['value']} | {lo}-{hi} | {t['limit']} | {'yes' if t['met'] else '**no**'} |"
            )
        out.append("")
    for scenario in SCENARIOS:
        table = scenario_table(scenario, doc["samples"], doc["summary"], doc["ratios"])
        if not table:
            continue
        out += [f"## {SCENARIO_TITLES[scenario]}", "", *table, ""]
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
            modes = _sorted_modes(r["mode"] for r in rows)
            width = 0.8 / max(1, len(modes))
            for i, mode in enumerate(modes):
                xs, ys, lo, hi = [], [], [], []
                for j, case in enumerate(cases):
                    r = _find(rows, case=case, mode=mode)
                    if r is None:
                        continue
                    xs.append(j + (i - (len(modes) - 1) / 2) * width)
                    ys.append(r["median"])
                    lo.append(r["median"] - r["min"])
                    hi.append(r["max"] - r["median"])
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=mode, color=MODE_COLORS.get(mode))
            ax.set_xticks(range(len(cases)))
            ax.set_xticklabels(cases, fontsize=8)
            arrow = "higher is better" if metric.better == "higher" else "lower is better"
            ax.set_title(f"{metric.label}\n({arrow})", fontsize=9)
            ax.tick_params(axis="y", labelsize=8)
            ax.grid(axis="y", alpha=0.3)
        handles: dict[str, Any] = {}
        for ax in axes[0]:
            for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(label, h)
        ordered = _sorted_modes(handles)
        fig.legend([handles[m] for m in ordered], ordered, loc="upper right", fontsize=8, ncols=len(ordered))
        fig.suptitle(SCENARIO_TITLES[scenario], fontsize=10, x=0.02, ha="left")
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        name = f"{prefix}{scenario}.png"
        fig.savefig(outdir / name, dpi=110)
        plt.close(fig)
        written[scenario] = name
    return written

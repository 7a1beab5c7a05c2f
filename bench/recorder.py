"""What a run records (samples, failures, skips, log issues, load conditions, notes) and the files it writes from
them: ``results.json``, ``results.md`` and the charts (formats in :mod:`bench.report`)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import report
from bench.profiles import Profile
from bench.progress import Progress
from bench.topology import LogIssue

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Recorder:
    progress: Progress
    samples: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    log_issues: list[dict[str, Any]] = field(default_factory=list)
    envoy_stats: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    # What each start of the proxies was made of (bench.processes.found): processes, workers, idle memory.
    processes: list[dict[str, Any]] = field(default_factory=list)
    # The process model (``--workers``) being measured: stamped on every sample as "workers".
    variant: str | None = None

    def add(self, scenario: str, case: str, mode: str, rep: int, metrics: dict[str, Any], **raw: Any) -> None:
        """One sample (``rep`` counts from 0); ``raw`` keeps the unaggregated values (round-trip times)."""
        sample: dict[str, Any] = {"scenario": scenario, "case": case, "mode": mode, "rep": rep + 1, "metrics": metrics}
        if self.variant is not None:
            sample["workers"] = self.variant
        if raw:
            sample["raw"] = raw
        self.samples.append(sample)

    def failed(self, scenario: str, case: str, mode: str, rep: int, error: Exception) -> None:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        failure = {"scenario": scenario, "case": case, "mode": mode, "rep": rep + 1, "error": message}
        if self.variant is not None:
            failure["workers"] = self.variant
        self.failures.append(failure)
        self.add(scenario, case, mode, rep, {"errors": [message], "failed": True})
        self.progress.say(f"rep {rep + 1} {scenario} {case} {mode}: FAILED: {message}")

    def issues(self, found: Sequence[LogIssue], rep: int | None) -> None:
        """Warnings and errors found in the processes' logs (``rep`` counts from 1; None: not one repetition's)."""
        for issue in found:
            self.log_issues.append({"rep": rep, **asdict(issue)})
            self.progress.say(f"  ! {issue.process}: {issue.count} warning/error line(s), e.g. {issue.examples[0]}")

    def write(self, outdir: Path, meta: dict[str, Any], env: dict[str, Any], latest: bool) -> None:
        """``results.json``, the charts and ``results.md`` in ``outdir``; with ``latest``, the charts and the
        Markdown also as ``bench/results/latest*`` (what the README shows)."""
        summary = report.summarize(self.samples)
        ratio_rows = report.ratios(self.samples)
        variant_rows = report.variant_ratios(self.samples, self.processes)
        doc: dict[str, Any] = {
            "schema": 1,
            "meta": meta,
            "environment": env,
            "samples": self.samples,
            "summary": summary,
            "ratios": ratio_rows,
            "variant_ratios": variant_rows,
            "targets": report.targets(ratio_rows, summary, variant_rows, self.processes),
            "targets_upstream": report.upstream_targets(ratio_rows, self.processes),
            "skipped": self.skipped,
            "log_issues": self.log_issues,
            "failures": self.failures,
            "conditions": self.conditions,
            "processes": self.processes,
            "envoy_stats": self.envoy_stats,
            "notes": self.notes,
        }
        (outdir / "results.json").write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        written = report.charts(doc, outdir)
        md = report.markdown(doc, written)
        (outdir / "results.md").write_text(md)
        if latest:
            links = {}
            for scenario, name in written.items():
                shutil.copyfile(outdir / name, RESULTS / f"latest-{name}")
                links[scenario] = f"latest-{name}"
            (RESULTS / "latest.md").write_text(report.markdown(doc, links))


def standard_notes(modes: Sequence[str], scenarios: Sequence[str], p: Profile, topology: str) -> list[str]:
    """The notes every report carries: how the numbers were taken, for the modes and scenarios of this run."""
    notes = [
        f"{os.cpu_count()} cores are shared by the client process, the server process and the proxies; "
        "each is a separate process (no shared event loop), but they compete for the same cores.",
        "Proxy CPU is the user + system time of the proxy processes on the mode's path (all threads; the "
        "processes' CPU-time clocks), sampled by the client at the edges of the measured window: tcp = ztunnel A; "
        "hbone = ztunnel A + B; envoy = originator + terminator.",
        "ztunnel runs with RUST_LOG=warn (no access log), as Envoy runs with no access log configured.",
    ]
    if topology == "netns":
        notes.append(
            "Namespaced topology: pods in network namespaces, iptables capture into in-pod ztunnels (no SOCKS5); "
            "direct = an unenrolled pod to a pod outside the mesh, tcp = the enrolled client to that pod "
            "(passthrough), hbone = the enrolled client to the enrolled server pod."
        )
    elif "tcp" in modes or "hbone" in modes:
        notes.append(
            "tcp and hbone enter ztunnel through SOCKS5 (no iptables capture on loopback); Envoy's originator takes "
            "plain TCP. The SOCKS5 greeting and request (and, for connection-rate and idle connections, the first "
            "payload byte) are pipelined in one write, so SOCKS5 adds 13 bytes in, 12 out and their parsing per "
            "connection, but no round trip; its CPU is inside ztunnel A's measured CPU (the socks5 micro-benchmark "
            "puts it at about 3 µs)."
        )
    if any(m in modes for m in ("hbone-ns", "upstream", "loop", "upstream-loop")):
        notes.append(
            "Upstream comparison (bench/node_pairs.py): each implementation in its own pair of network-namespaced "
            "nodes, the client inside node A entering through SOCKS5 on 127.0.0.1:15080; hbone-ns = this ztunnel "
            "on both nodes, upstream = upstream's binary on both (proxy CPU: A + B); loop and upstream-loop = one "
            "process tunnelling to its own 15008 (upstream's local-development recipe; proxy CPU: that process). "
            "Both run PROXY_MODE=dedicated with FAKE_CA, ENABLE_ORIG_SRC=false and no policy. The vs-upstream "
            "ratios pair each with its upstream twin within a repetition."
        )
    if "throughput" in scenarios:
        notes.append(
            f"Throughput: each stream writes 1 MiB chunks for {p.tput_seconds:g}s, then FIN; Gbit/s counts only "
            "bytes the server confirmed, over the time until its confirmation arrived."
        )
    if "memory" in scenarios:
        notes.append(
            "Memory: idle RSS is measured on freshly started proxies; per-tunnel memory is the RSS growth of the "
            "path's proxies while N tunnels (each with one echoed byte) are held open, divided by N. Memory freed "
            "by earlier samples of the same processes may be reused, which can only lower later deltas."
        )
    if "controlplane" in scenarios:
        notes.append(
            "Control plane: xDS rows are end to end (the local control plane in the orchestrator pushes over gRPC + "
            "TLS to a dedicated ztunnel process; time from queueing the push to its ACK, which ztunnel sends after "
            "applying the batch). inproc = protobuf decode + address_from_xds + ProxyState.apply in one process. "
            "RBAC rows time state.policies.plan (cached) + Plan.evaluate per inbound connection, and compiling "
            "the plan (cold, and regrouping after a policy change)."
        )
    return notes

"""The orchestrator: starts the processes, runs the scenarios with modes interleaved, writes the results.

One repetition = fresh proxies (idle memory, warm-up), throughput, latency and connrate with every selected mode,
in an order rotated by one mode per repetition (so no mode is always first after a start, or always after
another), then fresh proxies again for the idle-connection memory samples. Within a scenario each case runs all
modes back to back, so the values a ratio pairs were measured seconds apart. The control-plane scenarios run once
after the data-path repetitions, with their own repetitions.

The orchestrator only starts processes, sends commands and reads ``/proc``: clients (``bench.worker``), the server
(``bench.server``) and each proxy are separate processes.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from bench import environment, report
from bench.procstat import (
    cpu_snapshot,
    kernel_threads_cpu,
    machine_cpu,
    rss_snapshot,
    time_wait_sockets,
    uss_bytes,
)
from bench.topologies import make_topology, mode_skip_reason, topology_skip_reason
from bench.topology import MODES, PATH_PROXIES, LogIssue, Topology, wait_settled

RESULTS = Path(__file__).resolve().parent / "results"
# Above this share of the machine taken by others during a repetition, the report flags its numbers.
NOISY_SHARE = 0.10
DATA_SCENARIOS = ("throughput", "latency", "connrate", "memory")
SCENARIOS = (*DATA_SCENARIOS, "controlplane")


@dataclass(frozen=True)
class Profile:
    name: str
    reps: int
    tput_seconds: float
    latency_count: int
    latency_warmup: int
    connrate_seconds: float
    memory_counts: tuple[int, ...]
    settle: float
    xds_sizes: tuple[int, ...]
    xds_reps: int
    rbac_policies: int
    rbac_seconds: float
    stall_timeout: float = 5.0  # a client send/receive without progress for this long fails the sample
    latency_slices: int = 4  # latency rounds are taken in this many turns per mode, modes alternating
    tput_streams: tuple[int, ...] = (1, 2, 8)
    latency_sizes: tuple[int, ...] = (64, 1024)
    connrate_concurrency: int = 8


PROFILES = {
    # `make test`: proves every mode and scenario runs end to end; the numbers mean little.
    "smoke": Profile(
        name="smoke",
        reps=1,
        tput_seconds=0.25,
        latency_count=100,
        latency_warmup=20,
        latency_slices=1,
        connrate_seconds=0.25,
        memory_counts=(20, 100),
        settle=0.2,
        xds_sizes=(100, 300),
        xds_reps=1,
        rbac_policies=1000,
        rbac_seconds=0.02,
        stall_timeout=2.0,
    ),
    # Under 3 minutes; 3 repetitions so medians and ranges exist.
    "quick": Profile(
        name="quick",
        reps=3,
        tput_seconds=0.7,
        latency_count=2000,
        latency_warmup=200,
        connrate_seconds=0.7,
        memory_counts=(1000, 10000),
        settle=0.4,
        xds_sizes=(1000, 10000),
        xds_reps=3,
        rbac_policies=10000,
        rbac_seconds=0.2,
        stall_timeout=2.0,
    ),
    # `make bench`, under 20 minutes: long enough for p99.9 (10,000 round trips) and stable throughput.
    "full": Profile(
        name="full",
        reps=5,
        tput_seconds=3.0,
        latency_count=10000,
        latency_warmup=500,
        connrate_seconds=3.0,
        memory_counts=(1000, 10000),
        settle=1.0,
        xds_sizes=(1000, 10000),
        xds_reps=3,
        rbac_policies=10000,
        rbac_seconds=0.5,
    ),
}


# File descriptors per process the memory scenario needs, per held connection and fixed: ztunnel A in tcp mode holds
# two sockets per connection (client and upstream); every other process one.
_FDS_PER_CONN = {"tcp": 2}
_FD_MARGIN = 512


def raise_fd_limit(want: int = 65536) -> int:
    """Raise RLIMIT_NOFILE (inherited by every process started afterwards); returns the soft limit in force.

    The hard limit can only be raised with CAP_SYS_RESOURCE (root); otherwise the soft limit goes up to it.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return want
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
        except (ValueError, OSError):
            target = hard
    else:
        target = want
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _size_label(n: int) -> str:
    return f"{n // 1024} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} B"


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    s = sorted(values)
    n = len(s)
    out = {f"p{q:g}": s[min(n - 1, int(q / 100 * n))] for q in (50, 90, 99, 99.9)}
    out["mean"] = statistics.fmean(s)
    out["min"], out["max"] = s[0], s[-1]
    return out


class WorkerError(RuntimeError):
    """A command failed; ``fatal`` when the worker hung or died (it must be replaced)."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


class Worker:
    """A ``bench.worker`` client process and its one-line-per-command protocol."""

    def __init__(self, log_path: Path, prefix: Sequence[str] = ()) -> None:
        """``prefix`` wraps the command (``ip netns exec <ns>`` to run the client inside a pod)."""
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.prefix = list(prefix)
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "bench.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, cmd: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise WorkerError(
                f"worker gave no answer to {cmd['op']} within {timeout:g}s (log: {self.log_path})", fatal=True
            )
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"worker exited ({self.proc.poll()}); log: {self.log_path}", fatal=True)
        out: dict[str, Any] = json.loads(line)
        if not out.get("ok"):
            raise WorkerError(f"{cmd['op']} failed: {out.get('error')}\n{out.get('traceback', '')}")
        return out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Progress:
    """One line per finished measurement, with position and a time estimate, on stderr."""

    def __init__(self, total: float, stream: IO[str] | None = None) -> None:
        self.total = max(total, 1e-9)
        self.done = 0.0
        self.start = time.monotonic()
        self.stream = stream or sys.stderr

    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self.start
        self.stream.write(f"[{_clock(elapsed)}] {text}\n")
        self.stream.flush()

    def step(self, weight: float, text: str) -> None:
        self.done += weight
        elapsed = time.monotonic() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        pct = min(100.0, 100 * self.done / self.total)
        self.stream.write(f"[{_clock(elapsed)} {pct:3.0f}% ~{_clock(left)} left] {text}\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"


@dataclass
class Options:
    profile: Profile
    modes: tuple[str, ...] = MODES
    scenarios: tuple[str, ...] = SCENARIOS
    reps: int | None = None
    out: Path | None = None
    ztunnel_env: dict[str, str] = field(default_factory=dict)
    topology: str = "loopback"
    update_latest: bool = True


class Run:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.p = opts.profile
        self.reps = opts.reps or self.p.reps
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.outdir = opts.out or RESULTS / stamp
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.workdir = self.outdir / "work"
        self.workdir.mkdir(exist_ok=True)
        self.samples: list[dict[str, Any]] = []
        self.skipped: list[dict[str, str]] = []
        self.log_issues: list[dict[str, Any]] = []
        self.envoy_stats: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.failures: list[dict[str, Any]] = []
        self.conditions: list[dict[str, Any]] = []
        self.workers: dict[str, Worker] = {}
        self.started = datetime.now().astimezone()
        self.fd_limit = raise_fd_limit()
        self.modes = self._usable_modes(opts.modes)
        self.scenarios = tuple(s for s in SCENARIOS if s in opts.scenarios)
        self.progress = Progress(self._planned_seconds())

    # -- planning ------------------------------------------------------------------------------------------------

    def _usable_modes(self, wanted: Sequence[str]) -> tuple[str, ...]:
        data = [s for s in self.opts.scenarios if s in DATA_SCENARIOS]
        if not data:
            return ()
        reason = topology_skip_reason(self.opts.topology)
        if reason is not None:
            self.skipped.append({"what": f"topology {self.opts.topology} (every mode)", "reason": reason})
            return ()
        modes = []
        for m in MODES:
            if m not in wanted:
                continue
            reason = mode_skip_reason(self.opts.topology, m)
            if reason is not None:
                self.skipped.append({"what": f"mode {m}", "reason": reason})
                continue
            modes.append(m)
        return tuple(modes)

    def _memory_modes(self) -> list[str]:
        return [m for m in self.modes if m != "direct"]

    def _planned_seconds(self) -> float:
        p, n_modes = self.p, len(self.modes)
        per_rep = self._start_weight()
        if "throughput" in self.scenarios:
            per_rep += len(p.tput_streams) * n_modes * (p.tput_seconds + 0.3)
        if "latency" in self.scenarios:
            per_rep += len(p.latency_sizes) * n_modes * (0.2 + (p.latency_count + p.latency_warmup) * 150e-6)
        if "connrate" in self.scenarios:
            per_rep += n_modes * (p.connrate_seconds + 0.2)
        if "memory" in self.scenarios:
            per_rep += 2.0 + len(self._memory_modes()) * sum(3 * p.settle + c / 2500 for c in p.memory_counts)
        total = per_rep * self.reps
        if "controlplane" in self.scenarios:
            total += (
                2.0
                + p.xds_reps * sum(self._xds_weight(n) for n in p.xds_sizes)
                + 2 * self.reps * (p.rbac_seconds + 0.5)
            )
        return total

    def _start_weight(self) -> float:
        return 2.0 + 0.3 * len(self.modes)  # proxies start + settle + warm-up

    @staticmethod
    def _xds_weight(n: int) -> float:
        return 0.2 + n / 10000

    def _order(self, rep: int, modes: Sequence[str] | None = None) -> list[str]:
        ms = list(modes if modes is not None else self.modes)
        if not ms:
            return ms
        k = rep % len(ms)
        return ms[k:] + ms[:k]

    # -- running -------------------------------------------------------------------------------------------------

    def execute(self) -> Path:
        env = environment.collect()
        t0 = time.monotonic()
        data = [s for s in self.scenarios if s in DATA_SCENARIOS]
        self.progress.say(
            f"benchmark: profile {self.p.name}, {self.reps} repetition(s), modes {', '.join(self.modes) or '-'}, "
            f"scenarios {', '.join(self.scenarios) or '-'}; results in {self.outdir}"
        )
        self.progress.say(
            f"{env['cpu_model']}, {env['usable_cores']} usable cores shared by clients, server and proxies: "
            "compare modes through the ratios"
        )
        for s in self.skipped:
            self.progress.say(f"skipped {s['what']}: {s['reason']}")
        topo: Topology | None = None
        try:
            if data and self.modes:
                topo = make_topology(self.opts.topology, self.workdir, self.modes, self.opts.ztunnel_env, self.reps)
                topo.start_server()
                for name in topo.clients:
                    self.workers[name] = Worker(self.workdir / f"worker-{name}.log", topo.client_prefix(name))
                for rep in range(self.reps):
                    self._repetition(topo, rep, data)
            if "controlplane" in self.scenarios:
                self._controlplane(topo)
        finally:
            for w in self.workers.values():
                w.close()
            if topo is not None:
                self._record_issues(topo.close(), None)
        return self._write(env, time.monotonic() - t0, topo)

    def _repetition(self, topo: Topology, rep: int, scenarios: Sequence[str]) -> None:
        """Fresh proxies; idle memory; warm-up; throughput, latency, connrate; then fresh proxies again for the
        idle-connection memory samples, which come last because opening 10,000 tunnels churns the machine's ports
        (see bench/README.md) and would slow every connection opened after it."""
        order = self._order(rep)
        traffic = [s for s in scenarios if s != "memory"]
        self.progress.say(f"repetition {rep + 1}/{self.reps}: starting proxies")
        self.conditions.append({"rep": rep + 1, "time_wait_at_start": time_wait_sockets()})
        topo.start_proxies(self.workdir / f"rep{rep + 1}", rep)
        try:
            wait_settled(self.p.settle)
            load0 = self._load_snapshot(topo)
            if "memory" in scenarios:
                self._idle_memory(topo, rep)
            for mode in order:  # warm-up: pools, first handshakes, allocator; not recorded
                try:
                    self._call({"op": "latency", "route": topo.route(mode), "size": 64, "count": 50, "warmup": 0}, 30)
                except WorkerError as e:
                    self._failed("warm-up", "50 round trips", mode, rep, e)
            self.progress.step(self._start_weight(), f"rep {rep + 1} proxies started and warmed up")
            for scenario in traffic:
                if scenario == "throughput":
                    for streams in self.p.tput_streams:
                        for mode in order:
                            self._throughput(topo, rep, mode, streams)
                elif scenario == "latency":
                    for size in self.p.latency_sizes:
                        self._latency_case(topo, rep, order, size)
                elif scenario == "connrate":
                    for mode in order:
                        self._connrate(topo, rep, mode)
            self.envoy_stats.append({"rep": rep + 1, **topo.envoy_stats()})
            self.conditions[-1].update(self._load_share(load0, self._load_snapshot(topo)))
            share = self.conditions[-1]["foreign_cpu_share"] + self.conditions[-1]["steal_share"]
            if share > NOISY_SHARE:
                self.progress.say(
                    f"  ! other processes (or the hypervisor) took {share:.0%} of the machine during repetition "
                    f"{rep + 1}: its numbers are unreliable"
                )
        finally:
            self._record_issues(topo.stop_proxies(), rep + 1)
        if "memory" not in scenarios:
            return
        topo.start_proxies(self.workdir / f"rep{rep + 1}-memory", rep)
        self.conditions[-1]["time_wait_before_memory"] = time_wait_sockets()
        try:
            self.progress.step(2.0, f"rep {rep + 1} proxies restarted for the idle-connection samples")
            self._memory(topo, rep)
        finally:
            self._record_issues(topo.stop_proxies(), rep + 1)

    def _load_snapshot(self, topo: Topology) -> tuple[float, float, float, float]:
        """(wall, machine busy CPU, machine steal, CPU of this run's own processes and of kernel threads) now."""
        pids = {**topo.pids(), "orchestrator": os.getpid()}
        for name, w in self.workers.items():
            pids[f"client-{name}"] = w.pid
        busy, steal = machine_cpu()
        return time.monotonic(), busy, steal, sum(cpu_snapshot(pids).values()) + kernel_threads_cpu()

    @staticmethod
    def _load_share(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> dict[str, float]:
        """How much of the machine others took between two snapshots: CPU used by processes that are neither this
        run's nor kernel threads, and hypervisor steal, each as a share of all cores' time. (Softirq time spent
        in an idle CPU's context is counted as foreign: the estimate errs towards flagging.)"""
        wall = max(1e-9, b[0] - a[0]) * (os.cpu_count() or 1)
        ours = b[3] - a[3]
        foreign = max(0.0, (b[1] - a[1]) - ours - (b[2] - a[2]))
        return {
            "foreign_cpu_share": round(foreign / wall, 3),
            "steal_share": round((b[2] - a[2]) / wall, 3),
            "loadavg_1m": os.getloadavg()[0],
        }

    def _record_issues(self, issues: Sequence[LogIssue], rep: int | None) -> None:
        for issue in issues:
            self.log_issues.append({"rep": rep, **asdict(issue)})
            self.progress.say(f"  ! {issue.process}: {issue.count} warning/error line(s), e.g. {issue.examples[0]}")

    def _add(self, scenario: str, case: str, mode: str, rep: int, metrics: dict[str, Any], **raw: Any) -> None:
        sample: dict[str, Any] = {"scenario": scenario, "case": case, "mode": mode, "rep": rep + 1, "metrics": metrics}
        if raw:
            sample["raw"] = raw
        self.samples.append(sample)

    @staticmethod
    def _proxy_cpu(mode: str, cpu: Mapping[str, float]) -> float:
        return sum(cpu.get(p, 0.0) for p in PATH_PROXIES[mode])

    def _pids(self, topo: Topology, route: Mapping[str, Any]) -> dict[str, int]:
        return {**topo.pids(), "client": self.workers[route.get("client", "default")].pid}

    def _call(self, cmd: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Send a command to the route's client process; one that hangs or dies is replaced before the error is
        raised."""
        name = cmd.get("route", {}).get("client", "default")
        worker = self.workers[name]
        try:
            return worker.call(cmd, timeout)
        except WorkerError as e:
            if e.fatal:
                worker.kill()
                self.workers[name] = Worker(self.workdir / f"worker-{name}-{len(self.failures) + 2}.log", worker.prefix)
            raise

    def _failed(self, scenario: str, case: str, mode: str, rep: int, error: Exception) -> None:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        self.failures.append({"scenario": scenario, "case": case, "mode": mode, "rep": rep + 1, "error": message})
        self._add(scenario, case, mode, rep, {"errors": [message], "failed": True})
        self.progress.say(f"rep {rep + 1} {scenario} {case} {mode}: FAILED: {message}")

    def _throughput(self, topo: Topology, rep: int, mode: str, streams: int) -> None:
        case = f"{streams} stream" + ("s" if streams > 1 else "")
        route = topo.route(mode)
        cmd = {
            "op": "throughput",
            "route": route,
            "streams": streams,
            "seconds": self.p.tput_seconds,
            "stall_timeout": self.p.stall_timeout,
            "pids": self._pids(topo, route),
        }
        try:
            res = self._call(cmd, timeout=self.p.tput_seconds * 4 + 30)
        except WorkerError as e:
            self._failed("throughput", case, mode, rep, e)
            return
        proxy_cpu = self._proxy_cpu(mode, res["cpu"])
        gbit = res["bytes"] * 8 / 1e9
        per_stream = res["per_stream_gbps"]
        metrics: dict[str, Any] = {
            "gbps": res["gbps"],
            "gbit_per_cpu_s": gbit / proxy_cpu if proxy_cpu > 0 else None,
            "proxy_cpu_s": round(proxy_cpu, 3),
            "seconds": res["seconds"],
            "bytes": res["bytes"],
            "per_stream_gbps": per_stream,
            "cpu_s": res["cpu"],
            "errors": res["errors"],
        }
        if res["errors"]:
            # A stalled or broken stream makes the total meaningless: kept in the JSON, left out of the summary.
            metrics["failed"] = True
        if streams > 1 and max(per_stream) > 0:
            metrics["fairness"] = min(per_stream) / max(per_stream)
        self._add("throughput", case, mode, rep, metrics)
        per_cpu = f", {metrics['gbit_per_cpu_s']:.2f} Gbit/proxy-CPU-s" if metrics["gbit_per_cpu_s"] else ""
        errs = f", ERRORS {res['errors']}" if res["errors"] else ""
        self.progress.step(
            self.p.tput_seconds + 0.3,
            f"rep {rep + 1} throughput {case:<9} {mode:<6} {res['gbps']:6.2f} Gbit/s{per_cpu}{errs}",
        )

    def _latency_case(self, topo: Topology, rep: int, order: Sequence[str], size: int) -> None:
        """Ping-pong for every mode, in ``latency_slices`` slices taken in turn (direct, tcp, hbone, envoy, direct,
        ...), each on a new connection: round-trip times drift with where the scheduler puts the processes, and
        slicing spreads that drift over all modes instead of handing it to whichever ran at the time."""
        case = _size_label(size)
        slices = max(1, self.p.latency_slices)
        per_slice = max(1, self.p.latency_count // slices)
        warmup = max(1, self.p.latency_warmup // slices)
        rtts: dict[str, list[float]] = {m: [] for m in order}
        cpu: dict[str, dict[str, float]] = {m: {} for m in order}
        failed: dict[str, WorkerError] = {}
        for _ in range(slices):
            for mode in order:
                if mode in failed:
                    continue
                route = topo.route(mode)
                cmd = {
                    "op": "latency",
                    "route": route,
                    "size": size,
                    "count": per_slice,
                    "warmup": warmup,
                    "stall_timeout": self.p.stall_timeout,
                    "pids": self._pids(topo, route),
                }
                try:
                    res = self._call(cmd, timeout=60 + per_slice * 0.01)
                except WorkerError as e:
                    failed[mode] = e
                    continue
                rtts[mode] += res["rtt_us"]
                for name, seconds in res["cpu"].items():
                    cpu[mode][name] = cpu[mode].get(name, 0.0) + seconds
        for mode in order:
            if mode in failed:
                self._failed("latency", case, mode, rep, failed[mode])
                continue
            pct = _percentiles(rtts[mode])
            proxy_cpu = self._proxy_cpu(mode, cpu[mode])
            n = len(rtts[mode])
            metrics = {
                **{k: round(v, 1) for k, v in pct.items()},
                "count": n,
                "slices": slices,
                "proxy_cpu_us_per_rt": round(proxy_cpu / n * 1e6, 2) if PATH_PROXIES[mode] else None,
                "cpu_s": {k: round(v, 6) for k, v in cpu[mode].items()},
            }
            self._add("latency", case, mode, rep, metrics, rtt_us=rtts[mode])
            self.progress.step(
                0.2 + (self.p.latency_count + self.p.latency_warmup) * 150e-6,
                f"rep {rep + 1} latency    {case:<9} {mode:<6} p50 {pct['p50']:.0f} µs, p99 {pct['p99']:.0f} µs, "
                f"p99.9 {pct['p99.9']:.0f} µs",
            )

    def _connrate(self, topo: Topology, rep: int, mode: str) -> None:
        c = self.p.connrate_concurrency
        case = f"{c} concurrent"
        route = topo.route(mode)
        cmd = {
            "op": "connrate",
            "route": route,
            "concurrency": c,
            "seconds": self.p.connrate_seconds,
            "pids": self._pids(topo, route),
        }
        try:
            res = self._call(cmd, timeout=self.p.connrate_seconds * 4 + 30)
        except WorkerError as e:
            self._failed("connrate", case, mode, rep, e)
            return
        proxy_cpu = self._proxy_cpu(mode, res["cpu"])
        metrics = {
            "rate": res["rate"],
            "conn_per_cpu_s": res["connections"] / proxy_cpu if proxy_cpu > 0 else None,
            "connections": res["connections"],
            "proxy_cpu_s": round(proxy_cpu, 3),
            "conn_p50_us": res["conn_us"].get("p50"),
            "conn_p99_us": res["conn_us"].get("p99"),
            "conn_us": res["conn_us"],
            "cpu_s": res["cpu"],
            "errors": res["errors"],
        }
        self._add("connrate", case, mode, rep, metrics)
        errs = f", ERRORS {res['errors']}" if res["errors"] else ""
        self.progress.step(
            self.p.connrate_seconds + 0.2,
            f"rep {rep + 1} connrate   {case:<9} {mode:<6} {res['rate']:7.0f} conn/s{errs}",
        )

    def _idle_memory(self, topo: Topology, rep: int) -> None:
        rss = rss_snapshot(topo.proxy_pids())
        for mode in ("hbone", "envoy"):
            if mode not in self.modes:
                continue
            procs = PATH_PROXIES[mode]
            values = [rss[p] for p in procs]
            metrics = {
                "rss_mib": statistics.fmean(values) / 2**20,
                "rss_bytes": {p: rss[p] for p in procs},
                "uss_bytes": {p: uss_bytes(topo.proxy_pids()[p]) for p in procs},
            }
            self._add("memory", "idle", mode, rep, metrics)
            self.progress.say(
                f"rep {rep + 1} memory     idle      {mode:<6} "
                + ", ".join(f"{p} {rss[p] / 2**20:.1f} MiB" for p in procs)
            )

    def _memory(self, topo: Topology, rep: int) -> None:
        for count in self.p.memory_counts:
            for mode in self._order(rep, self._memory_modes()):
                need = count * _FDS_PER_CONN.get(mode, 1) + _FD_MARGIN
                if need > self.fd_limit:
                    what = f"memory {count:,} idle conns, mode {mode}"
                    if rep == 0:
                        self.skipped.append(
                            {
                                "what": what,
                                "reason": f"needs ~{need:,} file descriptors in one process; RLIMIT_NOFILE is "
                                f"{self.fd_limit:,} and the hard limit cannot be raised here (needs CAP_SYS_RESOURCE)",
                            }
                        )
                        self.progress.say(f"skipped {what}: RLIMIT_NOFILE {self.fd_limit:,} < ~{need:,}")
                    continue
                pids = topo.proxy_pids()
                procs = PATH_PROXIES[mode]
                wait_settled(self.p.settle)
                before = rss_snapshot(pids)
                uss_before = {p: uss_bytes(pids[p]) for p in procs}
                case = f"{count:,} idle conns"
                try:
                    route = topo.route(mode)
                    res = self._call(
                        {"op": "hold", "route": route, "count": count, "concurrency": 128},
                        timeout=60 + count / 50,
                    )
                    wait_settled(self.p.settle)
                    after = rss_snapshot(pids)
                    uss_after = {p: uss_bytes(pids[p]) for p in procs}
                    self._call({"op": "release", "route": route}, 60)
                except WorkerError as e:
                    self._failed("memory", case, mode, rep, e)
                    continue
                opened = max(1, res["opened"])
                delta = {p: after[p] - before[p] for p in procs}
                metrics = {
                    "per_conn_kib": sum(delta.values()) / opened / 1024,
                    "per_conn_kib_max_proxy": max(delta.values()) / opened / 1024,
                    "uss_per_conn_kib": sum(uss_after[p] - uss_before[p] for p in procs) / opened / 1024,
                    "opened": res["opened"],
                    "open_seconds": res["seconds"],
                    "rss_before": {p: before[p] for p in procs},
                    "rss_after": {p: after[p] for p in procs},
                    "errors": res["errors"],
                }
                self._add("memory", case, mode, rep, metrics)
                errs = f", errors {res['errors']}" if res["errors"] else ""
                self.progress.step(
                    3 * self.p.settle + count / 2500,
                    f"rep {rep + 1} memory     {case:<9} {mode:<6} {metrics['per_conn_kib']:.2f} KiB/tunnel "
                    f"({res['opened']} opened in {res['seconds']:.1f}s{errs})",
                )
            wait_settled(self.p.settle)

    def _controlplane(self, topo: Topology | None) -> None:
        import uvloop

        from bench.controlplane import XdsTarget, xds_apply

        p = self.p
        if topo is not None:
            config, node_ip = topo.controlplane_target()
        else:
            from ztunnel.testing import TwoNodeMesh

            mesh_dir = self.workdir / "controlplane-mesh"
            mesh_dir.mkdir(exist_ok=True)
            mesh = TwoNodeMesh(mesh_dir)
            octets = mesh.node_a.split(".")
            config, node_ip = mesh.config, f"127.{octets[1]}.{int(octets[2]) + 4}.1"
        target = XdsTarget(config, node_ip, self.workdir / "controlplane", dict(self.opts.ztunnel_env))
        target.workdir.mkdir(exist_ok=True)
        target.env_extra.setdefault("RUST_LOG", "warn")

        def on_sample(case: str, rep: int, metrics: dict[str, Any]) -> None:
            inproc = metrics.pop("inprocess")
            if inproc:
                metrics["inproc_total_s"] = inproc["total_s"]
                metrics["inprocess"] = inproc
            self._add("controlplane", f"xDS {int(case.split(maxsplit=1)[0]):,} workloads", "ztunnel", rep, metrics)
            self.progress.step(
                self._xds_weight(int(case.split(maxsplit=1)[0])),
                f"rep {rep + 1} xDS apply  {case:<15} push->ACK {metrics['apply_s']:.3f} s "
                f"(ztunnel CPU {metrics['apply_ztunnel_cpu_s']:.3f} s), removal {metrics['remove_s']:.3f} s",
            )

        def on_started() -> None:
            self.progress.step(2.0, "control plane: local control plane and a subscribed ztunnel started")

        # RBAC samples each run in a fresh process (see bench.controlplane.main).
        busy0, steal0 = machine_cpu()
        t0, own0 = time.monotonic(), _children_cpu() + kernel_threads_cpu()
        for rep in range(self.reps):
            for shape in ("spread", "one namespace"):
                res = _rbac_sample(p.rbac_policies, "spread" if shape == "spread" else "one", p.rbac_seconds)
                case = f"RBAC {p.rbac_policies:,} policies, {shape}"
                self._add("controlplane", case, "ztunnel", rep, res)
                self.progress.step(
                    p.rbac_seconds + 0.5,
                    f"rep {rep + 1} RBAC       {shape:<15} {res['us_per_check']:.1f} µs per check "
                    f"({res['policies_evaluated']} policies apply; plan compiled in {res['plan_ms']:.1f} ms)",
                )
        busy1, steal1 = machine_cpu()
        t1, own1 = time.monotonic(), _children_cpu() + kernel_threads_cpu()
        self.conditions.append(
            {"rep": "RBAC", **self._load_share((t0, busy0, steal0, own0), (t1, busy1, steal1, own1))}
        )
        self.progress.say("control plane: starting the local control plane and a ztunnel subscribed to it")
        uvloop.run(xds_apply(target, list(p.xds_sizes), p.xds_reps, on_sample, on_started=on_started))
        self._record_issues(_scan_controlplane_log(target.workdir / "ztunnel-c.log"), None)

    # -- output --------------------------------------------------------------------------------------------------

    def _write(self, env: dict[str, Any], duration: float, topo: Topology | None) -> Path:
        summary = report.summarize(self.samples)
        ratio_rows = report.ratios(self.samples)
        self.notes += _standard_notes(self.modes, self.scenarios, self.p, self.opts.topology)
        doc: dict[str, Any] = {
            "schema": 1,
            "meta": {
                "started": self.started.isoformat(timespec="seconds"),
                "duration_s": round(duration, 1),
                "profile": self.p.name,
                "profile_settings": asdict(self.p),
                "repetitions": self.reps,
                "modes": list(self.modes),
                "scenarios": list(self.scenarios),
                "topology": self.opts.topology,
                "topology_detail": topo.describe() if topo is not None else None,
                "argv": sys.argv,
            },
            "environment": env,
            "samples": self.samples,
            "summary": summary,
            "ratios": ratio_rows,
            "targets": report.targets(ratio_rows, summary),
            "skipped": self.skipped,
            "log_issues": self.log_issues,
            "failures": self.failures,
            "conditions": self.conditions,
            "envoy_stats": self.envoy_stats,
            "notes": self.notes,
        }
        (self.outdir / "results.json").write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        written = report.charts(doc, self.outdir)
        md = report.markdown(doc, written)
        (self.outdir / "results.md").write_text(md)
        if self.opts.update_latest and self.opts.out is None:
            latest = {}
            for scenario, name in written.items():
                shutil.copyfile(self.outdir / name, RESULTS / f"latest-{name}")
                latest[scenario] = f"latest-{name}"
            (RESULTS / "latest.md").write_text(report.markdown(doc, latest))
        self.progress.say(f"done in {_clock(duration)}: {self.outdir / 'results.md'}")
        return self.outdir


def _rbac_sample(policies: int, shape: str, seconds: float) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.controlplane", "rbac", str(policies), shape, str(seconds)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _children_cpu() -> float:
    """CPU seconds of this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _scan_controlplane_log(path: Path) -> list[LogIssue]:
    from bench.topology import ZTUNNEL_PROBLEM, scan_log

    found = scan_log("ztunnel-c (xDS)", path, ZTUNNEL_PROBLEM)
    return [found] if found is not None else []


def _standard_notes(modes: Sequence[str], scenarios: Sequence[str], p: Profile, topology: str) -> list[str]:
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


def parse_env(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--ztunnel-env {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def main_run(opts: Options, on_done: Callable[[Path], None] | None = None) -> Path:
    run = Run(opts)
    out = run.execute()
    if on_done is not None:
        on_done(out)
    return out

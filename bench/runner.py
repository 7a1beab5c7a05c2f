"""The orchestrator: starts the processes, runs the scenarios with modes interleaved, writes the results.

One repetition = fresh proxies (idle memory, warm-up), throughput, latency and connrate with every selected mode,
in an order rotated by one mode per repetition (so no mode is always first after a start, or always after
another), then fresh proxies again for the idle-connection memory samples. Within a scenario each case runs all
modes back to back, so the values a ratio pairs were measured seconds apart. The control-plane scenarios run once
after the data-path repetitions, with their own repetitions.

The orchestrator only starts processes, sends commands and reads ``/proc``: clients (``bench.worker``), the server
(``bench.server``) and each proxy are separate processes. Each scenario is a module of :mod:`bench.scenarios`;
the profiles are in :mod:`bench.profiles`, the client processes in :mod:`bench.clients`, what is recorded and
written in :mod:`bench.recorder`.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import environment
from bench.clients import Clients, WorkerError
from bench.processes import INLINE, found, label, mismatch, variant_env
from bench.procstat import (
    LoadSnapshot,
    cpu_snapshot,
    kernel_threads_cpu,
    load_share,
    machine_cpu,
    process_tree,
    time_wait_sockets,
)
from bench.profiles import Profile
from bench.progress import Progress, clock
from bench.recorder import RESULTS, Recorder, standard_notes
from bench.scenarios import DATA, DATA_SCENARIOS, SCENARIOS
from bench.scenarios.base import Context, DataScenario, rotated
from bench.scenarios.controlplane import ControlPlane
from bench.topologies import make_topology, mode_skip_reason, topology_skip_reason
from bench.topology import MODES, Topology, wait_settled

# Above this share of the machine taken by others during a repetition, the report flags its numbers.
NOISY_SHARE = 0.10


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
    workers: tuple[str, ...] = ()  # process models to compare (bench.processes); () = the ztunnel's default


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
        self.started = datetime.now().astimezone()
        self.fd_limit = raise_fd_limit()
        self.progress = Progress()  # the total is planned below, once the modes are known
        self.recorder = Recorder(self.progress)
        self.clients = Clients(self.workdir)
        self.modes = self._usable_modes(opts.modes)
        self.scenarios = tuple(s for s in SCENARIOS if s in opts.scenarios)
        # Process models: each runs the data-path scenarios; the inline baseline's idle memory is taken anyway.
        self.variants: tuple[str | None, ...] = opts.workers or (None,)
        self.idle_only: tuple[str, ...] = () if not opts.workers or INLINE in opts.workers else (INLINE,)
        ctx = Context(
            self.p,
            self.modes,
            self.reps,
            self.fd_limit,
            self.workdir,
            dict(opts.ztunnel_env),
            self.clients,
            self.recorder,
            self.progress,
        )
        self.data: list[DataScenario] = [cls(ctx) for cls in DATA if cls.name in self.scenarios]
        self.controlplane = ControlPlane(ctx) if "controlplane" in self.scenarios else None
        self.progress.plan(self._planned_seconds())

    # -- planning ------------------------------------------------------------------------------------------------

    def _usable_modes(self, wanted: Sequence[str]) -> tuple[str, ...]:
        data = [s for s in self.opts.scenarios if s in DATA_SCENARIOS]
        if not data:
            return ()
        skipped = self.recorder.skipped
        reason = topology_skip_reason(self.opts.topology)
        if reason is not None:
            skipped.append({"what": f"topology {self.opts.topology} (every mode)", "reason": reason})
            return ()
        modes = []
        for m in MODES:
            if m not in wanted:
                continue
            reason = mode_skip_reason(self.opts.topology, m)
            if reason is not None:
                skipped.append({"what": f"mode {m}", "reason": reason})
                continue
            modes.append(m)
        return tuple(modes)

    def _planned_seconds(self) -> float:
        per_rep = (self._start_weight() + sum(s.seconds() for s in self.data)) * len(self.variants)
        per_rep += 2.0 * len(self.idle_only)
        total = per_rep * self.reps
        if self.controlplane is not None:
            total += self.controlplane.seconds()
        return total

    def _start_weight(self) -> float:
        return 2.0 + 0.3 * len(self.modes)  # proxies start + settle + warm-up

    # -- running -------------------------------------------------------------------------------------------------

    def execute(self) -> Path:
        env = environment.collect()
        t0 = time.monotonic()
        self.progress.say(
            f"benchmark: profile {self.p.name}, {self.reps} repetition(s), modes {', '.join(self.modes) or '-'}, "
            f"scenarios {', '.join(self.scenarios) or '-'}; results in {self.outdir}"
        )
        self.progress.say(
            f"{env['cpu_model']}, {env['usable_cores']} usable cores shared by clients, server and proxies: "
            "compare modes through the ratios"
        )
        for s in self.recorder.skipped:
            self.progress.say(f"skipped {s['what']}: {s['reason']}")
        topo: Topology | None = None
        try:
            if self.data and self.modes:
                topo = make_topology(self.opts.topology, self.workdir, self.modes, self.opts.ztunnel_env, self.reps)
                topo.start_server()
                for name in topo.clients:
                    self.clients.start(name, topo.client_prefix(name))
                for rep in range(self.reps):
                    self._repetition(topo, rep)
            if self.controlplane is not None:
                self.controlplane.run(topo)
        finally:
            self.clients.close()
            if topo is not None:
                self.recorder.issues(topo.close(), None)
        return self._write(env, time.monotonic() - t0, topo)

    def _repetition(self, topo: Topology, rep: int) -> None:
        """Every process model (``--workers``) in turn, in an order rotated by one per repetition; with none, the
        ztunnel's default."""
        for variant in rotated([*self.variants, *self.idle_only], rep):
            self.recorder.variant = variant
            try:
                if variant in self.idle_only:
                    self._idle_only(topo, rep, variant)
                else:
                    self._variant(topo, rep, variant)
            finally:
                self.recorder.variant = None

    def _start(self, topo: Topology, rep: int, variant: str | None, logdir: Path) -> None:
        """Start the proxies with ``variant``'s environment, let them settle, and record what processes they are
        made of and their idle memory."""
        topo.start_proxies(logdir, rep, variant_env(variant) if variant is not None else None)
        wait_settled(self.p.settle)
        record = found(topo.proxy_pids(), variant, rep)
        self.recorder.processes.append(record)
        problem = mismatch(record, [p for p in record["proxies"] if p.startswith("ztunnel")])
        if problem is not None:
            self.progress.say(f"  ! {problem}")
            if problem not in self.recorder.notes:
                self.recorder.notes.append(problem)

    def _idle_only(self, topo: Topology, rep: int, variant: str) -> None:
        """The baseline of the memory target: start, settle, idle memory (in :meth:`_start`), stop."""
        self.progress.say(f"repetition {rep + 1}/{self.reps}: starting proxies ({label(variant)}, idle memory only)")
        logdir = self.workdir / f"rep{rep + 1}-{variant}"
        try:
            self._start(topo, rep, variant, logdir)
        finally:
            self.recorder.issues(topo.stop_proxies(), rep + 1)
        self.progress.step(2.0, f"rep {rep + 1} {label(variant)}: idle memory taken")

    def _variant(self, topo: Topology, rep: int, variant: str | None) -> None:
        """Fresh proxies; idle memory; warm-up; throughput, latency, connrate; then fresh proxies again for the
        idle-connection memory samples, which come last because opening 10,000 tunnels churns the machine's ports
        (see bench/README.md) and would slow every connection opened after it."""
        order = rotated(self.modes, rep)
        rec = self.recorder
        suffix = f"-{variant}" if variant is not None else ""
        what = f" ({label(variant)})" if variant is not None else ""
        self.progress.say(f"repetition {rep + 1}/{self.reps}: starting proxies{what}")
        rec.conditions.append({"rep": rep + 1, "time_wait_at_start": time_wait_sockets()})
        if variant is not None:
            rec.conditions[-1]["workers"] = variant
        self._start(topo, rep, variant, self.workdir / f"rep{rep + 1}{suffix}")
        try:
            load0 = self._load_snapshot(topo)
            for scenario in self.data:
                scenario.after_start(topo, rep)
            for mode in order:  # warm-up: pools, first handshakes, allocator; not recorded
                try:
                    self.clients.call(
                        {"op": "latency", "route": topo.route(mode), "size": 64, "count": 50, "warmup": 0}, 30
                    )
                except WorkerError as e:
                    rec.failed("warm-up", "50 round trips", mode, rep, e)
            self.progress.step(self._start_weight(), f"rep {rep + 1} proxies started and warmed up")
            for scenario in self.data:
                if scenario.fresh_proxies is None:
                    scenario.run(topo, rep, order)
            rec.envoy_stats.append({"rep": rep + 1, **topo.envoy_stats()})
            rec.conditions[-1].update(load_share(load0, self._load_snapshot(topo)))
            share = rec.conditions[-1]["foreign_cpu_share"] + rec.conditions[-1]["steal_share"]
            if share > NOISY_SHARE:
                self.progress.say(
                    f"  ! other processes (or the hypervisor) took {share:.0%} of the machine during repetition "
                    f"{rep + 1}: its numbers are unreliable"
                )
        finally:
            rec.issues(topo.stop_proxies(), rep + 1)
        for scenario in self.data:
            if scenario.fresh_proxies is None:
                continue
            self._start(topo, rep, variant, self.workdir / f"rep{rep + 1}{suffix}-{scenario.name}")
            rec.conditions[-1][f"time_wait_before_{scenario.name}"] = time_wait_sockets()
            try:
                self.progress.step(2.0, f"rep {rep + 1} proxies restarted for {scenario.fresh_proxies}")
                scenario.run(topo, rep, order)
            finally:
                rec.issues(topo.stop_proxies(), rep + 1)

    def _load_snapshot(self, topo: Topology) -> LoadSnapshot:
        """(wall, machine busy CPU, machine steal, CPU of this run's own processes and of kernel threads) now."""
        pids = {**process_tree(topo.pids()), "orchestrator": os.getpid()}
        for name, pid in self.clients.pids().items():
            pids[f"client-{name}"] = pid
        busy, steal = machine_cpu()
        return time.monotonic(), busy, steal, sum(cpu_snapshot(pids).values()) + kernel_threads_cpu()

    # -- output --------------------------------------------------------------------------------------------------

    def _write(self, env: dict[str, Any], duration: float, topo: Topology | None) -> Path:
        self.recorder.notes += standard_notes(self.modes, self.scenarios, self.p, self.opts.topology)
        meta = {
            "started": self.started.isoformat(timespec="seconds"),
            "duration_s": round(duration, 1),
            "profile": self.p.name,
            "profile_settings": asdict(self.p),
            "repetitions": self.reps,
            "modes": list(self.modes),
            "scenarios": list(self.scenarios),
            "topology": self.opts.topology,
            "topology_detail": topo.describe() if topo is not None else None,
            "workers": list(self.opts.workers),
            "workers_idle_only": list(self.idle_only),
            "argv": sys.argv,
        }
        self.recorder.write(self.outdir, meta, env, latest=self.opts.update_latest and self.opts.out is None)
        self.progress.say(f"done in {clock(duration)}: {self.outdir / 'results.md'}")
        return self.outdir


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

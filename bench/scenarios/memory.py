"""Memory: RSS of freshly started proxies (idle), then the growth per held idle tunnel (1,000 and 10,000 of them),
on proxies started again for it (opening 10,000 tunnels churns the machine's ports, so it runs last)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from bench.clients import WorkerError
from bench.procstat import owner, per_proxy, process_tree, pss_snapshot, rss_snapshot, uss_snapshot
from bench.scenarios.base import DataScenario, rotated
from bench.topology import PATH_PROXIES, Topology, wait_settled

# File descriptors per process the memory scenario needs, per held connection and fixed: ztunnel A in tcp mode holds
# two sockets per connection (client and upstream); every other process one.
_FDS_PER_CONN = {"tcp": 2, "loop": 2, "upstream-loop": 2}  # a self-loop holds both ends of its tunnel
_FD_MARGIN = 512


class Memory(DataScenario):
    name = "memory"
    fresh_proxies = "the idle-connection samples"

    def _modes(self) -> list[str]:
        return [m for m in self.ctx.modes if m != "direct"]

    def seconds(self) -> float:
        # 2 s: the proxies' restart.
        return 2.0 + len(self._modes()) * sum(3 * self.p.settle + c / 2500 for c in self.p.memory_counts)

    def after_start(self, topo: Topology, rep: int) -> None:
        """Idle RSS, PSS (and USS) of the proxies on the hbone and envoy paths, freshly started, each proxy with
        all its processes (a ztunnel's control process and workers)."""
        ctx = self.ctx
        tree = process_tree(topo.proxy_pids())
        for mode in ("hbone", "envoy", "hbone-ns", "upstream"):
            if mode not in ctx.modes:
                continue
            procs = PATH_PROXIES[mode]
            rss = per_proxy(rss_snapshot(tree), procs)
            pss = per_proxy(pss_snapshot(tree), procs)
            metrics = {
                "rss_mib": statistics.fmean(rss.values()) / 2**20,
                "pss_mib": statistics.fmean(pss.values()) / 2**20,
                "rss_bytes": rss,
                "pss_bytes": pss,
                "uss_bytes": per_proxy(uss_snapshot(tree), procs),
                "processes": {p: len([n for n in tree if owner(n) == p]) for p in procs},
            }
            ctx.recorder.add("memory", "idle", mode, rep, metrics)
            ctx.progress.say(
                f"rep {rep + 1} memory     idle      {mode:<6} "
                + ", ".join(f"{p} {rss[p] / 2**20:.1f} MiB" for p in procs)
            )

    def run(self, topo: Topology, rep: int, order: Sequence[str]) -> None:
        """RSS growth per held tunnel, for each count and mode (in this scenario's own rotation)."""
        ctx, rec = self.ctx, self.ctx.recorder
        for count in self.p.memory_counts:
            for mode in rotated(self._modes(), rep):
                need = count * _FDS_PER_CONN.get(mode, 1) + _FD_MARGIN
                if need > ctx.fd_limit:
                    what = f"memory {count:,} idle conns, mode {mode}"
                    if rep == 0:
                        rec.skipped.append(
                            {
                                "what": what,
                                "reason": f"needs ~{need:,} file descriptors in one process; RLIMIT_NOFILE is "
                                f"{ctx.fd_limit:,} and the hard limit cannot be raised here (needs CAP_SYS_RESOURCE)",
                            }
                        )
                        ctx.progress.say(f"skipped {what}: RLIMIT_NOFILE {ctx.fd_limit:,} < ~{need:,}")
                    continue
                pids = process_tree(topo.proxy_pids())
                procs = PATH_PROXIES[mode]
                wait_settled(self.p.settle)
                before = per_proxy(rss_snapshot(pids), procs)
                uss_before = per_proxy(uss_snapshot(pids), procs)
                case = f"{count:,} idle conns"
                try:
                    route = topo.route(mode)
                    res = ctx.call(
                        {"op": "hold", "route": route, "count": count, "concurrency": 128},
                        timeout=60 + count / 50,
                    )
                    wait_settled(self.p.settle)
                    after = per_proxy(rss_snapshot(pids), procs)
                    uss_after = per_proxy(uss_snapshot(pids), procs)
                    ctx.call({"op": "release", "route": route}, 60)
                except WorkerError as e:
                    rec.failed("memory", case, mode, rep, e)
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
                rec.add("memory", case, mode, rep, metrics)
                errs = f", errors {res['errors']}" if res["errors"] else ""
                ctx.progress.step(
                    3 * self.p.settle + count / 2500,
                    f"rep {rep + 1} memory     {case:<9} {mode:<6} {metrics['per_conn_kib']:.2f} KiB/tunnel "
                    f"({res['opened']} opened in {res['seconds']:.1f}s{errs})",
                )
            wait_settled(self.p.settle)

"""Connection rate: new connections per second, each with a one-byte echo, ``connrate_concurrency`` at a time."""

from __future__ import annotations

from collections.abc import Sequence

from bench.clients import WorkerError
from bench.scenarios.base import DataScenario, process_split, proxy_cpu, proxy_kernel
from bench.topology import Topology


class ConnRate(DataScenario):
    name = "connrate"

    def seconds(self) -> float:
        return len(self.ctx.modes) * (self.p.connrate_seconds + 0.2)

    def run(self, topo: Topology, rep: int, order: Sequence[str]) -> None:
        for mode in order:
            self._measure(topo, rep, mode)

    def _measure(self, topo: Topology, rep: int, mode: str) -> None:
        ctx = self.ctx
        c = self.p.connrate_concurrency
        case = f"{c} concurrent"
        route = topo.route(mode)
        cmd = {
            "op": "connrate",
            "route": route,
            "concurrency": c,
            "seconds": self.p.connrate_seconds,
            "pids": ctx.pids(topo, route),
        }
        try:
            res = ctx.call(cmd, timeout=self.p.connrate_seconds * 4 + 30)
        except WorkerError as e:
            ctx.recorder.failed("connrate", case, mode, rep, e)
            return
        cpu = proxy_cpu(mode, res["cpu"])
        n = res["connections"]
        kernel = proxy_kernel(mode, res) if cpu > 0 and n else None
        metrics = {
            "rate": res["rate"],
            "conn_per_cpu_s": res["connections"] / cpu if cpu > 0 else None,
            "proxy_cpu_us_per_conn": cpu / n * 1e6 if cpu > 0 and n else None,
            # Where that CPU went: the proxies' system calls (and the loopback TCP work the kernel does in them) or
            # their own code; the same split for upstream tells which of the two a ratio comes from.
            "proxy_kernel_us_per_conn": kernel / n * 1e6 if kernel is not None else None,
            "proxy_user_us_per_conn": (cpu - kernel) / n * 1e6 if kernel is not None else None,
            "connections": res["connections"],
            "proxy_cpu_s": round(cpu, 3),
            "conn_p50_us": res["conn_us"].get("p50"),
            "conn_p99_us": res["conn_us"].get("p99"),
            "conn_us": res["conn_us"],
            "cpu_s": res["cpu"],
            "errors": res["errors"],
            **process_split(mode, res["cpu"], res["cpu_window_s"]),
        }
        ctx.recorder.add("connrate", case, mode, rep, metrics)
        errs = f", ERRORS {res['errors']}" if res["errors"] else ""
        ctx.progress.step(
            self.p.connrate_seconds + 0.2,
            f"rep {rep + 1} connrate   {case:<9} {mode:<6} {res['rate']:7.0f} conn/s{errs}",
        )

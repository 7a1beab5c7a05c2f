"""Throughput: 1, 2 and 8 streams of 1 MiB writes for ``tput_seconds``, Gbit/s and Gbit per proxy-CPU-second."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.clients import WorkerError
from bench.scenarios.base import DataScenario, process_split, proxy_cpu, proxy_kernel
from bench.topology import Topology


class Throughput(DataScenario):
    name = "throughput"

    def seconds(self) -> float:
        return len(self.p.tput_streams) * len(self.ctx.modes) * (self.p.tput_seconds + 0.3)

    def run(self, topo: Topology, rep: int, order: Sequence[str]) -> None:
        for streams in self.p.tput_streams:
            for mode in order:
                self._measure(topo, rep, mode, streams)

    def _measure(self, topo: Topology, rep: int, mode: str, streams: int) -> None:
        ctx, rec = self.ctx, self.ctx.recorder
        case = f"{streams} stream" + ("s" if streams > 1 else "")
        route = topo.route(mode)
        cmd = {
            "op": "throughput",
            "route": route,
            "streams": streams,
            "seconds": self.p.tput_seconds,
            "stall_timeout": self.p.stall_timeout,
            "pids": ctx.pids(topo, route),
        }
        try:
            res = ctx.call(cmd, timeout=self.p.tput_seconds * 4 + 30)
        except WorkerError as e:
            rec.failed("throughput", case, mode, rep, e)
            return
        cpu = proxy_cpu(mode, res["cpu"])
        gbit = res["bytes"] * 8 / 1e9
        kernel = proxy_kernel(mode, res) if cpu > 0 and gbit > 0 else None
        per_stream = res["per_stream_gbps"]
        metrics: dict[str, Any] = {
            "gbps": res["gbps"],
            "gbit_per_cpu_s": gbit / cpu if cpu > 0 else None,
            "proxy_cpu_s_per_gbit": cpu / gbit if cpu > 0 and gbit > 0 else None,
            "proxy_kernel_cpu_s_per_gbit": kernel / gbit if kernel is not None else None,
            "proxy_user_cpu_s_per_gbit": (cpu - kernel) / gbit if kernel is not None else None,
            "proxy_cpu_s": round(cpu, 3),
            "seconds": res["seconds"],
            "bytes": res["bytes"],
            "per_stream_gbps": per_stream,
            "cpu_s": res["cpu"],
            "errors": res["errors"],
            **process_split(mode, res["cpu"], res["cpu_window_s"]),
        }
        if res["errors"]:
            # A stalled or broken stream makes the total meaningless: kept in the JSON, left out of the summary.
            metrics["failed"] = True
        if streams > 1 and max(per_stream) > 0:
            metrics["fairness"] = min(per_stream) / max(per_stream)
        rec.add("throughput", case, mode, rep, metrics)
        per_cpu = f", {metrics['gbit_per_cpu_s']:.2f} Gbit/proxy-CPU-s" if metrics["gbit_per_cpu_s"] else ""
        errs = f", ERRORS {res['errors']}" if res["errors"] else ""
        ctx.progress.step(
            self.p.tput_seconds + 0.3,
            f"rep {rep + 1} throughput {case:<9} {mode:<6} {res['gbps']:6.2f} Gbit/s{per_cpu}{errs}",
        )

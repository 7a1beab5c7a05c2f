"""The control-plane scenarios, run once after the data-path repetitions with their own repetitions: RBAC checks
against many policies (each sample in a fresh process), then xDS pushes of N workloads to a subscribed ztunnel."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.procstat import children_cpu, kernel_threads_cpu, load_share, machine_cpu
from bench.scenarios.base import Context
from bench.topology import ZTUNNEL_PROBLEM, LogIssue, Topology, scan_log


class ControlPlane:
    name = "controlplane"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.p = ctx.profile

    def seconds(self) -> float:
        """Planned seconds for the whole scenario (it is not repeated per data-path repetition)."""
        p = self.p
        return 2.0 + p.xds_reps * sum(_xds_weight(n) for n in p.xds_sizes) + 2 * self.ctx.reps * (p.rbac_seconds + 0.5)

    def run(self, topo: Topology | None) -> None:
        """Against ``topo``'s mesh config and spare address, or a two-node mesh of its own when no data-path
        scenario ran."""
        import uvloop

        from bench.controlplane import XdsTarget, xds_apply

        ctx, p, rec = self.ctx, self.p, self.ctx.recorder
        if topo is not None:
            config, node_ip = topo.controlplane_target()
        else:
            from ztunnel.testing import TwoNodeMesh

            mesh_dir = ctx.workdir / "controlplane-mesh"
            mesh_dir.mkdir(exist_ok=True)
            mesh = TwoNodeMesh(mesh_dir)
            octets = mesh.node_a.split(".")
            config, node_ip = mesh.config, f"127.{octets[1]}.{int(octets[2]) + 4}.1"
        target = XdsTarget(config, node_ip, ctx.workdir / "controlplane", dict(ctx.ztunnel_env))
        target.workdir.mkdir(exist_ok=True)
        target.env_extra.setdefault("RUST_LOG", "warn")

        def on_sample(case: str, rep: int, metrics: dict[str, Any]) -> None:
            inproc = metrics.pop("inprocess")
            if inproc:
                metrics["inproc_total_s"] = inproc["total_s"]
                metrics["inprocess"] = inproc
            rec.add("controlplane", f"xDS {int(case.split(maxsplit=1)[0]):,} workloads", "ztunnel", rep, metrics)
            ctx.progress.step(
                _xds_weight(int(case.split(maxsplit=1)[0])),
                f"rep {rep + 1} xDS apply  {case:<15} push->ACK {metrics['apply_s']:.3f} s "
                f"(ztunnel CPU {metrics['apply_ztunnel_cpu_s']:.3f} s), removal {metrics['remove_s']:.3f} s",
            )

        def on_started() -> None:
            ctx.progress.step(2.0, "control plane: local control plane and a subscribed ztunnel started")

        # RBAC samples each run in a fresh process (see bench.controlplane.main).
        busy0, steal0 = machine_cpu()
        t0, own0 = time.monotonic(), children_cpu() + kernel_threads_cpu()
        for rep in range(ctx.reps):
            for shape in ("spread", "one namespace"):
                res = _rbac_sample(p.rbac_policies, "spread" if shape == "spread" else "one", p.rbac_seconds)
                case = f"RBAC {p.rbac_policies:,} policies, {shape}"
                rec.add("controlplane", case, "ztunnel", rep, res)
                ctx.progress.step(
                    p.rbac_seconds + 0.5,
                    f"rep {rep + 1} RBAC       {shape:<15} {res['us_per_check']:.1f} µs per check "
                    f"({res['policies_evaluated']} policies apply; plan compiled in {res['plan_ms']:.1f} ms)",
                )
        busy1, steal1 = machine_cpu()
        t1, own1 = time.monotonic(), children_cpu() + kernel_threads_cpu()
        rec.conditions.append({"rep": "RBAC", **load_share((t0, busy0, steal0, own0), (t1, busy1, steal1, own1))})
        ctx.progress.say("control plane: starting the local control plane and a ztunnel subscribed to it")
        uvloop.run(xds_apply(target, list(p.xds_sizes), p.xds_reps, on_sample, on_started=on_started))
        rec.issues(_scan_log(target.workdir / "ztunnel-c.log"), None)


def _xds_weight(n: int) -> float:
    return 0.2 + n / 10000


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


def _scan_log(path: Path) -> list[LogIssue]:
    found = scan_log("ztunnel-c (xDS)", path, ZTUNNEL_PROBLEM)
    return [found] if found is not None else []

"""Control-plane scenarios: applying large xDS pushes, and authorization with 10,000 policies.

``xds``
    The local control plane (:mod:`ztunnel.standins.istiod`, in the orchestrator's process) serves the two-node
    example; a dedicated ztunnel process ("node C", its own loopback address, certificates from the control plane's
    CA) subscribes over real gRPC + TLS. Each sample pushes the example plus N generated workloads (and N/10
    services they belong to) and times **push -> ACK**: from the moment the new snapshot is queued to the moment
    the ztunnel's ACK of that response arrives. ztunnel ACKs a delta response only after converting every resource
    and applying the batch to its state (one synchronous ``ProxyState.apply``), so the ACK marks "applied". The
    time includes the control plane serializing the response and gRPC carrying it (a few MB at 10,000
    workloads); the ztunnel's own CPU seconds over the same window are reported beside it. Then the generated
    resources are removed again (a delta of N+N/10 removals), timed the same way.

    The same snapshot is also applied in-process, phase by phase, to separate ztunnel's own costs from the
    transport's: protobuf decode (``Address.FromString``), conversion (``address_from_xds``), and
    ``ProxyState.apply`` of the converted batch.

``rbac``
    10,000 authorization policies applied to a :class:`~ztunnel.state.ProxyState`, then the per-connection check
    the inbound path makes (``state.policies.plan`` + ``Plan.evaluate``), timed over many calls, and the time to
    compile the plan once after a policy change.
    Two shapes: *spread* (100 namespaces x 100 policies; the destination's namespace holds 100, the match is the
    last one looked at) and *one namespace* (all 10,000 apply to the destination; the allowing policy is the last).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procstat import cpu_seconds
from ztunnel.rbac import (
    Action,
    Authorization,
    Connection,
    Match,
    Plan,
    Scope,
    StringMatch,
    StringMatchKind,
    evaluate,
)
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import Service
from ztunnel.state.workload import InboundProtocol, NetworkAddress, Workload

TRUST_DOMAIN = "cluster.local"
NAMESPACES = 100
_WORKLOAD_BASE = int(ipaddress.IPv4Address("10.128.0.0"))
_VIP_BASE = int(ipaddress.IPv4Address("10.96.0.0"))


def generated_workloads(n: int) -> StateUpdate:
    """``n`` pods in ``NAMESPACES`` namespaces, each an endpoint of one of ``n // 10`` services (port 80 -> 8080)."""
    n_services = max(1, n // 10)
    services: list[Service] = []
    for j in range(n_services):
        ns = f"bench-{j % NAMESPACES}"
        services.append(
            Service(
                name=f"svc-{j}",
                namespace=ns,
                hostname=f"svc-{j}.{ns}.svc.cluster.local",
                vips=(NetworkAddress("", ipaddress.IPv4Address(_VIP_BASE + j + 1)),),
                ports={80: 8080},
            )
        )
    workloads: list[Workload] = []
    for i in range(n):
        svc = services[i % n_services]
        workloads.append(
            Workload(
                uid=f"Kubernetes//v1/Pod/{svc.namespace}/pod-{i}",
                name=f"pod-{i}",
                namespace=svc.namespace,
                workload_ips=(ipaddress.IPv4Address(_WORKLOAD_BASE + i + 1),),
                trust_domain=TRUST_DOMAIN,
                service_account=f"sa-{i % 50}",
                protocol=InboundProtocol.HBONE,
                workload_name=svc.name,
                workload_type="deployment",
                canonical_name=svc.name,
                canonical_revision="v1",
                node=f"node-{i % 20}",
                cluster_id="Kubernetes",
                services={svc.key: {80: 8080}},
            )
        )
    return StateUpdate(workloads=workloads, services=services)


def merged(base: StateUpdate, extra: StateUpdate) -> StateUpdate:
    return StateUpdate(
        workloads=base.workloads + extra.workloads,
        services=base.services + extra.services,
        policies=base.policies + extra.policies,
    )


# -- xDS push -> ACK -----------------------------------------------------------------------------------------------


@dataclass
class XdsTarget:
    """What the xDS scenario needs from the topology: the example config, an address and CA for node C."""

    config_path: Path
    node_ip: str
    workdir: Path
    env_extra: dict[str, str]


async def _wait_ack(session: Any, before: int, timeout: float) -> None:
    from ztunnel.xds.types import ADDRESS_TYPE

    deadline = time.perf_counter() + timeout
    while True:
        if any(t == ADDRESS_TYPE for t, _ in session.acks[before:]):
            return
        if session.nacks:
            raise RuntimeError(f"ztunnel NACKed the push: {session.nacks[-1].message}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no ACK within {timeout:g}s")
        await asyncio.sleep(0.0005)


async def _push(cp: Any, session: Any, update: StateUpdate, pid: int, timeout: float) -> dict[str, float]:
    before = len(session.acks)
    t_build = time.perf_counter()
    cp.set_config(update)  # builds the snapshot (control-plane work) and queues the delta for the stream
    t0 = time.perf_counter()
    cpu0 = cpu_seconds(pid)
    await _wait_ack(session, before, timeout)
    t1 = time.perf_counter()
    return {
        "seconds": round(t1 - t0, 4),
        "ztunnel_cpu_s": round(cpu_seconds(pid) - cpu0, 3),
        "snapshot_build_s": round(t0 - t_build, 4),
    }


def inprocess_apply(cp: Any) -> dict[str, float]:
    """Decode, convert and apply the control plane's current Address resources in this process, phase by phase."""
    from xds.istio.workload import workload_pb2 as wl_pb
    from ztunnel.xds.types import ADDRESS_TYPE, address_from_xds

    payloads = [r.payload.value for r in cp.snapshot.of(ADDRESS_TYPE).values()]
    t0 = time.perf_counter()
    messages = [wl_pb.Address.FromString(p) for p in payloads]
    t1 = time.perf_counter()
    items = [address_from_xds(m) for m in messages]
    t2 = time.perf_counter()
    batch = StateUpdate()
    for item in items:
        (batch.workloads if isinstance(item, Workload) else batch.services).append(item)  # type: ignore[arg-type]
    state = ProxyState()
    t3 = time.perf_counter()
    state.apply(batch)
    t4 = time.perf_counter()
    return {
        "decode_s": round(t1 - t0, 4),
        "convert_s": round(t2 - t1, 4),
        "apply_s": round(t4 - t3, 4),
        "total_s": round(t2 - t0 + t4 - t3, 4),
        "resources": len(payloads),
    }


async def xds_apply(
    target: XdsTarget,
    sizes: list[int],
    reps: int,
    on_sample: Callable[[str, int, dict[str, Any]], None],
    timeout: float = 120.0,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Run the xDS scenario: ``on_sample(case, rep, metrics)`` for each size and repetition."""
    from ztunnel.identity.spiffe import Identity
    from ztunnel.localconfig import load_local_config
    from ztunnel.testing import ZtunnelProcess, node_env
    from ztunnel.testing.control_plane import control_plane, ztunnel_env

    base = load_local_config(target.config_path, TRUST_DOMAIN).update
    base = StateUpdate(workloads=base.workloads, services=base.services, policies=base.policies)
    generated = {n: merged(base, generated_workloads(n)) for n in sizes}
    client = Identity(TRUST_DOMAIN, "default", "client")
    async with control_plane(target.workdir, tokens={"bench": client}, listen=f"{target.node_ip}:0") as cp:
        cp.set_config(base)
        env = node_env("node-c", target.node_ip, "default/client/client", target.workdir / "unused-ca")
        del env["LOCAL_XDS_PATH"]
        token = target.workdir / "xds-token"  # AUTH_TOKEN is a file path when such a file exists
        token.write_text("bench\n")
        env.update(ztunnel_env(cp, token=str(token), **target.env_extra))
        z = ZtunnelProcess(env, target.workdir / "ztunnel-c.log")
        try:
            await asyncio.to_thread(z.start)
            assert z.proc is not None
            pid = z.proc.pid
            session = cp.sessions[-1]
            if on_started is not None:
                on_started()
            for rep in range(reps):
                for n in sizes:
                    add = await _push(cp, session, generated[n], pid, timeout)
                    inproc = inprocess_apply(cp) if rep == 0 or reps <= 3 else {}
                    remove = await _push(cp, session, base, pid, timeout)
                    on_sample(
                        f"{n} workloads",
                        rep,
                        {
                            "apply_s": add["seconds"],
                            "apply_ztunnel_cpu_s": add["ztunnel_cpu_s"],
                            "snapshot_build_s": add["snapshot_build_s"],
                            "remove_s": remove["seconds"],
                            "remove_ztunnel_cpu_s": remove["ztunnel_cpu_s"],
                            "inprocess": inproc,
                        },
                    )
        finally:
            if z.proc is not None:
                await asyncio.to_thread(z.stop)


# -- RBAC ----------------------------------------------------------------------------------------------------------


def _policy(name: str, namespace: str, principal: str, port: int) -> Authorization:
    match = Match(principals=(StringMatch(StringMatchKind.EXACT, principal),), destination_ports=(port,))
    return Authorization(name, namespace, Scope.NAMESPACE, Action.ALLOW, rules=(((match,),),))


def rbac_state(n: int, shape: str) -> tuple[ProxyState, Connection, str]:
    """A state with ``n`` ALLOW policies; the connection is allowed only by the last one evaluated."""
    state = ProxyState()
    dst_ns = "bench-0"
    policies = []
    namespaces = NAMESPACES if shape == "spread" else 1
    for i in range(n):
        ns = f"bench-{i % namespaces}"
        policies.append(_policy(f"p-{i}", ns, f"{TRUST_DOMAIN}/ns/other/sa/sa-{i}", 8000 + i % 1000))
    # The allowing policy goes last, so the check walks every policy of the destination's namespace first.
    policies.append(_policy("allow-client", dst_ns, f"{TRUST_DOMAIN}/ns/default/sa/client", 8080))
    state.apply(StateUpdate(policies=policies))
    from ztunnel.identity.spiffe import Identity

    conn = Connection(
        ipaddress.IPv4Address("10.0.0.1"),
        40000,
        ipaddress.IPv4Address("10.0.0.2"),
        8080,
        Identity(TRUST_DOMAIN, "default", "client"),
    )
    return state, conn, dst_ns


def rbac_eval(n: int, shape: str, min_seconds: float) -> dict[str, Any]:
    """Microseconds per inbound check, the mean over >= ``min_seconds``, on the inbound path's own code:
    ``state.policies.plan`` (the cached compiled plan) + ``Plan.evaluate``. ``plan_ms`` is the first compilation of
    the plan (every rule set new); ``replan_ms`` what the first connection after a policy change pays (every change
    drops the cached plans; rule sets already compiled are reused)."""
    state, conn, ns = rbac_state(n, shape)
    candidates = state.policies.for_workload(ns, ())
    t0 = time.perf_counter()
    plan = state.policies.plan(ns, ())
    plan_ms = (time.perf_counter() - t0) * 1e3
    # After a policy change only the changed rule sets compile again (the rest are interned); the plan is regrouped.
    t0 = time.perf_counter()
    Plan(candidates)
    replan_ms = (time.perf_counter() - t0) * 1e3
    if not plan.evaluate(conn).allowed or not evaluate(candidates, conn).allowed:
        raise AssertionError("the benchmark connection should be allowed")
    calls = 0
    t0 = time.perf_counter()
    elapsed = 0.0
    batch = 1
    while elapsed < min_seconds:
        for _ in range(batch):
            state.policies.plan(ns, ()).evaluate(conn)
        calls += batch
        batch = min(batch * 2, 4096)
        elapsed = time.perf_counter() - t0
    return {
        "us_per_check": elapsed / calls * 1e6,
        "plan_ms": plan_ms,
        "replan_ms": replan_ms,
        "calls": calls,
        "policies_evaluated": len(candidates),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.controlplane rbac POLICIES SHAPE SECONDS``: one RBAC measurement as JSON on stdout.

    The orchestrator runs each RBAC sample in a fresh process, so the check is timed on a clean heap, with no
    other threads (gRPC's) and no garbage from earlier scenarios.
    """
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4 or args[0] != "rbac":
        print("usage: python -m bench.controlplane rbac POLICIES spread|one SECONDS", file=sys.stderr)
        return 2
    print(json.dumps(rbac_eval(int(args[1]), args[2], float(args[3]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""ztunnel's own inbound (upstream ``create_ztunnel_self_proxy_listener``, its test ``test_hbone_metrics_access``): a
shared-mode ztunnel given its pod name, namespace and service account serves its own workload on 15008, so a mesh
client (a captured Prometheus) scrapes its metrics over HBONE, under the policies that select ztunnel's pod."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ztunnel.config import from_env
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxyfactory import ProxyFactory
from ztunnel.testing import (
    EchoServer,
    TwoNodeMesh,
    ZtunnelProcess,
    access_fields,
    eventually,
    hbone_dial,
    hbone_request,
    running_app,
    scrape,
)

ZTUNNEL_ID = Identity("cluster.local", "istio-system", "ztunnel")


def with_ztunnel_pod(ip: str) -> Any:
    """Add ztunnel's own pod (as istiod lists it: an ambient workload on its node) and a policy that lets only the
    client's identity reach it."""

    def edit(text: str) -> str:
        workload = f"""- uid: Kubernetes//v1/Pod/istio-system/ztunnel-node
  name: ztunnel-node
  namespace: istio-system
  serviceAccount: ztunnel
  workloadIps: ["{ip}"]
  protocol: HBONE
  node: node-z
  canonicalName: ztunnel
  workloadName: ztunnel
  workloadType: daemonset
  clusterId: Kubernetes
"""
        policy = """- name: only-client-scrapes-ztunnel
  namespace: istio-system
  scope: Namespace
  action: Allow
  rules:
  - - - principals: [{Exact: cluster.local/ns/default/sa/client}]
"""
        text = text.replace("\nservices:\n", "\n" + workload + "services:\n", 1)
        return text.replace("\npolicies:\n", "\npolicies:\n" + policy, 1)

    return edit


def shared_env(m: TwoNodeMesh, ip: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "ZTUNNEL_CA_DIR": str(m.ca_dir),
        "LOCAL_XDS_PATH": str(m.config),
        "PROXY_MODE": "shared",
        "NODE_NAME": "node-z",
        "INPOD_UDS": str(tmp_path / "ztunnel.sock"),  # no istio-cni here: no pods, only ztunnel's own inbound
        "ZTUNNEL_INBOUND_ADDR": f"{ip}:15008",
        "ZTUNNEL_ADMIN_ADDR": f"{ip}:15000",
        "ZTUNNEL_STATS_ADDR": f"{ip}:15020",
        "ZTUNNEL_READINESS_ADDR": f"{ip}:15021",
        **extra,
    }


DOWNWARD_API = {"POD_NAME": "ztunnel-node", "POD_NAMESPACE": "istio-system", "SERVICE_ACCOUNT": "ztunnel"}


def test_self_proxy_only_in_shared_mode_with_the_downward_api(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    ip = m.node_a.rsplit(".", 2)[0] + ".9.1"

    def factory(env: dict[str, str]) -> ProxyFactory:
        return ProxyFactory(from_env(env, cpu_count=2), None, None, None, None)  # type: ignore[arg-type]

    assert factory(shared_env(m, ip, tmp_path, **DOWNWARD_API)).config.ztunnel_identity == ZTUNNEL_ID
    partial = {k: v for k, v in DOWNWARD_API.items() if k != "SERVICE_ACCOUNT"}
    assert factory(shared_env(m, ip, tmp_path, **partial)).self_proxy(None) is None  # type: ignore[arg-type]
    dedicated = m.env_b(**DOWNWARD_API)
    assert factory(dedicated).self_proxy(None) is None  # type: ignore[arg-type]


async def test_prometheus_in_the_mesh_scrapes_ztunnel_over_hbone_under_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Upstream's test_hbone_metrics_access: the client (node A's workload) GETs ztunnel Z's /metrics at Z's pod IP;
    node A carries it over HBONE to Z:15008, which serves it as ztunnel's workload (identity ztunnel's, inbound
    record and metrics with destination ztunnel-node), connecting to its own 15020. Another identity is refused by
    the policy on ztunnel's namespace (401)."""
    m = TwoNodeMesh(tmp_path)
    # Ztunnel's pod in the mesh's block of 127/8, at an offset no TwoNodeMesh uses (they take 1 to 4 from a multiple
    # of 5, and the 5th is the next block's 0).
    _, n, third, _ = m.node_a.split(".")
    zt_ip = f"127.{n}.{int(third) + 4}.1"
    m.config.write_text(with_ztunnel_pod(zt_ip)(m.config.read_text()))
    caplog.set_level(logging.INFO, logger="access")
    echo = await EchoServer().start(*m.server_app)
    try:
        async with (
            running_app(shared_env(m, zt_ip, tmp_path, **DOWNWARD_API)) as zt,
            running_app(m.env_a()),
        ):
            assert zt.self_proxy is not None  # type: ignore[attr-defined]
            reader, writer = await m.socks5(zt_ip, 15020)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: ztunnel\r\nConnection: close\r\n\r\n")
            body = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert body.startswith(b"HTTP/1.1 200") and b"# TYPE istio_build" in body, body[:200]

            lines = await eventually(lambda: access_fields(caplog.records, "inbound"))
            [line] = [f for f in lines if f.get("dst.workload") == "ztunnel-node"]
            assert line["src.identity"] == "spiffe://cluster.local/ns/default/sa/client"
            assert line["dst.identity"] == str(ZTUNNEL_ID)
            assert str(line["dst.addr"]) == f"{zt_ip}:15008"
            assert str(line["dst.hbone_addr"]) == f"{zt_ip}:15020"
            assert "error" not in line

            opened = [
                s.labels
                for s in await scrape(zt_ip)
                if s.name == "istio_tcp_connections_opened_total" and s.labels["reporter"] == "destination"
            ]
            assert [(o["destination_workload"], o["source_principal"]) for o in opened] == [
                ("ztunnel", "spiffe://cluster.local/ns/default/sa/client")
            ]

            ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
            other = ca.issue(Identity("cluster.local", "default", "someone-else"), timedelta(hours=1))
            conn: Any = await hbone_dial((zt_ip, 15008), other)
            status, _ = await hbone_request(conn, f"{zt_ip}:15020")
            conn.abort("test done")
            assert status == 401
    finally:
        await echo.stop()


async def test_worker_processes_serve_ztunnels_own_inbound(tmp_path: Path) -> None:
    """With the data plane in 2 worker processes, each worker listens on ztunnel's 15008 (the port shared); scrapes
    over HBONE reach the control process's 15020 whichever worker takes them."""
    m = TwoNodeMesh(tmp_path)
    _, n, third, _ = m.node_a.split(".")
    zt_ip = f"127.{n}.{int(third) + 4}.1"
    m.config.write_text(with_ztunnel_pod(zt_ip)(m.config.read_text()))
    env = shared_env(m, zt_ip, tmp_path, ZTUNNEL_WORKER_THREADS="2", **DOWNWARD_API)
    log = tmp_path / "zt.log"
    # Not ready without istio-cni (readiness waits for ZDS): wait for both workers' listeners instead.
    zt = ZtunnelProcess(env, log).start(wait_ready=False)
    try:
        listening = "ztunnel self-proxy listener (identity"
        assert await eventually(lambda: log.read_text().count(listening), 20, until=lambda c: c == 2) == 2
        async with running_app(m.env_a()):
            for _ in range(4):
                reader, writer = await m.socks5(zt_ip, 15020)
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: ztunnel\r\nConnection: close\r\n\r\n")
                body = await asyncio.wait_for(reader.read(), 10)
                writer.close()
                assert body.startswith(b"HTTP/1.1 200") and b"# TYPE istio_build" in body, body[:200]
    finally:
        assert await asyncio.to_thread(zt.stop) == 0


def _ztunnel_pod_on_node1(text: str, node_ips: dict[str, str]) -> str:
    workload = (
        '- {uid: "Kubernetes//Pod/istio-system/ztunnel-node1", name: ztunnel-node1, namespace: istio-system,\n'
        f'   serviceAccount: ztunnel, workloadIps: ["{node_ips["node1"]}"], protocol: HBONE, node: node1,\n'
        "   canonicalName: ztunnel, workloadName: ztunnel}\n"
    )
    policy = (
        "policies:\n"
        "- {name: only-client-scrapes-ztunnel, namespace: istio-system, scope: Namespace, action: Allow,\n"
        "   rules: [[[{principals: [{Exact: cluster.local/ns/default/sa/client}]}]]]}\n"
    )
    return text.replace("\nservices:", "\n" + workload + "services:", 1) + policy


async def test_hbone_metrics_access_namespaced(tmp_path: Path) -> None:
    """Upstream's ``test_hbone_metrics_access`` with real network namespaces: the captured client pod GETs node1's
    ztunnel metrics at the node's IP; istio-cni's rules send it to the pod's outbound listener, node1's ztunnel
    carries it over HBONE to its own pod IP on 15008 (ztunnel's own inbound, in the node namespace), which connects
    to its own 15020. A captured pod of another identity (server-a) is denied by the policy on ztunnel's namespace."""
    from tests.inpod.cluster import running_cluster
    from ztunnel.testing import netns as tn

    tn.require(iptables=True)
    with tn.Topology() as topo:
        node_env = {"node1": {**DOWNWARD_API, "POD_NAME": "ztunnel-node1"}}
        async with running_cluster(topo, tmp_path, dns=False, node_env=node_env, mesh_edit=_ztunnel_pod_on_node1) as c:
            zt = str(c.nodes["node1"].ip)
            request = b"GET /metrics HTTP/1.1\r\nHost: ztunnel\r\nConnection: close\r\n\r\n"

            def scrape_from_client() -> bytes:
                # No half-close after the request (HTTP/1.1 clients wait for the answer with the socket open).
                with socket.create_connection((zt, 15020), timeout=10) as s:
                    s.sendall(request)
                    out = b""
                    while chunk := s.recv(65536):
                        out += chunk
                    return out

            reply = await asyncio.to_thread(c.pods["client"].run, scrape_from_client)
            denied = await asyncio.to_thread(c.pods["server-a"].run, scrape_from_client)
            assert denied == b""
            assert reply.startswith(b"HTTP/1.1 200") and b"# TYPE istio_build" in reply, reply[:300]
            records = await eventually(
                lambda: [
                    r
                    for r in c.access("node1")
                    if r.get("dst.workload") == "ztunnel-node1"
                    and r["direction"] == "inbound"
                    and r.get("src.workload") == "client"
                ]
            )
            [record] = records
            assert record["src.workload"] == "client"
            assert record["src.identity"] == "spiffe://cluster.local/ns/default/sa/client"
            assert record["dst.addr"] == f"{zt}:15008" and record["dst.hbone_addr"] == f"{zt}:15020"
            assert "error" not in record
            refused = await eventually(  # access lines go out through the log writer thread: not at once
                lambda: [
                    r
                    for r in c.access("node1")
                    if r["direction"] == "inbound"
                    and r.get("src.identity") == "spiffe://cluster.local/ns/default/sa/server"
                ]
            )
            assert len(refused) == 1 and "policy rejection" in refused[0]["error"], refused
            outbound = await eventually(  # the second connection's outbound line may follow its peer's lines
                lambda: [r for r in c.access("node1") if r["direction"] == "outbound"], until=lambda rs: len(rs) >= 2
            )
            assert [r["dst.hbone_addr"] for r in outbound] == [f"{zt}:15020"] * 2


async def test_inline_drain_stops_the_pods_and_ztunnels_own_inbound_together(tmp_path: Path) -> None:
    """One process (ZTUNNEL_INLINE_DATA_PLANE), in-pod with ztunnel's own inbound: on SIGTERM the pods' proxies stop
    accepting at once, while a connection held open on ztunnel's own inbound still has its deadline. They
    drained one after the other: the pods kept accepting until the own inbound's deadline had passed, then got a
    deadline of their own."""
    from tests.inpod.cluster import running_cluster
    from ztunnel.testing import netns as tn

    tn.require(iptables=True)
    with tn.Topology() as topo:
        # A long deadline, so the held connection outlasts the probes on a loaded machine; a SIGINT ends it.
        inline = {"ZTUNNEL_INLINE_DATA_PLANE": "true", "CONNECTION_TERMINATION_DEADLINE": "60s"}
        node_env = {"node1": {**DOWNWARD_API, "POD_NAME": "ztunnel-node1", **inline}}
        async with running_cluster(topo, tmp_path, dns=False, node_env=node_env, mesh_edit=_ztunnel_pod_on_node1) as c:
            zt = str(c.nodes["node1"].ip)
            server_a = str(c.pods["server-a"].ip)

            def hold_a_scrape_connection() -> socket.socket:
                # A keep-alive request answered in full: the tunnel to ztunnel's own inbound is up, and stays.
                s = socket.create_connection((zt, 15020), timeout=10)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: ztunnel\r\n\r\n")
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = s.recv(65536)
                    assert chunk, head
                    head += chunk
                headers, _, body = head.partition(b"\r\n\r\n")
                assert headers.startswith(b"HTTP/1.1 200"), headers
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in headers.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                while len(body) < length:
                    chunk = s.recv(65536)
                    assert chunk, len(body)
                    body += chunk
                return s

            def connect_refused() -> bool:
                try:
                    socket.create_connection((server_a, 8080), timeout=2).close()
                    return False
                except ConnectionRefusedError:
                    return True

            held = await asyncio.to_thread(c.pods["client"].run, hold_a_scrape_connection)
            try:
                assert not await asyncio.to_thread(c.pods["client"].run, connect_refused)  # the client's proxy serves
                c.ztunnels["node1"].send_signal(signal.SIGTERM)
                while not await asyncio.to_thread(c.pods["client"].run, connect_refused):
                    await asyncio.sleep(0.02)
                # The client pod's proxy refuses new connections; the one on ztunnel's own inbound is still open.
                held.setblocking(False)
                with pytest.raises(BlockingIOError):
                    held.recv(1)
                c.ztunnels["node1"].send_signal(signal.SIGINT)  # ends the drain at once
                held.setblocking(True)
                held.settimeout(10)
                with contextlib.suppress(ConnectionResetError):  # then closed (EOF or reset)
                    assert held.recv(1) == b""
            finally:
                held.close()
            assert await asyncio.to_thread(c.ztunnels["node1"].wait, 15) == 0

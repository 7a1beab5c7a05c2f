"""The namespaced topology (``--topology netns``, root only): pods in network namespaces, real iptables capture,
in-pod ztunnels, as a node of a cluster runs them.

Built from :mod:`ztunnel.testing.netns` (nodes on a bridge, pods on veths) and the node agent
(:mod:`ztunnel.standins.cni`: istio-cni's in-pod rules and ZDS)::

    node1:  pod "client"  (enrolled: its traffic is captured)       pod "outside"  (not enrolled)
            ztunnel A (in-pod mode, one proxy per enrolled pod of node1)
    node2:  pod "server"  (enrolled)                                pod "plain"    (not enrolled, not in the mesh)
            ztunnel B

    direct  outside --------------------------------------------------------------> plain
    tcp     client --(captured)--> ztunnel A --plain TCP (not in the mesh)---------> plain
    hbone   client --(captured)--> ztunnel A ==HBONE==> ztunnel B --(in the pod)--> server

Every path crosses the same links (pod veth -> node1 -> bridge -> node2 -> pod veth). No SOCKS5: clients connect
to the server's pod IP and iptables hands the connection to ztunnel, as in a cluster. Clients run inside their
pods (``ip netns exec``), servers inside theirs. The Envoy pair is not part of this topology (it would need the
pods' traffic redirected to it); compare with Envoy on the loopback topology.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.topology import APP_PORT, LogIssue, stop_servers, stop_ztunnels
from ztunnel.identity.ca import LocalCA
from ztunnel.testing import TwoNodeMesh

TRUST_DOMAIN = "cluster.local"
MODES = ("direct", "tcp", "hbone")

MESH = """
workloads:
- {{uid: "Kubernetes//Pod/default/client", name: client, namespace: default, serviceAccount: client,
   workloadIps: ["{client}"], protocol: HBONE, node: node1, canonicalName: client, workloadName: client}}
- {{uid: "Kubernetes//Pod/default/server", name: server, namespace: default, serviceAccount: server,
   workloadIps: ["{server}"], protocol: HBONE, node: node2, canonicalName: echo, workloadName: server}}
- {{uid: "Kubernetes//Pod/default/plain", name: plain, namespace: default, serviceAccount: plain,
   workloadIps: ["{plain}"], protocol: TCP, node: node2}}
policies:
- name: allow-client
  namespace: default
  scope: Namespace
  action: Allow
  rules: [[[{{principals: [{{Exact: cluster.local/ns/default/sa/client}}]}}]]]
"""


def skip_reason() -> str | None:
    """Why the namespaced topology cannot run here, or None."""
    from ztunnel.testing import netns

    return netns.skip_reason(iptables=True)


class NamespacedTopology:
    name = "netns"
    clients: tuple[str, ...] = ("client", "outside")

    def __init__(self, workdir: Path, modes: tuple[str, ...], ztunnel_env: dict[str, str] | None, reps: int) -> None:
        from ztunnel.standins.cni.server import PodInfo, ZdsServer
        from ztunnel.testing import netns

        self.workdir = workdir
        self.modes = tuple(m for m in modes if m in MODES)
        self.ztunnel_env = dict(ztunnel_env or {})
        self.reps = max(1, reps)
        self.rep = 0
        self.topo = netns.Topology()
        try:
            self.pods = {
                "client": self.topo.pod("node1", "client"),
                "outside": self.topo.pod("node1", "outside"),
                "server": self.topo.pod("node2", "server"),
                "plain": self.topo.pod("node2", "plain"),
            }
            self.nodes = {"ztunnel-a": self.topo.nodes["node1"], "ztunnel-b": self.topo.nodes["node2"]}
            self.config = workdir / "mesh.yaml"
            self.config.write_text(
                MESH.format(client=self.pods["client"].ip, server=self.pods["server"].ip, plain=self.pods["plain"].ip)
            )
            self.ca_dir = workdir / "ca"
            LocalCA.load_or_create(self.ca_dir, TRUST_DOMAIN)
            self.loop = self.topo.loop_thread(self.topo.root, "node agents")
            self.agents: dict[str, Any] = {}
            enrolled = {"ztunnel-a": "client", "ztunnel-b": "server"}
            for node, pod in enrolled.items():
                sa = "client" if pod == "client" else "server"
                info = PodInfo(f"Kubernetes//Pod/default/{pod}", "default", pod, sa, str(self.pods[pod].path))
                agent = ZdsServer(str(workdir / f"{node}.sock"), [info], apply_rules=True)
                self.loop.call(agent.start())
                self.agents[node] = agent
            self._snapshots = dict.fromkeys(self.agents, 0)
        except BaseException:
            self.topo.close()
            raise
        self.servers: list[subprocess.Popen[bytes]] = []
        self.ztunnels: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        # The control-plane scenario runs on loopback: a mesh block of its own for node C.
        self._cp_mesh = TwoNodeMesh(_mkdir(workdir / "controlplane-mesh"))

    # -- processes -------------------------------------------------------------------------------------------------

    def server_port(self, rep: int | None = None) -> int:
        return APP_PORT + (self.rep if rep is None else rep)

    def start_server(self) -> None:
        for pod in ("server", "plain"):
            args = [sys.executable, "-m", "bench.server"]
            for r in range(self.reps):
                args += ["--listen", f"0.0.0.0:{self.server_port(r)}"]
            with open(self.workdir / f"server-{pod}.log", "wb") as log:
                proc = self.pods[pod].popen(args, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
            self.servers.append(proc)
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"bench server in pod {pod} did not start; see {self.workdir}/server-{pod}.log")

    def client_prefix(self, name: str) -> list[str]:
        return self.pods[name].command([])

    def start_proxies(self, logdir: Path, rep: int = 0, env: Mapping[str, str] | None = None) -> None:
        self.rep = rep
        extra = dict(env or {})
        logdir.mkdir(parents=True, exist_ok=True)
        if "tcp" not in self.modes and "hbone" not in self.modes:
            return
        for name, node in self.nodes.items():
            env = {
                "PATH": os.environ.get("PATH", ""),
                "XDS_ADDRESS": "",
                "FAKE_CA": "true",
                "ZTUNNEL_CA_DIR": str(self.ca_dir),
                "LOCAL_XDS_PATH": str(self.config),
                "NODE_NAME": "node1" if name == "ztunnel-a" else "node2",
                "INPOD_UDS": str(self.workdir / f"{name}.sock"),
                "ISTIO_META_DNS_CAPTURE": "false",
                "RUST_LOG": "warn",
                **self.ztunnel_env,
                **extra,
            }
            self.logs[name] = logdir / f"{name}.log"
            with open(self.logs[name], "wb") as log:
                self.ztunnels[name] = node.popen(
                    [sys.executable, "-m", "ztunnel", "proxy", "ztunnel"], env=env, stdout=log, stderr=log
                )
        # Ready once each node agent has sent its snapshot to (and been acknowledged by) the new ztunnel.
        for name, agent in self.agents.items():
            self._snapshots[name] += 1
            self.loop.call(agent.wait_snapshot(self._snapshots[name], timeout=30), timeout=40)

    def stop_proxies(self) -> list[LogIssue]:
        issues = stop_ztunnels(self.ztunnels, self.logs)
        self.ztunnels = {}
        return issues

    def proxy_pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.ztunnels.items()}

    def pids(self) -> dict[str, int]:
        out = self.proxy_pids()
        for i, s in enumerate(self.servers):
            out[f"server-{i}"] = s.pid
        return out

    def envoy_stats(self) -> dict[str, int]:
        return {}

    def route(self, mode: str) -> dict[str, Any]:
        port = self.server_port()
        if mode == "direct":
            return {"addr": [self.pods["plain"].ip, port], "socks": None, "client": "outside"}
        if mode == "tcp":
            return {"addr": [self.pods["plain"].ip, port], "socks": None, "client": "client"}
        if mode == "hbone":
            return {"addr": [self.pods["server"].ip, port], "socks": None, "client": "client"}
        raise ValueError(f"mode {mode!r} is not part of the namespaced topology")

    def controlplane_target(self) -> tuple[Path, str]:
        octets = self._cp_mesh.node_a.split(".")
        return self._cp_mesh.config, f"127.{octets[1]}.{int(octets[2]) + 4}.1"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pods": {name: {"ip": p.ip, "node": p.node.node} for name, p in self.pods.items()},
            "enrolled": ["client", "server"],
            "server": f"0.0.0.0, port {APP_PORT} + repetition index, in pods server and plain",
            "ztunnel_env": {"RUST_LOG": "warn", **self.ztunnel_env},
        }

    def close(self) -> list[LogIssue]:
        issues = self.stop_proxies()
        stop_servers(self.servers)
        self.servers = []
        for agent in self.agents.values():
            self.loop.call(agent.stop())
        self.topo.close()
        return issues


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path

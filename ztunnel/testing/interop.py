"""Upstream Rust ztunnel and this project's ztunnel as peers on two nodes (``make interop-upstream``).

The topology is :class:`ztunnel.testing.netns.Topology`'s (nodes on a bridge, pods on veths). One control plane, this
project's (``python -m ztunnel.standins.istiod serve``, real gRPC over TLS), plays istiod for both ztunnels: it serves
the mesh below over delta xDS and signs every certificate, so each ztunnel trusts the other's. It runs in the topology's
root namespace on the bridge address, and each ztunnel authenticates with a bearer token read from a file::

    root netns   control plane 172.172.0.1:15012 (xDS + CA)          [in-pod: node agents, ZDS over unix sockets]
    node1        ztunnel A (ours or upstream)   172.172.0.2
    node2        ztunnel B (ours or upstream)   172.172.0.3

Two modes:

``dedicated``
    Each ztunnel serves its own node as one workload (``PROXY_MODE=dedicated``, ``PROXY_WORKLOAD_INFO``): workload
    "client" is node1's address, "server" node2's. ``ENABLE_ORIG_SRC=false``, upstream's own dedicated-mode setting:
    the server side connects to the app from its own address. The client connects through the ztunnel's SOCKS5
    listener (127.0.0.1:15080 in node1), the apps listen in node2. Upstream binds its ports on the wildcard address,
    hence one ztunnel per namespace.
``inpod``
    istio-cni's way (``PROXY_MODE=shared``): this project's node agent (:class:`ztunnel.standins.cni.server.ZdsServer`)
    applies istio-cni's in-pod iptables rules in pods "client" (node1) and "server" (node2) and hands their
    namespaces to the node's ztunnel over ZDS; the ztunnels ask the CA for the pods' certificates with
    ``ImpersonatedIdentity`` under the node identity's token (``istio-system/ztunnel``: the CA refuses that caller
    any certificate but an impersonated one, so a working mTLS connection shows impersonation worked). Unmodified
    clients in the client pod are captured; the server side spoofs the client's address towards the app.

Every process gets SIGKILL when the thread that started it (call from the main one) exits, so a killed test run
leaves no proxy behind; :meth:`InteropMesh.close` stops them all and deletes the namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

from ztunnel.standins.cni.server import PodInfo, ZdsServer
from ztunnel.testing import EchoServer, Sample, ZtunnelProcess, scrape_now, socks5_connect, with_parent_death_signal
from ztunnel.testing import netns as tn

__all__ = [
    "APP_PORT",
    "DENIED_PORT",
    "UPSTREAM_BIN_ENV",
    "VIP",
    "Impl",
    "InteropMesh",
    "Mode",
    "require_upstream",
    "upstream_problem",
]

UPSTREAM_BIN_ENV = "ZTUNNEL_UPSTREAM_BIN"
# "require" turns a skip of the tier into a failure (`make interop-upstream` sets it, as ZTUNNEL_NETNS_TESTS).
REQUIRE_ENV = "ZTUNNEL_UPSTREAM_TESTS"
TRUST_DOMAIN = "cluster.local"
CONTROL_PLANE_PORT = 15012
APP_PORT = 8080
DENIED_PORT = 9999  # the mesh's policy denies every connection to this port
VIP = ("10.96.0.10", 80)
SOCKS5 = ("127.0.0.1", 15080)
CLIENT_ID = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/client"
SERVER_ID = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/server"
NODE_ID = f"spiffe://{TRUST_DOMAIN}/ns/istio-system/sa/ztunnel"

MESH = """\
workloads:
- uid: Kubernetes//Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  workloadIps: ["{client}"]
  protocol: HBONE
  node: node1
  canonicalName: client
  canonicalRevision: v1
  workloadName: client
  workloadType: deployment
  clusterId: Kubernetes
- uid: Kubernetes//Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  workloadIps: ["{server}"]
  protocol: HBONE
  node: node2
  canonicalName: echo
  canonicalRevision: v1
  workloadName: server
  workloadType: deployment
  clusterId: Kubernetes
  services:
    "default/echo.default.svc.cluster.local":
      80: {app_port}
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/{vip}"]
  ports:
    80: {app_port}
  subjectAltNames: ["{server_id}"]
policies:
# Upstream's YAML spells a string match as a tag; both implementations must read it (only the client may connect).
- name: allow-client
  namespace: default
  scope: Namespace
  action: Allow
  rules:
  - - - principals: [!Exact {trust_domain}/ns/default/sa/client]
- name: deny-{denied}
  namespace: default
  scope: Namespace
  action: Deny
  rules:
  - - - destinationPorts: [{denied}]
"""


class Impl(enum.StrEnum):
    """Which ztunnel runs on a node."""

    OURS = "ours"
    UPSTREAM = "upstream"


class Mode(enum.StrEnum):
    DEDICATED = "dedicated"
    INPOD = "inpod"


def upstream_problem() -> str | None:
    """Why upstream's binary cannot be used (unset, missing, not executable), or None."""
    path = os.environ.get(UPSTREAM_BIN_ENV, "")
    if not path:
        return f"{UPSTREAM_BIN_ENV} is not set (the path of an upstream Rust ztunnel binary; see docs/testing.md)"
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return f"{UPSTREAM_BIN_ENV}={path} is not executable"
    return None


def require_upstream() -> str:
    """Upstream's binary, after checking that namespaced tests can run here; ``pytest.skip`` with the reason
    otherwise (a failure with ``ZTUNNEL_UPSTREAM_TESTS=require``)."""
    import pytest

    reason = upstream_problem() or tn.skip_reason(iptables=True)
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "require":
            pytest.fail(f"{REQUIRE_ENV}=require, but {reason}")
        pytest.skip(reason)
    return os.environ[UPSTREAM_BIN_ENV]


class InteropMesh:
    """Topology, control plane, apps (and node agents in ``inpod``) for one mode; ztunnels come and go with
    :meth:`start` / :meth:`stop`. Use as a context manager."""

    def __init__(self, mode: Mode, workdir: Path, upstream_bin: str) -> None:
        self.mode = mode
        self.workdir = workdir
        self.upstream_bin = upstream_bin
        self.ztunnels: dict[str, ZtunnelProcess] = {}
        self.logs: dict[str, Path] = {}
        self.agents: dict[str, ZdsServer] = {}
        self._snapshots: dict[str, int] = {}
        self._cp: subprocess.Popen[bytes] | None = None
        self._cp_log: IO[bytes] | None = None
        self._runs = 0
        self.topo = tn.Topology()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- set-up ------------------------------------------------------------------------------------------------------

    def _build(self) -> None:
        self.nodes = {"node1": self.topo.node("node1"), "node2": self.topo.node("node2")}
        if self.mode is Mode.INPOD:
            self.client_ns: tn.Netns = self.topo.pod("node1", "client")
            self.server_ns: tn.Netns = self.topo.pod("node2", "server")
        else:
            self.client_ns, self.server_ns = self.nodes["node1"], self.nodes["node2"]
        self.client_ip = self.topo.pods["client"].ip if self.mode is Mode.INPOD else self.nodes["node1"].ip
        self.server_ip = self.topo.pods["server"].ip if self.mode is Mode.INPOD else self.nodes["node2"].ip
        self.mesh = self.workdir / "mesh.yaml"
        self.mesh.write_text(
            MESH.format(
                client=self.client_ip,
                server=self.server_ip,
                vip=VIP[0],
                app_port=APP_PORT,
                denied=DENIED_PORT,
                server_id=SERVER_ID,
                trust_domain=TRUST_DOMAIN,
            )
        )
        # Apps in the server's namespace: the echo service's port, and the port the policy denies (an app listens
        # there too, so a refused connection is the policy's doing and the app must never see it).
        self.apps = self.topo.loop_thread(self.server_ns, "apps")
        self.app = self.apps.call(EchoServer(greet=True).start("0.0.0.0", APP_PORT))
        self.denied_app = self.apps.call(EchoServer(greet=True).start("0.0.0.0", DENIED_PORT))
        self.clients = self.topo.loop_thread(self.client_ns, "clients")
        self._start_control_plane()
        if self.mode is Mode.INPOD:
            self.agent_loop = self.topo.loop_thread(self.topo.root, "node agents")
            for node, pod, sa in (("node1", "client", "client"), ("node2", "server", "server")):
                info = PodInfo(f"Kubernetes//Pod/default/{pod}", "default", pod, sa, str(self.topo.pods[pod].path))
                agent = ZdsServer(self.workdir / f"{node}.sock", [info], apply_rules=True)
                self.agents[node] = self.agent_loop.call(agent.start())
                self._snapshots[node] = 0

    def _start_control_plane(self) -> None:
        """``python -m ztunnel.standins.istiod serve`` on the bridge address, with one token per caller. Token files
        have no trailing newline: upstream sends the file's bytes verbatim in ``authorization``."""
        self.ca_dir = self.workdir / "cp-ca"
        tokens = {"node1": "token-client", "node2": "token-server", "node": "token-node"}
        self.token_files: dict[str, Path] = {}
        for name, token in tokens.items():
            path = self.workdir / f"{name}.token"
            path.write_text(token)
            self.token_files[name] = path
        argv = [
            sys.executable,
            "-m",
            "ztunnel.standins.istiod",
            "serve",
            "--config",
            str(self.mesh),
            "--ca-dir",
            str(self.ca_dir),
            "--listen",
            f"{tn.BRIDGE_IP}:{CONTROL_PLANE_PORT}",
            "--token",
            f"{tokens['node1']}={CLIENT_ID}",
            "--token",
            f"{tokens['node2']}={SERVER_ID}",
            "--token",
            f"{tokens['node']}={NODE_ID}",
        ]
        self.logs["control-plane"] = self.workdir / "control-plane.log"
        self._cp_log = open(self.logs["control-plane"], "wb")  # noqa: SIM115 - closed in close()
        self._cp = self.topo.root.popen(
            with_parent_death_signal(argv),
            stdout=subprocess.PIPE,
            stderr=self._cp_log,
            stdin=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", "")},
        )
        assert self._cp.stdout is not None
        line = self._cp.stdout.readline()  # printed once it serves
        if not line.startswith(b"serving on"):
            raise RuntimeError(f"control plane did not start: {self.log_text('control-plane')}")
        self.cp_url = f"https://{tn.BRIDGE_IP}:{CONTROL_PLANE_PORT}"

    # -- ztunnels ----------------------------------------------------------------------------------------------------

    def env(self, node: str) -> dict[str, str]:
        """The environment of ``node``'s ztunnel; the same for both implementations (same variable names)."""
        root = str(self.ca_dir / "root-cert.pem")
        env = {
            "XDS_ADDRESS": self.cp_url,
            "CA_ADDRESS": self.cp_url,
            "XDS_ROOT_CA": root,
            "CA_ROOT_CA": root,
            "FAKE_CA": "false",
            "CLUSTER_ID": "Kubernetes",
            "NODE_NAME": node,
            "ISTIO_META_DNS_CAPTURE": "false",
            "RUST_LOG": "info",
        }
        if self.mode is Mode.DEDICATED:
            workload = "default/client/client" if node == "node1" else "default/server/server"
            env |= {
                "AUTH_TOKEN": str(self.token_files[node]),
                "PROXY_MODE": "dedicated",
                "PROXY_WORKLOAD_INFO": workload,
                "ENABLE_ORIG_SRC": "false",
                "UNSTABLE_ENABLE_SOCKS5": "true",
            }
        else:
            env |= {
                "AUTH_TOKEN": str(self.token_files["node"]),
                "PROXY_MODE": "shared",
                "INPOD_UDS": str(self.workdir / f"{node}.sock"),
            }
        return env

    def start(self, node1: Impl, node2: Impl) -> None:
        """Start fresh ztunnels (so every metric counts this run only) and wait until each is ready (and, in-pod,
        has acknowledged its node agent's snapshot). Call from the main thread (see the module docstring)."""
        self.stop()
        self._runs += 1
        for node, impl in (("node1", node1), ("node2", node2)):
            argv = [self.upstream_bin if impl is Impl.UPSTREAM else sys.executable]
            if impl is Impl.OURS:
                argv += ["-m", "ztunnel"]
            argv += ["proxy", "ztunnel"]
            self.logs[node] = self.workdir / f"run{self._runs}-{node}-{impl}.log"
            self.ztunnels[node] = ZtunnelProcess(
                self.env(node), self.logs[node], argv=argv, netns=self.nodes[node], kill_with_parent=True
            ).start(timeout=30)
        for node, agent in self.agents.items():
            self._snapshots[node] += 1
            self.agent_loop.call(agent.wait_snapshot(self._snapshots[node], timeout=20), timeout=30)

    def stop(self) -> dict[str, int]:
        """Stop the ztunnels (SIGTERM, then SIGKILL after 15 s); their exit codes."""
        codes = {node: z.stop() for node, z in self.ztunnels.items()}
        self.ztunnels.clear()
        return codes

    def log_text(self, name: str, tail: int = 300) -> str:
        """The last ``tail`` lines of a process log (``node1``, ``node2`` or ``control-plane``)."""
        path = self.logs.get(name)
        if path is None or not path.exists():
            return "(no log)"
        lines = path.read_text(errors="replace").splitlines()
        cut = f"... {len(lines) - tail} earlier lines in {path}\n" if len(lines) > tail else ""
        return cut + "\n".join(lines[-tail:])

    # -- traffic and metrics -----------------------------------------------------------------------------------------

    def exchange(self, host: str, port: int, payload: bytes, timeout: float = 30.0) -> tuple[str, bytes]:
        """A client in the client's namespace connects to ``host:port`` (captured in-pod, through SOCKS5 in dedicated
        mode), reads the app's ``peer=`` line, sends ``payload``, half-closes and reads the echo to EOF. Returns
        (the peer address the app saw, the echoed bytes); raises what the connection raised."""
        socks = self.mode is Mode.DEDICATED
        return self.clients.call(asyncio.wait_for(_exchange(host, port, payload, socks), timeout), timeout + 5)

    def attempt(self, host: str, port: int, timeout: float = 15.0) -> str:
        """Connect as :meth:`exchange` and report how it ended: ``"connected"`` once the app's greeting arrives,
        else the failure (``"closed"``: accepted then closed without a byte, ``"reset"``, or the SOCKS5 reply)."""
        socks = self.mode is Mode.DEDICATED
        return self.clients.call(asyncio.wait_for(_attempt(host, port, socks), timeout), timeout + 5)

    def scrape(self, node: str) -> list[Sample]:
        """The ``istio_tcp_*`` samples of ``node``'s ztunnel (``:15020/metrics``, scraped inside the node)."""
        return [s for s in self.nodes[node].run(scrape_now, self.nodes[node].ip) if s.name.startswith("istio_tcp_")]

    # -- teardown ----------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop everything started and delete the namespaces (idempotent)."""
        with contextlib.suppress(Exception):
            self.stop()
        for agent in self.agents.values():
            with contextlib.suppress(Exception):
                self.agent_loop.call(agent.stop())
        self.agents.clear()
        if self._cp is not None:
            cp, self._cp = self._cp, None
            cp.send_signal(signal.SIGTERM)
            try:
                cp.wait(10)
            except subprocess.TimeoutExpired:
                cp.kill()
                cp.wait()
            if cp.stdout is not None:
                cp.stdout.close()
        if self._cp_log is not None:
            self._cp_log.close()
            self._cp_log = None
        for app in ("app", "denied_app"):
            server = getattr(self, app, None)
            if server is not None:
                with contextlib.suppress(Exception):
                    self.apps.call(server.stop())
        self.topo.close()

    def __enter__(self) -> InteropMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _open(host: str, port: int, socks: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if socks:
        return await socks5_connect(SOCKS5, host, port)
    return await asyncio.open_connection(host, port)


async def _exchange(host: str, port: int, payload: bytes, socks: bool) -> tuple[str, bytes]:
    reader, writer = await _open(host, port, socks)
    try:
        greeting = (await reader.readuntil(b"\n")).decode().strip()
        writer.write(payload)  # buffered by the transport: the echo is read while it goes out
        writer.write_eof()
        echoed = await reader.read()
        return greeting.removeprefix("peer="), echoed
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _attempt(host: str, port: int, socks: bool) -> str:
    try:
        reader, writer = await _open(host, port, socks)
    except ConnectionError as e:
        return f"refused: {e}"
    try:
        line = await reader.readuntil(b"\n")
        return "connected" if line.startswith(b"peer=") else f"got {line!r}"
    except asyncio.IncompleteReadError as e:
        return "closed" if not e.partial else f"closed after {e.partial!r}"
    except ConnectionResetError:
        return "reset"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

"""``ENABLE_ORIG_SRC``: upstream's tri-state for source-IP spoofing toward the app (``proxy.rs maybe_set_transparent``).

``false`` never sets IP_TRANSPARENT on the 15001/15006/15008 listeners, so the inbound connects to the app from its
own address; ``true`` fails at startup when a transparent socket cannot be made; unset is best effort.

Three tiers: the listeners of an in-process ztunnel (getsockopt on the bound sockets), the CLI without
CAP_NET_ADMIN/CAP_NET_RAW (``setpriv`` drops them from a root test run; a non-root run lacks them anyway), and two
dedicated-mode ztunnel processes on two nodes (network namespaces on a bridge, root only), where spoofing cannot
work: the app's SYN-ACK to the client's address leaves for the client's node.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ztunnel.identity.ca import LocalCA
from ztunnel.sockets import IP_TRANSPARENT, SOL_IP
from ztunnel.testing import EchoServer, TwoNodeMesh, ZtunnelProcess, running_app, socks5_connect
from ztunnel.testing import netns as tn


def can_be_transparent() -> bool:
    """Whether this process may set IP_TRANSPARENT (CAP_NET_ADMIN or CAP_NET_RAW)."""
    with socket.socket() as s:
        try:
            s.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
        except PermissionError:
            return False
    return True


def transparent_flags(app: Any) -> dict[str, list[int]]:
    """IP_TRANSPARENT as the kernel reports it on every bound socket of the three capture listeners."""
    proxy = app.proxy
    listeners = {"15001": proxy.outbound, "15006": proxy.inbound_passthrough, "15008": proxy.inbound}
    return {
        port: [s.getsockopt(SOL_IP, IP_TRANSPARENT) for server in lst.servers for s in server.sockets]
        for port, lst in listeners.items()
    }


@pytest.mark.parametrize(("value", "expect"), [("false", 0), (None, None), ("true", 1)])
async def test_listeners_follow_enable_orig_src(tmp_path: Path, value: str | None, expect: int | None) -> None:
    if expect is None:  # unset: best effort, so transparent exactly when this process may make it so
        expect = 1 if can_be_transparent() else 0
    if expect == 1 and not can_be_transparent():
        pytest.skip("IP_TRANSPARENT needs CAP_NET_ADMIN or CAP_NET_RAW (run as root)")
    m = TwoNodeMesh(tmp_path)
    env = m.env_a() if value is None else m.env_a(ENABLE_ORIG_SRC=value)
    async with running_app(env) as app:
        got = transparent_flags(app)
        listeners: Any = app
        flags = [listeners.proxy.inbound.transparent, listeners.proxy.inbound_passthrough.transparent]
    assert got == {"15001": [expect], "15006": [expect], "15008": [expect]}
    assert flags == [bool(expect)] * 2  # what decides whether the inbound paths spoof the client's address


def without_transparency() -> list[str]:
    """A command prefix that runs a child without the capabilities IP_TRANSPARENT needs (skips if impossible)."""
    if not can_be_transparent():
        return []  # not root: the child lacks them already
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_NET_ADMIN/CAP_NET_RAW from a root test run")
    # Dropped from the bounding set, the capabilities are gone from the root child after exec.
    return [setpriv, "--bounding-set=-net_admin,-net_raw"]


def run_cli(prefix: list[str], env: dict[str, str], timeout: float = 20) -> tuple[int | None, str]:
    """Start ``ztunnel proxy``; its exit status and stderr, or None if it was still running (ready) at ``timeout``."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "ztunnel", "proxy"],
        env={"PATH": os.environ.get("PATH", ""), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        proc.terminate()
        _, err = proc.communicate()
        return None, err


def test_orig_src_true_fails_at_startup_without_the_capability(tmp_path: Path) -> None:
    prefix = without_transparency()
    m = TwoNodeMesh(tmp_path)
    code, err = run_cli(prefix, m.env_a(ENABLE_ORIG_SRC="true"))
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    (line,) = lines
    assert line.startswith("error: ENABLE_ORIG_SRC=true")
    assert f"{m.node_a}:15008" in line  # the listener that could not be made transparent (the first bound)
    assert "Operation not permitted" in line and "CAP_NET_ADMIN" in line


def test_orig_src_unset_and_false_start_without_the_capability(tmp_path: Path) -> None:
    prefix = without_transparency()
    m = TwoNodeMesh(tmp_path)
    for value in (None, "false"):
        env = m.env_a() if value is None else m.env_a(ENABLE_ORIG_SRC=value)
        proc = ZtunnelProcess(env, tmp_path / f"{value}.log", prefix=prefix).start()
        assert proc.stop() == 0, (tmp_path / f"{value}.log").read_text()


# -- two dedicated ztunnels on two nodes ----------------------------------------------------------------------------

MESH = """
workloads:
- {{uid: "Kubernetes//Pod/default/client", name: client, namespace: default, serviceAccount: client,
   workloadIps: ["{client}"], protocol: HBONE, node: node1, services: {{}}}}
- {{uid: "Kubernetes//Pod/default/server", name: server, namespace: default, serviceAccount: server,
   workloadIps: ["{server}"], protocol: HBONE, node: node2, services: {{}}}}
"""
APP_PORT = 8080


@pytest.fixture
def topology() -> Iterator[tn.Topology]:
    with tn.topology() as topo:
        yield topo


@pytest.fixture
async def dedicated_nodes(topology: tn.Topology, tmp_path: Path) -> AsyncIterator[tuple[tn.Node, tn.Node, Path]]:
    """node1 runs ztunnel A for "client" (node1's address), node2 ztunnel B for "server" (node2's), each dedicated
    with ENABLE_ORIG_SRC=false and upstream's wildcard listeners in its own namespace; the app listens on node2."""
    a, b = topology.node("node1"), topology.node("node2")
    config = tmp_path / "mesh.yaml"
    config.write_text(MESH.format(client=a.ip, server=b.ip))
    LocalCA.load_or_create(tmp_path / "ca", "cluster.local")  # once, before two processes would race to create it
    app = await EchoServer(greet=True).start(sock=b.listen_tcp("0.0.0.0", APP_PORT))  # says which peer it sees
    procs: list[ZtunnelProcess] = []
    try:
        for node, workload in ((b, "default/server/server"), (a, "default/client/client")):
            env = {
                "XDS_ADDRESS": "",
                "FAKE_CA": "true",
                "ZTUNNEL_CA_DIR": str(tmp_path / "ca"),
                "LOCAL_XDS_PATH": str(config),
                "PROXY_MODE": "dedicated",
                "PROXY_WORKLOAD_INFO": workload,
                "NODE_NAME": node.node,
                "UNSTABLE_ENABLE_SOCKS5": "true",
                "ISTIO_META_DNS_CAPTURE": "false",
                "ENABLE_ORIG_SRC": "false",
            }
            procs.append(ZtunnelProcess(env, tmp_path / f"{node.node}.log", netns=node).start())
        yield a, b, tmp_path
    finally:
        codes = [p.stop() for p in procs]
        await app.stop()
    assert codes == [0] * len(procs), f"exit codes {codes}; logs in {tmp_path}"


async def test_cross_node_without_orig_src_reaches_the_app_from_the_node(
    topology: tn.Topology, dedicated_nodes: tuple[tn.Node, tn.Node, Path]
) -> None:
    a, b, logs = dedicated_nodes
    payload = b"across two dedicated ztunnels"

    async def client() -> tuple[bytes, bytes]:
        # On node1: the client workload's SOCKS5 listener (127.0.0.1:15080 in node1's namespace).
        reader, writer = await socks5_connect(("127.0.0.1", 15080), b.ip, APP_PORT)
        try:
            greeting = await asyncio.wait_for(reader.readline(), 20)
            writer.write(payload)
            writer.write_eof()
            echoed = await asyncio.wait_for(reader.read(), 20)
        finally:
            writer.close()
        return greeting, echoed

    greeting, echoed = await topology.loop_thread(a, "client").run(client())
    # With spoofing the app's SYN-ACK would go to node1's address, out of node2 (reset there): the tunnel would
    # time out and the client see the stream fail. Without it, the app sees ztunnel B's node address.
    assert greeting == f"peer={b.ip}\n".encode(), (greeting, logs)
    assert echoed == payload

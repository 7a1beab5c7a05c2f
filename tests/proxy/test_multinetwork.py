"""Two networks, real processes, network namespaces (the acceptance tests of issue 18; upstream's namespaced
``double_hbone1``/``double_hbone2``).

Four nodes on a bridge (``ztunnel.testing.netns``), each its own network namespace:

* ``a`` (network ``net-a``): ztunnel A for the client workload (the node's address), the client's SOCKS5 listener;
* ``c`` (``net-a``): ztunnel C for ``server-c``, an echo endpoint of the service on the client's network;
* ``b`` (``net-b``): ztunnel B for ``server-b``, the service's endpoint on the other network; its firewall drops
  everything from network A's nodes (a and c), so the only way in is through the gateway;
* ``g`` (``net-b``): the east-west gateway process (``python -m ztunnel.testing.gateway``), routing
  ``echo.default.svc.cluster.local`` to B's 15008.

Every process is a real one (``python -m ztunnel``); tcpdump on the gateway's node records what the gateway sees.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ztunnel.identity.ca import LocalCA
from ztunnel.proxy.proxy_protocol import TLV_PEER_IDENTITY, app_tunnel_header, parse_v2
from ztunnel.testing import Sample, ZtunnelProcess, scrape_now, socks5_connect
from ztunnel.testing import netns as tn

ECHO_HOST = "echo.default.svc.cluster.local"
VIP = "10.96.0.10"
APP_PORT = 8080
CLIENT_ID = "spiffe://cluster.local/ns/default/sa/client"
SERVER_ID = "spiffe://cluster.local/ns/default/sa/server"
GATEWAY_ID = "spiffe://cluster.local/ns/istio-system/sa/istio-eastwestgateway"

MESH = """
workloads:
- {{uid: Kubernetes//v1/Pod/default/client, name: client, namespace: default, serviceAccount: client,
   workloadIps: ["{a}"], protocol: HBONE, node: a, network: net-a, canonicalName: client, workloadName: client,
   workloadType: deployment, clusterId: Kubernetes}}
- {{uid: Kubernetes//v1/Pod/default/server-b, name: server-b, namespace: default, serviceAccount: server,
   workloadIps: ["{b}"], protocol: HBONE, node: b, network: net-b, canonicalName: echo, workloadName: server-b,
   workloadType: deployment, clusterId: Kubernetes,
   networkGateway: {{destination: "net-b/{g}", hboneMtlsPort: 15008}},
   services: {{"default/{host}": {{80: {port}}}}}}}
{local}- {{uid: Kubernetes//v1/Pod/istio-system/eastwestgateway, name: eastwestgateway, namespace: istio-system,
   serviceAccount: istio-eastwestgateway, workloadIps: ["{g}"], network: net-b, node: g}}
services:
- name: echo
  namespace: default
  hostname: {host}
  vips: ["net-a/{vip}"]
  ports: {{80: {port}}}
  subjectAltNames: ["{server_id}"]
{lb}
"""


LOCAL_ENDPOINT = """- {{uid: Kubernetes//v1/Pod/default/server-c, name: server-c, namespace: default, serviceAccount: server,
   workloadIps: ["{c}"], protocol: HBONE, node: c, network: net-a, canonicalName: echo, workloadName: server-c,
   workloadType: deployment, clusterId: Kubernetes,
   services: {{"default/{host}": {{80: {port}}}}}}}
"""


@dataclass
class Mesh:
    topo: tn.Topology
    a: tn.Node
    b: tn.Node
    c: tn.Node
    g: tn.Node
    workdir: Path
    with_local_endpoint: bool
    apps: dict[str, NamedEcho] = field(default_factory=dict)


class NamedEcho:
    """An app that says its name in one line, then echoes (so the client knows which endpoint it reached). With
    ``proxy``, each connection starts with a PROXY v2 header, kept raw in ``headers``."""

    def __init__(self, name: str, proxy: bool = False) -> None:
        self.name = name
        self.proxy = proxy
        self.headers: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.proxy:
            buf = b""
            while (header := parse_v2(buf)) is None:
                chunk = await reader.read(4096)
                if not chunk:
                    writer.close()
                    return
                buf += chunk
            self.headers.append(buf[: header.length])
            rest = buf[header.length :]
        else:
            rest = b""
        writer.write(f"{self.name}\n".encode() + rest)
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except ConnectionError:
            pass
        finally:
            writer.close()


def ztunnel_env(node: tn.Node, workload: str, network: str, workdir: Path) -> dict[str, str]:
    return {
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "ZTUNNEL_CA_DIR": str(workdir / "ca"),
        "LOCAL_XDS_PATH": str(workdir / "mesh.yaml"),
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": workload,
        "NODE_NAME": node.node,
        "NETWORK": network,
        "UNSTABLE_ENABLE_SOCKS5": "true",
        "ISTIO_META_DNS_CAPTURE": "false",
        "ENABLE_ORIG_SRC": "false",
        "LOG_FORMAT": "json",
    }


def access_lines(log: Path, direction: str) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("message") == "connection complete" and rec.get("direction") == direction:
            out.append(rec)
    return out


def samples(node: tn.Node, name: str) -> list[Sample]:
    return [s for s in node.run(scrape_now, "127.0.0.1", 15020) if s.name == name]


@pytest.fixture
def topology() -> Iterator[tn.Topology]:
    with tn.topology(iptables=True) as topo:
        yield topo


def start_control_plane(topo: tn.Topology, workdir: Path) -> tuple[subprocess.Popen[bytes], dict[str, dict[str, str]]]:
    """This project's istiod stand-in on the bridge (xDS + CA over gRPC/TLS, as ``ztunnel.testing.interop`` runs
    it for upstream's binary): the ztunnel environment that uses it, by node."""
    tokens = {"a": CLIENT_ID, "b": SERVER_ID, "c": SERVER_ID}
    argv = [sys.executable, "-m", "ztunnel.standins.istiod", "serve", "--config", str(workdir / "mesh.yaml"),
            "--ca-dir", str(workdir / "ca"), "--listen", f"{tn.BRIDGE_IP}:15012"]  # fmt: skip
    envs: dict[str, dict[str, str]] = {}
    for node, identity in tokens.items():
        (workdir / f"{node}.token").write_text(f"token-{node}")  # no newline: upstream sends the bytes verbatim
        argv += ["--token", f"token-{node}={identity}"]
        url, root = f"https://{tn.BRIDGE_IP}:15012", str(workdir / "ca" / "root-cert.pem")
        envs[node] = {"XDS_ADDRESS": url, "CA_ADDRESS": url, "XDS_ROOT_CA": root, "CA_ROOT_CA": root,
                      "FAKE_CA": "false", "AUTH_TOKEN": str(workdir / f"{node}.token"), "CLUSTER_ID": "Kubernetes",
                      "RUST_LOG": "info"}  # fmt: skip
    cp = topo.root.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    assert cp.stdout is not None
    assert cp.stdout.readline().startswith(b"serving on"), "control plane did not start"
    return cp, envs


def run_mesh(
    topo: tn.Topology,
    workdir: Path,
    lb: str = "",
    local_endpoint: bool = True,
    upstream: dict[str, str] | None = None,
    extra_env: dict[str, dict[str, str]] | None = None,
    proxy_tunnel_port: int | None = None,
) -> Iterator[Mesh]:
    """Start the mesh (with ``server-c`` on network A when ``local_endpoint``); yields once, checks exit codes.
    ``upstream`` maps nodes ("a", "b") to upstream's binary, run there instead of ours; then every ztunnel takes its
    config and certificate from the control plane stand-in (one CA for all)."""
    a, b, c, g = (topo.node(n) for n in ("a", "b", "c", "g"))
    # Network A's nodes cannot reach network B's node except through the gateway.
    for other in (a, c):
        b.exec(["iptables", "-A", "INPUT", "-s", other.ip, "-j", "DROP"])
    local = LOCAL_ENDPOINT.format(c=c.ip, host=ECHO_HOST, port=APP_PORT) if local_endpoint else ""
    text = MESH.format(
        a=a.ip, b=b.ip, g=g.ip, host=ECHO_HOST, port=APP_PORT, vip=VIP, server_id=SERVER_ID, lb=lb, local=local
    )
    if proxy_tunnel_port is not None:
        anchor = "workloadName: server-b,"
        text = text.replace(anchor, f"{anchor} applicationTunnel: {{protocol: PROXY, port: {proxy_tunnel_port}}},")
    (workdir / "mesh.yaml").write_text(text)
    LocalCA.load_or_create(workdir / "ca", "cluster.local")
    cp: subprocess.Popen[bytes] | None = None
    cp_envs: dict[str, dict[str, str]] = {}
    if upstream is not None:
        cp, cp_envs = start_control_plane(topo, workdir)
    procs: list[ZtunnelProcess] = []
    apps: list[tuple[tn.LoopThread, NamedEcho]] = []
    gateway: subprocess.Popen[bytes] | None = None
    gateway_log = open(workdir / "gateway.log", "wb")  # noqa: SIM115 - closed below
    try:
        for node, name in ((b, "server-b"), (c, "server-c")):
            thread = topo.loop_thread(node, name)
            tunnel = proxy_tunnel_port is not None and name == "server-b"
            echo = NamedEcho(name, proxy=tunnel)
            # Behind a PROXY app tunnel the app listens on loopback only (LOCALHOST_APP_TUNNEL, the default).
            listen = ("127.0.0.1", proxy_tunnel_port) if tunnel else ("0.0.0.0", APP_PORT)

            async def serve(echo: NamedEcho = echo, listen: tuple[str, int | None] = listen) -> None:
                echo.server = await asyncio.start_server(echo._handle, *listen)

            thread.call(serve())
            apps.append((thread, echo))
        gateway = g.popen(
            [
                sys.executable, "-m", "ztunnel.testing.gateway",
                "--ca-dir", str(workdir / "ca"), "--identity", GATEWAY_ID, "--listen", f"{g.ip}:15008",
                "--route", f"{ECHO_HOST}={b.ip}:15008", "--record", str(workdir / "gateway.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=gateway_log,
        )  # fmt: skip
        assert gateway.stdout is not None
        assert b"listening" in gateway.stdout.readline(), (workdir / "gateway.log").read_text()
        nodes = [(b, "default/server-b/server", "net-b"), (c, "default/server-c/server", "net-a")]
        for node, workload, network in [*nodes[: 2 if local_endpoint else 1], (a, "default/client/client", "net-a")]:
            env = ztunnel_env(node, workload, network, workdir)
            argv = None
            if upstream is not None:
                for key in ("LOCAL_XDS_PATH", "ZTUNNEL_CA_DIR"):
                    del env[key]
                env |= cp_envs[node.node]
                if node.node in upstream:
                    argv = [upstream[node.node], "proxy", "ztunnel"]
            env |= (extra_env or {}).get(node.node, {})
            log = workdir / f"{node.node}.log"
            procs.append(ZtunnelProcess(env, log, argv=argv, netns=node, kill_with_parent=True).start(timeout=30))
        mesh = Mesh(topo, a, b, c, g, workdir, local_endpoint)
        mesh.apps = {echo.name: echo for _, echo in apps}
        yield mesh
    finally:
        codes = [p.stop() for p in procs]
        if gateway is not None:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(10)
            assert gateway.stdout is not None
            gateway.stdout.close()
        gateway_log.close()
        for thread, echo in apps:
            if echo.server is not None:
                echo.server.close()
            thread.stop()
        if cp is not None:
            cp.send_signal(signal.SIGTERM)
            cp.wait(10)
            assert cp.stdout is not None
            cp.stdout.close()
    assert codes == [0] * len(procs), f"exit codes {codes}; logs in {workdir}"


async def connect_once(mesh: Mesh, payload: bytes) -> tuple[str, bytes]:
    """From node a: SOCKS5 to the service VIP; (the endpoint's name, what was echoed)."""

    async def client() -> tuple[str, bytes]:
        reader, writer = await socks5_connect(("127.0.0.1", 15080), VIP, 80)
        try:
            name = (await asyncio.wait_for(reader.readline(), 20)).decode().strip()
            writer.write(payload)
            writer.write_eof()
            echoed = await asyncio.wait_for(reader.read(), 30)
        finally:
            writer.close()
        return name, echoed

    return await mesh.topo.loop_thread(mesh.a, "client").run(client())


def start_capture(node: tn.Node, pcap: Path) -> subprocess.Popen[bytes]:
    proc = node.popen(["tcpdump", "-i", "any", "-U", "-s", "0", "-w", str(pcap), "tcp"], stderr=subprocess.PIPE)
    assert proc.stderr is not None
    said = b""
    while b"listening" not in said:  # "listening on any ..." once it captures
        line = proc.stderr.readline()
        assert line, said
        said += line
    return proc


async def wait_for(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


async def test_double_hbone_two_networks(topology: tn.Topology, tmp_path: Path) -> None:
    import shutil

    if shutil.which("tcpdump") is None:
        pytest.skip("tcpdump is not installed (apt-get install -y tcpdump): the wire check needs it")
    # Only network B's endpoint, so every connection crosses the gateway.
    gen = run_mesh(topology, tmp_path, local_endpoint=False)
    mesh = next(gen)
    try:
        pcap = tmp_path / "gateway.pcap"
        capture = start_capture(mesh.g, pcap)
        marker = b"PLAINTEXT-SHOULD-NOT-BE-SEEN-BY-THE-GATEWAY:" * 4096  # 176 KiB of a text the wire must not show
        names = []
        try:
            for _ in range(3):
                name, echoed = await connect_once(mesh, marker)
                assert echoed == marker
                names.append(name)
        finally:
            capture.send_signal(signal.SIGINT)
            capture.wait(10)
            assert capture.stderr is not None
            capture.stderr.close()
        a_out = await wait_for(lambda: access_lines(tmp_path / "a.log", "outbound")[:3])
        await wait_for(lambda: len(access_lines(tmp_path / "b.log", "inbound")) >= 3)
        b_in = access_lines(tmp_path / "b.log", "inbound")
        a_metrics = samples(mesh.a, "istio_tcp_connections_opened_total")
        b_metrics = samples(mesh.b, "istio_tcp_connections_opened_total")
    finally:
        with pytest.raises(StopIteration):
            next(gen)
    assert names == ["server-b"] * 3
    # On the wire at the gateway: the connections passed (bytes captured), and never the plaintext.
    wire = pcap.read_bytes()
    assert len(wire) > 3 * len(marker), len(wire)
    assert b"PLAINTEXT-SHOULD-NOT-BE-SEEN" not in wire
    # The gateway's own record: outer CONNECTs by service hostname from the client's identity.
    seen = json.loads((tmp_path / "gateway.json").read_text())
    crossed = [s for s in seen if s["status"] == 200]
    assert len(crossed) == names.count("server-b"), seen
    assert all(s["authority"] == f"{ECHO_HOST}:80" and s["peer_identity"] == CLIENT_ID for s in crossed), seen
    # A (reporter source): to the server's identity, through the gateway.
    via_gw = [r for r in a_out if str(r.get("dst.addr", "")).startswith(f"{mesh.g.ip}:")]
    assert via_gw and all(r["dst.identity"] == SERVER_ID and r["src.identity"] == CLIENT_ID for r in via_gw), a_out
    # B (reporter destination): the client's identity; the TCP peer is the gateway.
    assert len(b_in) == len(crossed), b_in
    assert all(r["src.identity"] == CLIENT_ID and r["src.addr"].startswith(f"{mesh.g.ip}:") for r in b_in), b_in
    assert all("error" not in r for r in b_in + via_gw)
    a_src = [s for s in a_metrics if s.labels["reporter"] == "source"]
    assert any(
        s.labels["destination_principal"] == SERVER_ID and s.labels["source_principal"] == CLIENT_ID for s in a_src
    ), a_src
    b_dst = [s for s in b_metrics if s.labels["reporter"] == "destination"]
    assert sum(s.value for s in b_dst if s.labels["source_principal"] == CLIENT_ID) == len(crossed), b_dst
    assert all(s.labels["destination_principal"] == SERVER_ID for s in b_dst), b_dst


@pytest.mark.parametrize(
    ("lb", "expect"),
    [
        ("", "both"),
        ("  loadBalancer: {mode: Failover, routingPreferences: [Network]}", "local"),
    ],
    ids=["standard", "failover-network"],
)
async def test_service_on_both_networks(topology: tn.Topology, tmp_path: Path, lb: str, expect: str) -> None:
    gen = run_mesh(topology, tmp_path, lb)
    mesh = next(gen)
    try:
        n = 24
        results = [await connect_once(mesh, os.urandom(1024)) for _ in range(n)]
    finally:
        with pytest.raises(StopIteration):
            next(gen)
    assert len(results) == n  # every connection succeeded (connect_once raises otherwise)
    names = [name for name, _ in results]
    if expect == "local":
        assert names == ["server-c"] * n  # FAILOVER prefers the client's network while it has healthy endpoints
    else:
        # STANDARD: random over both (each 50%): both are reached (all 24 on one side: 2 in 2**24).
        assert set(names) == {"server-b", "server-c"}, names
    seen = json.loads((tmp_path / "gateway.json").read_text())
    assert len([s for s in seen if s["status"] == 200]) == names.count("server-b"), seen


@pytest.mark.parametrize("upstream_node", ["a", "b"], ids=["upstream-client-side", "upstream-server-side"])
async def test_double_hbone_with_upstream(topology: tn.Topology, tmp_path: Path, upstream_node: str) -> None:
    """Upstream Rust ztunnel on one side of the gateway, ours on the other (``ZTUNNEL_UPSTREAM_BIN``; skipped
    without it): its double HBONE reaches our inbound, ours reaches its inbound, through the same test gateway."""
    from ztunnel.testing.interop import require_upstream

    binary = require_upstream()
    gen = run_mesh(topology, tmp_path, local_endpoint=False, upstream={upstream_node: binary})
    mesh = next(gen)
    try:
        payload = os.urandom(256 * 1024)
        name, echoed = await connect_once(mesh, payload)
        b_metrics = await wait_for(lambda: samples(mesh.b, "istio_tcp_connections_opened_total"))
    finally:
        with pytest.raises(StopIteration):
            next(gen)
    assert name == "server-b" and echoed == payload
    seen = json.loads((tmp_path / "gateway.json").read_text())
    (s,) = seen
    assert s["status"] == 200 and s["authority"] == f"{ECHO_HOST}:80" and s["peer_identity"] == CLIENT_ID, s
    assert "x-forwarded-network" not in s["headers"], s
    (b,) = [m for m in b_metrics if m.labels["reporter"] == "destination"]
    assert b.labels["source_principal"] == CLIENT_ID and b.labels["destination_principal"] == SERVER_ID, b


async def test_double_hbone_on_demand(topology: tn.Topology, tmp_path: Path) -> None:
    """``XDS_ON_DEMAND`` on the client's ztunnel (worker processes, config from the control plane stand-in): it
    holds only its own node's workload, asks for the VIP (the service and its endpoint on network B come with it),
    then for the endpoint's network gateway (``net-b/<gateway ip>``, on no node of its own), through the control
    process, and the first connection crosses."""
    on_demand = {"a": {"XDS_ON_DEMAND": "true", "ISTIO_META_DNS_CAPTURE": "false", "ZTUNNEL_WORKER_THREADS": "2"}}
    gen = run_mesh(topology, tmp_path, local_endpoint=False, upstream={}, extra_env=on_demand)
    mesh = next(gen)
    try:
        payload = os.urandom(64 * 1024)
        name, echoed = await connect_once(mesh, payload)
        a_out = await wait_for(lambda: access_lines(tmp_path / "a.log", "outbound"))
    finally:
        with pytest.raises(StopIteration):
            next(gen)
    assert name == "server-b" and echoed == payload
    (a,) = a_out
    assert a["dst.addr"] == f"{mesh.g.ip}:15008" and a["dst.identity"] == SERVER_ID, a
    log = (tmp_path / "a.log").read_text()
    assert f"net-b/{mesh.g.ip}" in log, "the gateway was not asked for on demand"


@pytest.mark.parametrize("server", ["ours", "upstream"])
async def test_proxy_header_behind_the_gateway(topology: tn.Topology, tmp_path: Path, server: str) -> None:
    """Server-b's app tunnel speaks PROXY; the request comes through the gateway by service hostname. The header
    names the TCP peer (the gateway), the service VIP with the requested port (PROXY carries no hostname) and the
    client's identity. With ``ZTUNNEL_UPSTREAM_BIN``, upstream's ztunnel on B writes one for the same request: the
    two are the same bytes but for the gateway's source port."""
    upstream: dict[str, str] = {}
    if server == "upstream":
        from ztunnel.testing.interop import require_upstream

        upstream = {"b": require_upstream()}
    gen = run_mesh(topology, tmp_path, local_endpoint=False, upstream=upstream, proxy_tunnel_port=15088)
    mesh = next(gen)
    try:
        name, echoed = await connect_once(mesh, b"behind the tunnel")
        (raw,) = mesh.apps["server-b"].headers
    finally:
        with pytest.raises(StopIteration):
            next(gen)
    assert name == "server-b" and echoed == b"behind the tunnel"
    h = parse_v2(raw)
    assert h is not None and h.src is not None and h.dst is not None
    assert str(h.src[0]) == mesh.g.ip  # the TCP peer of B's 15008: the gateway
    assert (str(h.dst[0]), h.dst[1]) == (VIP, 80)
    assert h.tlv(TLV_PEER_IDENTITY) == CLIENT_ID.encode()
    expected = app_tunnel_header(
        (ipaddress.ip_address(mesh.g.ip), h.src[1]), (ipaddress.ip_address(VIP), 80), CLIENT_ID
    )
    assert raw == expected  # byte for byte what ours writes (for upstream's ztunnel: what it wrote)

"""``make demo``: two ztunnels as two nodes on loopback, carrying a client's bytes over HBONE to an echo server.

Node A (127.0.1.1) proxies the workload "client", node B (127.0.2.1) proxies "server", whose app is an echo server
on 127.0.2.1:8080 behind the service VIP 127.10.0.10:80 (``examples/two-node.yaml``). The client speaks SOCKS5 to
node A (ztunnel's explicit capture mode); node A load-balances the VIP to the server's endpoint and opens an HBONE
tunnel (HTTP/2 CONNECT over mutual TLS) to node B's port 15008, which checks the client's identity and connects to
the app. No root, no istiod, no Kubernetes.

Where the configuration and the certificates come from:

* default (``make demo``): the embedded default. Each ztunnel reads the example as its local config file and signs
  its own certificate with a local CA (``FAKE_CA=true``).
* ``--control-plane`` (``make demo-control-plane``): this project's control plane
  (``ztunnel.standins.istiod.server.XdsServer``), run in this process on an ephemeral port of 127.0.0.1, serves the same
  file over delta xDS and signs certificates with ``CreateCertificate``, over gRPC with TLS. Each ztunnel runs with
  ``FAKE_CA=false`` and a bearer token that the control plane maps to its workload's identity.

``--relocate`` moves the example to a random block of 127/8 (as the tests do), so the demo can run beside tests or
a benchmark that hold the fixed addresses.

Everything printed about the connection is read back from the ztunnels: the path and identities from their access
records, the byte counts from their ``/metrics`` (stats port 15020, scraped before they stop). Both ztunnels are
stopped with SIGTERM (a graceful drain) and must exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ztunnel.identity.spiffe import Identity
from ztunnel.testing import (
    NODE_A_IP,
    NODE_B_IP,
    SERVER_APP,
    SERVICE_VIP,
    TWO_NODE,
    EchoServer,
    TwoNodeMesh,
    ZtunnelProcess,
    node_env,
    socks5_connect,
)

MESSAGE = b"hello from the client, through HBONE"
BULK = 8 * 1024 * 1024
SERVICE = "echo.default.svc.cluster.local"
# The metrics printed for the connection (upstream's stable TCP metrics).
METRICS = ("istio_tcp_connections_opened_total", "istio_tcp_sent_bytes_total", "istio_tcp_received_bytes_total")
# --control-plane: the token each node presents, and the identity the control plane maps it to.
TOKENS = {
    "node-a": ("demo-token-client", Identity("cluster.local", "default", "client")),
    "node-b": ("demo-token-server", Identity("cluster.local", "default", "server")),
}
EXIT_ADDRESS_IN_USE = 2


@dataclass(frozen=True)
class Topology:
    """Where the two nodes, the app and the VIP are, and the config file that says so."""

    node_a: str
    node_b: str
    vip: tuple[str, int]
    app: tuple[str, int]
    config: Path

    @classmethod
    def default(cls) -> Topology:
        return cls(NODE_A_IP, NODE_B_IP, SERVICE_VIP, SERVER_APP, TWO_NODE)

    @classmethod
    def relocated(cls, work: Path) -> Topology:
        m = TwoNodeMesh(work)
        return cls(m.node_a, m.node_b, m.vip, m.server_app, m.config)


def _access_records(log: Path) -> list[tuple[str, dict[str, Any]]]:
    """The ``connection complete`` access records of a JSON log, each with its line as written."""
    out = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("scope") == "access" and rec.get("message") == "connection complete":
            out.append((line, rec))
    return out


def _http_get(ip: str, port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=5) as resp:
        return str(resp.read().decode())


def _metric_lines(text: str, reporter: str) -> list[str]:
    """The lines of :data:`METRICS` for the demo's service as one reporter wrote them."""
    return [
        line
        for line in text.splitlines()
        if line.split("{", 1)[0] in METRICS
        and f'reporter="{reporter}"' in line
        and f'destination_service="{SERVICE}"' in line
    ]


async def _scrape_closed(ip: str, reporter: str, timeout: float = 5.0) -> list[str]:
    """Node ``ip``'s metric lines for the connection, once its close has been recorded (bytes are added at close)."""
    deadline = time.monotonic() + timeout
    while True:
        text = await asyncio.to_thread(_http_get, ip, 15020, "/metrics")
        closed = any(
            line.startswith("istio_tcp_connections_closed_total{") and f'reporter="{reporter}"' in line
            for line in text.splitlines()
        )
        if closed or time.monotonic() > deadline:
            return _metric_lines(text, reporter)
        await asyncio.sleep(0.05)


async def _serials(ip: str, identity: Identity) -> tuple[str, str]:
    """The serials of ``identity``'s leaf certificate and of its root, from node ``ip``'s admin config dump."""
    dump = json.loads(await asyncio.to_thread(_http_get, ip, 15000, "/config_dump"))
    for entry in dump["certificates"]:
        if entry["identity"] == str(identity) and entry["certChain"] and entry["rootCerts"]:
            return str(entry["certChain"][0]["serialNumber"]), str(entry["rootCerts"][-1]["serialNumber"])
    return "-", "-"


async def _client(topo: Topology) -> tuple[bytes, float]:
    reader, writer = await socks5_connect((topo.node_a, 15080), *topo.vip)
    writer.write(MESSAGE)
    echoed = await reader.readexactly(len(MESSAGE))
    payload = bytes(range(256)) * (BULK // 256)
    start = time.perf_counter()

    async def send() -> None:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()  # half-close: FIN -> END_STREAM -> FIN at the server

    async def recv() -> int:
        got = 0
        while chunk := await reader.read(1 << 20):
            got += len(chunk)
        return got

    _, got = await asyncio.gather(send(), recv())
    elapsed = time.perf_counter() - start
    writer.close()
    if got != BULK:
        raise RuntimeError(f"echo returned {got} bytes, expected {BULK}")
    return echoed, elapsed


async def _main(work: Path, control_plane: bool, relocate: bool) -> int:
    topo = Topology.relocated(work) if relocate else Topology.default()
    source = "the local control plane over gRPC" if control_plane else "a local CA in each ztunnel"
    print(f"ztunnel demo: two nodes on loopback, {topo.config.name} as the mesh config, certificates from {source}\n")
    echo = await EchoServer().start(*topo.app)
    print(f"  app      echo server (workload 'server') listening on {topo.app[0]}:{topo.app[1]}")
    cp: Any = None
    if control_plane:
        from ztunnel.standins.istiod.server import XdsServer
        from ztunnel.testing.control_plane import ztunnel_env

        tokens = dict(TOKENS.values())
        cp = XdsServer.from_ca_dir(work / "cp", config_paths=(topo.config,), tokens=tokens, listen="127.0.0.1:0")
        await cp.start()
        print(
            f"  control  xDS (delta ADS) and CA (CreateCertificate) on {cp.url}, TLS with root {cp.root_cert_path},"
            f" bearer tokens for {', '.join(str(i) for i in tokens.values())}"
        )
    nodes = []
    try:
        for name, ip, workload in (
            ("node-a", topo.node_a, "default/client/client"),
            ("node-b", topo.node_b, "default/server/server"),
        ):
            env = node_env(name, ip, workload, work / "ca", topo.config, LOG_FORMAT="json", RUST_LOG="info")
            if cp is not None:
                del env["LOCAL_XDS_PATH"]
                env.update(ztunnel_env(cp, token=TOKENS[name][0]))
            proc = ZtunnelProcess(env, log_path=work / f"{name}.log")
            nodes.append(proc)
            await asyncio.to_thread(proc.start)
            print(
                f"  {name}   ztunnel for '{workload}' on {ip}: outbound :15001, HBONE :15008, SOCKS5 :15080,"
                " metrics :15020, admin :15000"
            )
        echoed, elapsed = await _client(topo)
        metrics = {
            "node-a": await _scrape_closed(topo.node_a, "source"),
            "node-b": await _scrape_closed(topo.node_b, "destination"),
        }
        serials = {n: await _serials(ip, TOKENS[n][1]) for n, ip in (("node-a", topo.node_a), ("node-b", topo.node_b))}
    finally:
        codes = [await asyncio.to_thread(p.stop) for p in nodes if p.proc is not None]
        if cp is not None:
            await cp.stop()
        await echo.stop()

    logs = {
        name: _access_records(p.log_path) for name, p in zip(("node-a", "node-b"), nodes, strict=True) if p.log_path
    }
    out = [rec for _, rec in logs["node-a"] if rec.get("direction") == "outbound"]
    inn = [rec for _, rec in logs["node-b"] if rec.get("direction") == "inbound"]
    if not out or not inn:
        print("\nno access record for the connection: see the logs above", file=sys.stderr)
        return 1
    a, b = out[-1], inn[-1]
    endpoint = str(a.get("dst.hbone_addr", "-"))
    print("\nWhat happened (from the access records)")
    print(
        f"  client -> SOCKS5 {topo.node_a}:15080 -> CONNECT {topo.vip[0]}:{topo.vip[1]}"
        f" (service {a.get('dst.service')})"
    )
    print(
        f"  node-a picked endpoint {a.get('dst.workload')} at {endpoint.rpartition(':')[0]} and opened HBONE to "
        f"{a.get('dst.addr')} with :authority {endpoint}"
    )
    print(f"  identities: {a.get('src.identity')} -> {a.get('dst.identity')}")
    print(
        f"  node-b accepted the tunnel from {b.get('src.addr')} (peer identity {b.get('src.identity')}) and connected"
        f" to the app at {b.get('dst.hbone_addr')}"
    )
    print(f"  echoed back: {echoed.decode()!r}")
    print(
        f"  then {BULK >> 20} MiB each way in {elapsed * 1000:.0f} ms "
        f"({BULK * 8 / elapsed / 1e9:.2f} Gbit/s each way), ended by a half-close"
    )

    print("\nAccess logs (one line per connection and direction, as each ztunnel wrote them)")
    for name, records in logs.items():
        for line, _ in records:
            print(f"  {name}: {line}")

    print(f"\nMetrics (GET /metrics on port 15020 before stopping; {', '.join(METRICS)})")
    for name, lines in metrics.items():
        for line in lines:
            print(f"  {name}: {line}")

    cp_ok = True
    if cp is not None:
        acked = sum(len(s.acks) for s in cp.sessions)
        nodes_seen = sorted({s.node_name for s in cp.sessions if s.node_name})
        print("\nControl plane")
        print(
            f"  {len(cp.sessions)} delta ADS streams ({', '.join(nodes_seen)}), {acked} responses ACKed, "
            f"{len(cp.nacks)} NACKed; {len(cp.ca_requests)} CreateCertificate calls"
        )
        cp_root = str(cp.ca.root_cert.serial_number)  # decimal, as the config dump writes serials
        for name, (leaf, root) in serials.items():
            signer = "the control plane's CA" if root == cp_root else f"root {root}, NOT the control plane's {cp_root}"
            print(f"  {name} certificate for {TOKENS[name][1]} (admin config_dump): serial {leaf}, issued by {signer}")
            cp_ok = cp_ok and root == cp_root

    print(f"\nBoth ztunnels drained on SIGTERM and exited with status {codes}.")
    ok = codes == [0, 0] and echoed == MESSAGE and all(metrics.values()) and cp_ok
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    import uvloop

    parser = argparse.ArgumentParser(prog="python -m ztunnel.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--control-plane",
        action="store_true",
        help="serve the config and certificates from the local control plane over gRPC (FAKE_CA=false, tokens)",
    )
    parser.add_argument(
        "--relocate", action="store_true", help="move the example to a random block of 127/8 (beside tests)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ztunnel-demo-") as work:
        try:
            return uvloop.run(_main(Path(work), args.control_plane, args.relocate))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            print(
                f"\ndemo: {e.strerror}: another demo, test or benchmark holds the example's addresses "
                "(run with --relocate to use others)",
                file=sys.stderr,
            )
            return EXIT_ADDRESS_IN_USE


if __name__ == "__main__":
    sys.exit(main())

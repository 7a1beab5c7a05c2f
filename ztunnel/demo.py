"""``make demo``: two ztunnels as two nodes on loopback, carrying a client's bytes over HBONE to an echo server.

Everything is the embedded default: ``examples/two-node.yaml`` as the local config and a local CA (no istiod, no
root, no Kubernetes). Node A (127.0.1.1) proxies the workload "client", node B (127.0.2.1) proxies "server", whose
app is an echo server on 127.0.2.1:8080 behind the service VIP 127.10.0.10:80. The client speaks SOCKS5 to node A
(ztunnel's explicit capture mode); node A load-balances the VIP to the server's endpoint and opens an HBONE tunnel
(HTTP/2 CONNECT over mutual TLS) to node B's port 15008, which checks the client's identity and connects to the
app. The demo prints the path, the identities, the bytes and both ztunnels' access-log lines, then stops both
ztunnels with SIGTERM (a graceful drain) and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ztunnel.testing import (
    NODE_A_IP,
    NODE_B_IP,
    SERVER_APP,
    SERVICE_VIP,
    TWO_NODE,
    EchoServer,
    ZtunnelProcess,
    node_env,
    socks5_connect,
)

MESSAGE = b"hello from the client, through HBONE"
BULK = 8 * 1024 * 1024


def _access_lines(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("scope") == "access":
            out.append(rec)
    return out


async def _client() -> tuple[bytes, float]:
    reader, writer = await socks5_connect((NODE_A_IP, 15080), *SERVICE_VIP)
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


async def _main(work: Path) -> int:
    ca = work / "ca"
    print("ztunnel demo: two nodes on loopback, embedded default config (examples/two-node.yaml) and a local CA\n")
    echo = await EchoServer().start(*SERVER_APP)
    print(f"  app      echo server (workload 'server') listening on {SERVER_APP[0]}:{SERVER_APP[1]}")
    nodes = []
    for name, ip, workload in (
        ("node-a", NODE_A_IP, "default/client/client"),
        ("node-b", NODE_B_IP, "default/server/server"),
    ):
        env = node_env(name, ip, workload, ca, TWO_NODE, LOG_FORMAT="json", RUST_LOG="info")
        proc = ZtunnelProcess(env, log_path=work / f"{name}.log")
        await asyncio.to_thread(proc.start)
        nodes.append(proc)
        print(
            f"  {name}   ztunnel for '{workload}' on {ip}: outbound :15001, HBONE :15008, SOCKS5 :15080, ready :15021"
        )
    try:
        echoed, elapsed = await _client()
    finally:
        codes = [await asyncio.to_thread(p.stop) for p in nodes]
        await echo.stop()
    print("\nWhat happened")
    print(f"  client -> SOCKS5 {NODE_A_IP}:15080 -> CONNECT {SERVICE_VIP[0]}:{SERVICE_VIP[1]} (service echo.default)")
    print(
        f"  node-a picked endpoint {SERVER_APP[0]} and opened HBONE to {NODE_B_IP}:15008 "
        f"with :authority {SERVER_APP[0]}:{SERVER_APP[1]}"
    )
    print(f"  echoed back: {echoed.decode()!r}")
    print(
        f"  then {BULK >> 20} MiB each way in {elapsed * 1000:.0f} ms "
        f"({BULK * 8 / elapsed / 1e9:.2f} Gbit/s each way), ended by a half-close"
    )
    print("\nAccess logs (one line per connection and direction, as upstream ztunnel writes them)")
    for proc, name in zip(nodes, ("node-a", "node-b"), strict=True):
        assert proc.log_path is not None
        for rec in _access_lines(proc.log_path):
            if rec.get("message") != "connection complete":
                continue
            print(f"  {name} {rec.get('direction')}: {rec.get('src.identity', '-')} -> {rec.get('dst.identity', '-')}")
            print(
                f"      src {rec.get('src.addr')} dst {rec.get('dst.addr')} hbone {rec.get('dst.hbone_addr', '-')}"
                f" service {rec.get('dst.service', '-')}"
            )
            print(
                f"      bytes_sent={rec.get('bytes_sent')} bytes_recv={rec.get('bytes_recv')}"
                f" duration={rec.get('duration')}"
            )
    print(f"\nBoth ztunnels drained on SIGTERM and exited with status {codes}.")
    return 0 if codes == [0, 0] and echoed == MESSAGE else 1


def main() -> int:
    import uvloop

    with tempfile.TemporaryDirectory(prefix="ztunnel-demo-") as work:
        return uvloop.run(_main(Path(work)))


if __name__ == "__main__":
    sys.exit(main())

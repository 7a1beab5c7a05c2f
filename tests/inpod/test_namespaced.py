"""In-pod mode end to end, as upstream's ``tests/namespaced.rs``: real namespaces, veths, a bridge and iptables.

Two nodes, each with a ztunnel process in its node namespace in shared (in-pod) mode, fed by the node agent (our
istio-cni stand-in) over ZDS; the agent applies istio-cni's in-pod rules to each enrolled pod. Unmodified clients
(plain sockets inside a pod's namespace) connect to pod IPs and to a service VIP; the kernel redirects them to the
pod's ztunnel listeners. Root only: skipped with the reason elsewhere (and required in CI).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.inpod.cluster import MARKER, VIP, Cluster, cluster, dns_cluster, peer_and_body, topology

__all__ = ["cluster", "dns_cluster", "topology"]  # fixtures


async def test_cross_node_captured_pair(cluster: Cluster) -> None:
    c = cluster
    reply = await asyncio.to_thread(c.call, "client", c.pods["server-b"].ip, 8080, b"hello across nodes")
    peer, body = peer_and_body(reply)
    assert body == b"hello across nodes"
    assert peer == c.pods["client"].ip  # the app sees the real client (IP_TRANSPARENT spoofing in its pod)
    await asyncio.sleep(0.2)
    dest = c.scrape("node2")
    (opened,) = [
        s for s in dest["istio_tcp_connections_opened"] if s.labels["connection_security_policy"] == "mutual_tls"
    ]
    assert opened.labels["reporter"] == "destination"
    assert opened.labels["source_principal"] == "spiffe://cluster.local/ns/default/sa/client"
    assert opened.labels["destination_workload"] == "server"
    recv = [s.value for s in dest["istio_tcp_received_bytes"] if s.labels == opened.labels]
    assert recv == [len(b"hello across nodes")]
    src = c.scrape("node1")
    assert any(
        s.labels["reporter"] == "source" and s.labels["connection_security_policy"] == "mutual_tls"
        for s in src["istio_tcp_connections_opened"]
    )
    inbound = [r for r in c.access("node2") if r["direction"] == "inbound"]
    assert inbound and inbound[-1]["src.identity"] == "spiffe://cluster.local/ns/default/sa/client"
    assert inbound[-1]["dst.addr"] == f"{c.pods['server-b'].ip}:15008"


async def test_same_node_captured_pair(cluster: Cluster) -> None:
    c = cluster
    reply = await asyncio.to_thread(c.call, "client", c.pods["server-a"].ip, 8080, b"same node")
    assert peer_and_body(reply) == (c.pods["client"].ip, b"same node")
    await asyncio.sleep(0.2)
    directions = {
        r["direction"] for r in c.access("node1") if r.get("dst.hbone_addr", "").startswith(c.pods["server-a"].ip)
    }
    assert directions == {"inbound", "outbound"}  # both ends on node1's ztunnel, still HBONE between the pods


async def test_captured_client_to_uncaptured_server(cluster: Cluster) -> None:
    c = cluster
    reply = await asyncio.to_thread(c.call, "client", c.pods["plain"].ip, 8080, b"to a plain server")
    assert peer_and_body(reply)[1] == b"to a plain server"
    await asyncio.sleep(0.2)
    src = c.scrape("node1")
    plain = [
        s
        for s in src["istio_tcp_connections_closed"]
        if s.labels["connection_security_policy"] == "unknown" and s.labels["reporter"] == "source"
    ]
    assert plain and plain[0].labels["destination_workload"] == "unknown"  # a TCP workload: passthrough


async def test_uncaptured_client_to_captured_server(cluster: Cluster) -> None:
    c = cluster
    reply = await asyncio.to_thread(c.call, "plain", c.pods["server-b"].ip, 8080, b"from outside the mesh")
    peer, body = peer_and_body(reply)
    assert body == b"from outside the mesh" and peer == c.pods["plain"].ip
    await asyncio.sleep(0.2)
    dest = c.scrape("node2")
    passthrough = [
        s
        for s in dest["istio_tcp_connections_opened"]
        if s.labels["reporter"] == "destination" and s.labels["connection_security_policy"] == "unknown"
    ]
    assert passthrough  # 15006: plaintext inbound, policy-checked, no identity


async def test_service_vip_load_balanced_across_nodes(cluster: Cluster) -> None:
    c = cluster
    peers: set[str] = set()
    servers: list[str] = []
    for i in range(24):
        reply = await asyncio.to_thread(c.call, "client", *VIP, f"req {i}".encode())
        peer, body = peer_and_body(reply)
        assert body == f"req {i}".encode()
        peers.add(peer)
        servers.append(reply.decode())
    assert peers == {c.pods["client"].ip}
    await asyncio.sleep(0.3)
    hbone_targets = {
        r["dst.hbone_addr"].split(":")[0]
        for r in c.access("node1")
        if r["direction"] == "outbound" and r.get("dst.service") == "echo.default.svc.cluster.local"
    }
    assert hbone_targets == {c.pods["server-a"].ip, c.pods["server-b"].ip}


async def test_no_cleartext_on_the_node_link(cluster: Cluster) -> None:
    c = cluster
    pcap = c.work / "node1.pcap"
    dump = c.nodes["node1"].popen(
        ["tcpdump", "--immediate-mode", "-i", "eth0", "-U", "-s", "0", "-w", str(pcap), "tcp"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    err = b""
    try:
        assert dump.stderr is not None
        ready = await asyncio.to_thread(dump.stderr.readline)  # "listening on eth0 ..." once attached
        assert b"listening on" in ready, ready
        payload = MARKER * 50
        reply = await asyncio.to_thread(c.call, "client", c.pods["server-b"].ip, 8080, payload)
        assert peer_and_body(reply)[1] == payload
        await asyncio.sleep(0.5)  # immediate mode + -U write each packet as it comes; a moment for the last
    finally:
        dump.send_signal(signal.SIGINT)
        err = dump.communicate(timeout=5)[1]
    captured = pcap.read_bytes()
    assert len(captured) > len(payload), err.decode()  # the traffic did cross this link (as TLS)
    assert MARKER not in captured
    assert b"\x16\x03" in captured  # TLS handshake records


async def test_calls_to_ztunnel_ports_are_refused(cluster: Cluster) -> None:
    c = cluster

    def attempt(port: int) -> bytes | str:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
                s.sendall(b"loop?")
                s.shutdown(socket.SHUT_WR)
                return s.recv(100)
        except OSError as e:
            return f"{type(e).__name__}:{e.errno}:{e}"

    for port in (15001, 15006, 15008):
        result = await asyncio.to_thread(c.pods["client"].run, attempt, port)
        # Refused, reset or closed: never relayed anywhere (nothing echoed back).
        assert result == b"" or isinstance(result, str), (port, result)


async def test_pod_dns_answered_by_ztunnel_then_hbone(dns_cluster: Cluster) -> None:
    """A pod's getaddrinfo of a mesh name goes to a nameserver off the pod, the capture rules send it to ztunnel's
    DNS proxy in the pod (raw-table CT zones as upstream), which answers from xDS; the connection then goes
    through HBONE. ``ip netns exec`` gives the pod its own resolv.conf from /etc/netns/<name>/."""
    c = dns_cluster
    pod = c.pods["client"]
    etc = Path("/etc/netns") / pod.name
    etc.mkdir(parents=True, exist_ok=True)
    try:
        (etc / "resolv.conf").write_text("nameserver 192.0.2.53\nsearch default.svc.cluster.local\noptions timeout:2\n")
        script = (
            "import socket\n"
            "ip = socket.getaddrinfo('echo', 80, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]\n"
            "s = socket.create_connection((ip, 80), timeout=10)\n"
            "s.sendall(b'via dns'); s.shutdown(socket.SHUT_WR)\n"
            "out = b''\n"
            "while (chunk := s.recv(4096)): out += chunk\n"
            "print(ip, out.split(b'\\n', 1)[1].decode())\n"
        )
        result = await asyncio.to_thread(pod.exec, [sys.executable, "-c", script])
    finally:
        for f in etc.iterdir():
            f.unlink()
        etc.rmdir()
    ip, _, body = result.stdout.strip().partition(" ")
    assert ip == VIP[0], result.stdout  # answered by ztunnel from its state: no DNS server knows this name
    assert body == "via dns"
    await asyncio.sleep(0.2)
    metrics = c.scrape("node1")
    assert any(s.labels["request_protocol"] == "udp" for s in metrics["istio_dns_requests"])
    assert any(
        r["direction"] == "outbound" and r.get("dst.service") == "echo.default.svc.cluster.local"
        for r in c.access("node1")
    )

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
from typing import Any

from tests.inpod.cluster import (
    EXTERNAL_IP,
    EXTERNAL_NAME,
    MARKER,
    VIP,
    Cluster,
    cluster,
    dns_cluster,
    eventually,
    metric_sum,
    peer_and_body,
    running_dns_cluster,
    topology,
)
from ztunnel.testing import netns as tn

__all__ = ["cluster", "dns_cluster", "topology"]  # fixtures

CLIENT_ID = "spiffe://cluster.local/ns/default/sa/client"
SERVER_ID = "spiffe://cluster.local/ns/default/sa/server"
MTLS = {"connection_security_policy": "mutual_tls", "request_protocol": "tcp", "response_flags": "-"}


def assert_traffic(
    metrics: dict[str, list[Any]], labels: dict[str, str], sent: int, received: int, count: int = 1
) -> None:
    """Upstream's ``verify_metrics``: ``count`` connections opened and closed, and the bytes, with ``labels``.
    ``received`` is client->server and ``sent`` server->client for both reporters (Istio's convention)."""
    got = {
        name: metric_sum(metrics.get(f"istio_tcp_{name}", []), **labels)
        for name in ("connections_opened", "connections_closed", "received_bytes", "sent_bytes")
    }
    want = {"connections_opened": count, "connections_closed": count, "received_bytes": received, "sent_bytes": sent}
    assert got == want, labels


def one_record(records: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The single access record whose fields include ``fields``."""
    found = [r for r in records if all(r.get(k) == v for k, v in fields.items())]
    assert len(found) == 1, (fields, records)
    return found[0]


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
    payload = b"same node"
    reply = await asyncio.to_thread(c.call, "client", c.pods["server-a"].ip, 8080, payload)
    assert peer_and_body(reply) == (c.pods["client"].ip, payload)

    def check() -> None:
        directions = {
            r["direction"] for r in c.access("node1") if r.get("dst.hbone_addr") == f"{c.pods['server-a'].ip}:8080"
        }
        assert directions == {"inbound", "outbound"}  # both ends on node1's ztunnel, still HBONE between the pods
        # Both reporters on the one ztunnel, each with both identities (upstream's local_captured_inpod).
        m = c.scrape("node1")
        peers = {"source_workload": "client", "destination_workload": "server"}
        ids = {"source_principal": CLIENT_ID, "destination_principal": SERVER_ID}
        for reporter in ("source", "destination"):
            assert_traffic(m, {"reporter": reporter, **MTLS, **peers, **ids}, len(reply), len(payload))
        assert metric_sum(c.scrape("node2").get("istio_tcp_connections_opened", [])) == 0  # node2 saw nothing

    await eventually(check)


async def test_captured_client_to_uncaptured_server(cluster: Cluster) -> None:
    c = cluster
    payload = b"to a plain server"
    reply = await asyncio.to_thread(c.call, "client", c.pods["plain"].ip, 8080, payload)
    assert peer_and_body(reply)[1] == payload

    def check() -> dict[str, Any]:
        src = c.scrape("node1")
        # Plain TCP to a TCP-protocol workload: no mTLS, so no source principal (the destination's identity is
        # still known from xDS); "plain" has no workloadName in the mesh config, hence destination_workload unknown.
        labels = {"reporter": "source", "connection_security_policy": "unknown", "source_principal": "unknown"}
        labels |= {"source_workload": "client", "destination_workload": "unknown"}
        assert_traffic(src, labels, len(reply), len(payload))
        return one_record(c.access("node1"), direction="outbound", **{"dst.addr": f"{c.pods['plain'].ip}:8080"})

    record = await eventually(check)
    # Upstream's server_uncaptured_inpod access record: the names, the bytes, and no identities (no mTLS).
    assert record["src.workload"] == "client" and record["dst.workload"] == "plain"
    assert record["src.addr"].startswith(c.pods["client"].ip + ":")
    assert (record["bytes_sent"], record["bytes_recv"]) == (len(payload), len(reply))
    assert not {"src.identity", "dst.identity", "dst.hbone_addr"} & record.keys(), record
    assert c.access("node2") == []  # the plain pod has no ztunnel in its path


async def test_uncaptured_client_to_captured_server(cluster: Cluster) -> None:
    c = cluster
    payload = b"from outside the mesh"
    reply = await asyncio.to_thread(c.call, "plain", c.pods["server-b"].ip, 8080, payload)
    peer, body = peer_and_body(reply)
    assert body == payload and peer == c.pods["plain"].ip

    def check() -> dict[str, Any]:
        dest = c.scrape("node2")
        # 15006: plaintext inbound, policy-checked, no identity on either side.
        labels = {"reporter": "destination", "connection_security_policy": "unknown", "source_principal": "unknown"}
        assert_traffic(dest, {**labels, "destination_workload": "server"}, len(reply), len(payload))
        return one_record(c.access("node2"), direction="inbound")

    record = await eventually(check)
    assert record["src.workload"] == "plain" and record["dst.workload"] == "server-b"
    assert record["src.addr"].startswith(c.pods["plain"].ip + ":")
    assert record["dst.addr"] == f"{c.pods['server-b'].ip}:8080"  # the app's address: no HBONE hop
    assert (record["bytes_sent"], record["bytes_recv"]) == (len(reply), len(payload))
    assert not {"src.identity", "dst.identity", "dst.hbone_addr"} & record.keys(), record


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
    sent = sum(len(r) for r in servers)
    received = sum(len(f"req {i}") for i in range(24))
    svc = {
        "destination_service": "echo.default.svc.cluster.local",
        "destination_service_name": "echo",
        "destination_service_namespace": "default",
    }

    def check() -> None:
        hbone_targets = {
            r["dst.hbone_addr"].split(":")[0]
            for r in c.access("node1")
            if r["direction"] == "outbound" and r.get("dst.service") == "echo.default.svc.cluster.local"
        }
        assert hbone_targets == {c.pods["server-a"].ip, c.pods["server-b"].ip}
        # The source reports every connection against the service; each node's destination reporter its share.
        node1, node2 = c.scrape("node1"), c.scrape("node2")
        ids = {"source_principal": CLIENT_ID, "destination_principal": SERVER_ID}
        assert_traffic(node1, {"reporter": "source", **MTLS, **svc, **ids}, sent, received, count=24)
        shares = [
            metric_sum(m["istio_tcp_connections_closed"], reporter="destination", **MTLS, **svc, **ids)
            for m in (node1, node2)
        ]
        assert sum(shares) == 24 and min(shares) > 0, shares
        assert sum(metric_sum(m["istio_tcp_received_bytes"], reporter="destination") for m in (node1, node2)) == (
            received
        )

    await eventually(check)


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


# Upstream's malicious_calls_test outcomes: the connect fails; it connects but the request fails (closed or reset
# with nothing relayed back: no loop through ztunnel); or it connects and gets an HTTP error.
CONNECTION, REQUEST, HTTP = "connection", "request", "http"
PROBE = b"hello world\r\n\r\n"


def probe(host: str, port: int) -> str:
    """Upstream's send_traffic: connect (1 s), send PROBE, read as many bytes back (1 s). The outcome, or what
    went wrong."""
    try:
        s = socket.create_connection((host, port), timeout=1)
    except OSError:
        return CONNECTION
    with s:
        got = b""
        try:
            s.sendall(PROBE)
            while len(got) < len(PROBE) and (chunk := s.recv(len(PROBE) - len(got))):
                got += chunk
        except TimeoutError:
            return f"hung: {got!r}"  # a loop or a stall: upstream's 1 s timeout fails the test
        except OSError:
            return REQUEST if not got else f"reset after {got!r}"
        if got == b"":
            return REQUEST
        return HTTP if got.startswith(b"HTTP/1.1 400") else f"got {got!r}"


async def test_calls_to_ztunnel_ports_are_refused(cluster: Cluster) -> None:
    """Upstream's ``malicious_calls_inpod``: from a captured pod to its node's ztunnel, to itself and to localhost,
    and from an uncaptured pod to the node and to the captured pod, on every ztunnel port. Nothing loops, nothing
    is relayed; only the stats and readiness ports answer (HTTP/1.1 400 to plaintext garbage, as hyper does)."""
    c = cluster
    zt, ourself, localhost = c.nodes["node1"].ip, c.pods["client"].ip, "127.0.0.1"
    captured = {
        # Captured to the node: outbound passthrough to the node, where nothing of ztunnel's listens on 15001,
        # 15006, 15008 (no self listener), 15080; admin 15000 is localhost-only; 15020/15021 answer HTTP 400.
        **{(zt, p): REQUEST for p in (15001, 15006, 15008, 15080, 15000)},
        (zt, 15020): HTTP,
        (zt, 15021): HTTP,
        # To itself or to localhost: the pod's own ztunnel listeners take the call and refuse it (recursive call,
        # or not TLS on 15008); nothing else of ztunnel's is in the pod (SOCKS5 is off).
        **{(h, p): REQUEST for h in (ourself, localhost) for p in (15001, 15006, 15008)},
        **{(h, p): CONNECTION for h in (ourself, localhost) for p in (15080, 15000, 15020, 15021)},
    }
    uncaptured = {
        # Upstream expects a Request failure on the node's 15008 because its test ztunnel has the "self" HBONE
        # listener (POD_NAME/POD_NAMESPACE/SERVICE_ACCOUNT set); these ztunnels are not given those, so nothing
        # listens there (with them: tests/test_proxyfactory.py::test_hbone_metrics_access_namespaced).
        **{(zt, p): CONNECTION for p in (15001, 15006, 15008, 15080, 15000)},
        (zt, 15020): HTTP,
        (zt, 15021): HTTP,
        # To the captured pod: all taken as inbound plaintext (15008 by the HBONE listener), then closed.
        **{(ourself, p): REQUEST for p in (15001, 15006, 15008, 15080, 15000, 15020, 15021)},
    }
    for pod, cases in (("client", captured), ("plain", uncaptured)):
        got = {(h, p): await asyncio.to_thread(c.pods[pod].run, probe, h, p) for h, p in cases}
        assert got == cases, pod
    # Every call ztunnel took ended in an error (refused, recursive call, not TLS): none was relayed anywhere,
    # and each made one record per hop, not a stream of them (a loop).
    records = c.access("node1") + c.access("node2")
    assert records and all(r["level"] == "error" for r in records), records
    assert len(records) < len(captured) + len(uncaptured), records
    assert "attempted recursive call to ourselves" in c.logs["node1"].read_text()


POD_RESOLV_CONF = "nameserver 192.0.2.53\nsearch default.svc.cluster.local\noptions timeout:2\n"


def run_with_pod_dns(pod: tn.Pod, script: str) -> subprocess.CompletedProcess[str]:
    """Run a Python ``script`` in ``pod`` with a resolv.conf of its own (``ip netns exec`` bind-mounts
    /etc/netns/<name>/): a nameserver off the pod that nothing answers, so only the capture rules (to ztunnel's
    DNS proxy on 15053) can answer."""
    etc = Path("/etc/netns") / pod.name
    etc.mkdir(parents=True, exist_ok=True)
    try:
        (etc / "resolv.conf").write_text(POD_RESOLV_CONF)
        return pod.exec([sys.executable, "-c", script])
    finally:
        for f in etc.iterdir():
            f.unlink()
        etc.rmdir()


async def test_pod_dns_answered_by_ztunnel_then_hbone(dns_cluster: Cluster) -> None:
    """A pod's getaddrinfo of a mesh name goes to a nameserver off the pod, the capture rules send it to ztunnel's
    DNS proxy in the pod (raw-table CT zones as upstream), which answers from xDS; the connection then goes
    through HBONE."""
    c = dns_cluster
    script = (
        "import socket\n"
        "ip = socket.getaddrinfo('echo', 80, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]\n"
        "s = socket.create_connection((ip, 80), timeout=10)\n"
        "s.sendall(b'via dns'); s.shutdown(socket.SHUT_WR)\n"
        "out = b''\n"
        "while (chunk := s.recv(4096)): out += chunk\n"
        "print(ip, out.split(b'\\n', 1)[1].decode())\n"
    )
    result = await asyncio.to_thread(run_with_pod_dns, c.pods["client"], script)
    ip, _, body = result.stdout.strip().partition(" ")
    assert ip == VIP[0], result.stdout  # answered by ztunnel from its state: no DNS server knows this name
    assert body == "via dns"
    endpoints = {f"{c.pods[p].ip}:8080" for p in ("server-a", "server-b")}

    def check() -> dict[str, Any]:
        metrics = c.scrape("node1")
        assert metric_sum(metrics["istio_dns_requests"], request_protocol="udp", request_query_type="a") >= 1
        assert metric_sum(metrics.get("istio_dns_upstream_requests", [])) == 0  # nothing forwarded
        return one_record(c.access("node1"), direction="outbound", **{"dst.service": "echo.default.svc.cluster.local"})

    record = await eventually(check)
    # HBONE: CONNECT to an endpoint of the service, carried to that pod's 15008, with both identities.
    assert record["dst.hbone_addr"] in endpoints, record
    assert record["dst.addr"] == record["dst.hbone_addr"].replace(":8080", ":15008")
    assert record["src.identity"] == CLIENT_ID and record["dst.identity"] == SERVER_ID
    assert c.upstream_dns is not None and c.upstream_dns.queries == []


def marked_dns_packets(pod: tn.Pod) -> int:
    """Packets through the pod's raw-table rule for ztunnel's own (mark 1337) DNS queries: ``CT --zone 1``."""
    saved = pod.exec(["iptables-save", "-c", "-t", "raw"]).stdout
    (line,) = [ln for ln in saved.splitlines() if "--mark 0x539/0xfff" in ln and "--dport 53" in ln]
    return int(line[1:].split(":", 1)[0])  # "[packets:bytes] -A ISTIO_OUTPUT ..."


async def test_pod_dns_forwards_other_names_from_inside_the_pod(dns_cluster: Cluster) -> None:
    """A name ztunnel does not own is forwarded to the nameservers of ztunnel's resolv.conf, from inside the pod's
    namespace with mark 1337 (upstream): the upstream server sees the pod's IP, not the node's, and the pod's
    rules let the marked query out (counted by the raw-table CT zone rule) instead of capturing it again."""
    c = dns_cluster
    upstream = c.upstream_dns
    assert upstream is not None
    pod = c.pods["client"]
    assert marked_dns_packets(pod) == 0
    script = (
        "import socket\n"
        f"print(socket.getaddrinfo({EXTERNAL_NAME!r}, 80, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])\n"
    )
    result = await asyncio.to_thread(run_with_pod_dns, pod, script)
    assert result.stdout.strip() == EXTERNAL_IP, result.stderr
    asked = [
        (src, transport)
        for (transport, q), src in zip(upstream.queries, upstream.sources, strict=True)
        if q.question[0].name.to_text() == EXTERNAL_NAME + "."
    ]
    assert asked and set(asked) == {(pod.ip, "udp")}, asked
    assert marked_dns_packets(pod) >= len(asked)

    def check() -> None:
        metrics = c.scrape("node1")
        forwarded = metric_sum(metrics["istio_dns_upstream_requests"], request_query_type="a", request_protocol="udp")
        assert forwarded == len(asked)
        assert metric_sum(metrics.get("istio_dns_upstream_failures", [])) == 0

    await eventually(check)


def listening_ports(ns: tn.Netns) -> set[int]:
    """The TCP ports listening in ``ns`` (``/proc/net/tcp`` and ``tcp6`` as a process there sees them)."""
    out: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in ns.exec(["cat", table]).stdout.splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                out.add(int(fields[1].rsplit(":", 1)[1], 16))
    return out


async def test_enable_proxy_false_runs_only_the_pods_dns_proxies(topology: tn.Topology, tmp_path: Path) -> None:
    """Upstream's ENABLE_PROXY=false in shared mode: each pod gets its DNS proxy and nothing else. The pod's name
    lookups are answered by ztunnel from its state; no HBONE listener (15001, 15006, 15008) exists in the pod."""
    async with running_dns_cluster(topology, tmp_path, {"ENABLE_PROXY": "false"}) as c:
        pod = c.pods["client"]

        def dns_is_up() -> None:
            assert 15053 in listening_ports(pod)

        await eventually(dns_is_up, timeout=10)
        assert listening_ports(pod) & {15001, 15006, 15008, 15080} == set()
        script = "import socket\nprint(socket.getaddrinfo('echo', 80, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])\n"
        result = await asyncio.to_thread(run_with_pod_dns, pod, script)
        assert result.stdout.strip() == VIP[0], result.stderr  # answered by ztunnel: no DNS server knows the name
        metrics = c.scrape("node1")
        assert metric_sum(metrics["istio_dns_requests"], request_protocol="udp", request_query_type="a") >= 1
        assert "istio_tcp_connections_opened" not in metrics

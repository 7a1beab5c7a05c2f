"""Istio metrics after real traffic through two ztunnels, parsed with prometheus-client's OpenMetrics parser (the
body is OpenMetrics text whatever the Content-Type, as upstream's)."""

from __future__ import annotations

import asyncio
import gzip
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from ztunnel.metrics import Registry, encode
from ztunnel.testing import EchoServer, TwoNodeMesh, ZtunnelProcess, running_app

STABLE = {
    "istio_build",
    "istio_tcp_connections_opened",
    "istio_tcp_connections_closed",
    "istio_tcp_received_bytes",
    "istio_tcp_sent_bytes",
    "process_open_fds",
    "process_max_fds",
}
LABEL_ORDER = [
    "reporter",
    "source_workload",
    "source_canonical_service",
    "source_canonical_revision",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_cluster",
    "destination_service",
    "destination_service_namespace",
    "destination_service_name",
    "destination_workload",
    "destination_canonical_service",
    "destination_canonical_revision",
    "destination_workload_namespace",
    "destination_principal",
    "destination_app",
    "destination_version",
    "destination_cluster",
    "request_protocol",
    "response_flags",
    "connection_security_policy",
    "source_region",
    "source_zone",
    "destination_region",
    "destination_zone",
]


def scrape(host: str, path: str = "/metrics", headers: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    req = urllib.request.Request(f"http://{host}:15020{path}", headers=headers or {})
    with urllib.request.urlopen(req, timeout=5) as resp:
        body = resp.read()
        hdrs = dict(resp.headers)
    if hdrs.get("Content-Encoding") == "gzip":
        body = gzip.decompress(body)
    return body.decode(), hdrs


def samples(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, []).extend(fam.samples)
        out.setdefault("#help:" + fam.name, []).append(fam.documentation)
    return out


@pytest.fixture
async def traffic(tmp_path: Path) -> AsyncIterator[tuple[TwoNodeMesh, int, int]]:
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    outside = await EchoServer().start(m.plain, 7000)  # "plain" is a TCP (non-mesh) workload
    async with running_app(m.env_a()), running_app(m.env_b()):
        # HBONE: 300,000 bytes client->server, echoed back.
        reader, writer = await m.socks5()
        writer.write(b"x" * 300_000)
        writer.write_eof()
        got = len(await asyncio.wait_for(reader.read(), 10))
        writer.close()
        # Passthrough (TCP, no HBONE): 1,000 bytes.
        reader, writer = await m.socks5(m.plain, 7000)
        writer.write(b"y" * 1000)
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await asyncio.sleep(0.2)  # both ends close and release
        yield m, 300_000, got
    await echo.stop()
    await outside.stop()


async def test_tcp_metrics_on_both_reporters(traffic: tuple[TwoNodeMesh, int, int]) -> None:
    m, sent, echoed = traffic
    assert echoed == sent
    a = samples((await asyncio.to_thread(scrape, m.node_a))[0])
    b = samples((await asyncio.to_thread(scrape, m.node_b))[0])
    for name in ("istio_tcp_connections_opened", "istio_tcp_connections_closed"):
        # prometheus-client's parser names counter samples with _total
        assert name in a and name in b
    a_opened = [s for s in a["istio_tcp_connections_opened"] if s.labels["connection_security_policy"] == "mutual_tls"]
    b_opened = a_opened and [s for s in b["istio_tcp_connections_opened"]]
    assert len(a_opened) == 1 and a_opened[0].value == 1
    la = a_opened[0].labels
    assert list(la) == LABEL_ORDER
    assert la["reporter"] == "source"
    assert la["source_workload"] == "client" and la["source_workload_namespace"] == "default"
    # Over HBONE the source reporter claims the identity it presents (upstream conn_metrics_from_request).
    assert la["source_principal"] == "spiffe://cluster.local/ns/default/sa/client"
    assert la["destination_principal"] == "spiffe://cluster.local/ns/default/sa/server"
    assert la["connection_security_policy"] == "mutual_tls"
    assert la["destination_service"] == "echo.default.svc.cluster.local"
    assert la["destination_service_name"] == "echo" and la["destination_service_namespace"] == "default"
    assert la["destination_canonical_service"] == "echo" and la["destination_version"] == "v1"
    assert la["request_protocol"] == "tcp" and la["response_flags"] == "-"
    (lb,) = [s.labels for s in b_opened if s.labels["connection_security_policy"] == "mutual_tls"]
    assert lb["reporter"] == "destination"
    assert lb["source_principal"] == "spiffe://cluster.local/ns/default/sa/client"
    assert lb["source_workload"] == "client"
    assert lb["destination_workload"] == "server"
    # Bytes: received = client->server, sent = server->client, on both reporters; equal to what was sent.
    for scraped, labels in ((a, la), (b, lb)):
        recv = [s.value for s in scraped["istio_tcp_received_bytes"] if s.labels == labels]
        sent_b = [s.value for s in scraped["istio_tcp_sent_bytes"] if s.labels == labels]
        assert recv == [sent] and sent_b == [sent]
    # The passthrough connection is "unknown" security policy on the source reporter, with its bytes.
    plain = [s for s in a["istio_tcp_connections_closed"] if s.labels["connection_security_policy"] == "unknown"]
    assert len(plain) == 1 and plain[0].value == 1
    # ... with no source principal (plain TCP presents no certificate); the destination, a TCP workload known to
    # xDS, is still named with its identity, as upstream's with_destination does for any known workload.
    pl = plain[0].labels
    assert pl["source_principal"] == "unknown" and pl["source_workload"] == "client"
    assert pl["destination_principal"] == "spiffe://cluster.local/ns/default/sa/plain"
    plain_recv = [s.value for s in a["istio_tcp_received_bytes"] if s.labels["connection_security_policy"] == "unknown"]
    assert plain_recv == [1000]
    sockets = {s.labels["reporter"]: s.value for s in a["istio_tcp_sockets_open"]}
    assert sockets == {"source": 0}


async def test_stats_exist_stable_set_and_unstable_help(traffic: tuple[TwoNodeMesh, int, int]) -> None:
    m, _, _ = traffic
    text, headers = await asyncio.to_thread(scrape, m.node_a)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    stable = {n for n, f in fams.items() if "unstable" not in f.documentation}
    assert stable == STABLE
    # Upstream's prometheus-client leaves out families without series: no failure happened, so no failed family.
    assert "istio_tcp_connections_failed" not in fams
    assert all(f.samples for f in fams.values())
    assert "unstable" in fams["istio_tcp_sockets_open"].documentation
    assert not any(s.name.endswith("_created") for f in fams.values() for s in f.samples)
    build = fams["istio_build"].samples[0]
    assert build.labels["component"] == "ztunnel" and build.value == 1
    assert headers["Content-Type"] == "text/plain; charset=utf-8"  # upstream's, exactly
    assert text.endswith("# EOF\n")


@pytest.mark.parametrize(
    ("accept", "content_type"),
    [
        # upstream metrics/server.rs test_content_type, case by case
        ("", "text/plain; charset=utf-8"),
        ("application/json", "text/plain; charset=utf-8"),
        ("application/openmetrics-text; other stuff", "application/openmetrics-text;charset=utf-8;version=1.0.0"),
        (
            "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.6,"
            "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
            "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,"
            "text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
            "application/openmetrics-text;charset=utf-8;version=1.0.0",
        ),
    ],
)
def test_content_type_as_upstream(accept: str, content_type: str) -> None:
    registry = Registry()
    body, headers = encode(registry, accept)
    assert headers == {"Content-Type": content_type}

    # The body is the same OpenMetrics text whichever Content-Type labels it (but for the live fd count).
    def stable_lines(text: bytes) -> list[bytes]:
        return [line for line in text.splitlines() if not line.startswith(b"process_open_fds ")]

    assert stable_lines(body) == stable_lines(encode(registry)[0]) and body.endswith(b"# EOF\n")


async def test_openmetrics_and_gzip(traffic: tuple[TwoNodeMesh, int, int]) -> None:
    m, _, _ = traffic
    text, headers = await asyncio.to_thread(
        scrape, m.node_a, "/stats/prometheus", {"Accept": "application/openmetrics-text", "Accept-Encoding": "gzip"}
    )
    assert headers["Content-Type"] == "application/openmetrics-text;charset=utf-8;version=1.0.0"
    assert headers.get("Content-Encoding") == "gzip"
    assert text.rstrip().endswith("# EOF")


async def test_failed_connection_counted_with_flag(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_a()), running_app(m.env_b()):
        # Nothing listens behind the service: node B answers 503, node A records a CONNECT failure.
        with pytest.raises(ConnectionError):
            await m.socks5()
        await asyncio.sleep(0.1)
        a = samples((await asyncio.to_thread(scrape, m.node_a))[0])
    failed = a["istio_tcp_connections_failed"]
    assert [s.labels["response_flags"] for s in failed] == ["CONNECT"]
    closed = [s.labels["response_flags"] for s in a["istio_tcp_connections_closed"]]
    assert closed == ["CONNECT"]


async def test_unknown_path_is_404(traffic: tuple[TwoNodeMesh, int, int]) -> None:
    m, _, _ = traffic
    with pytest.raises(urllib.error.HTTPError) as e:
        await asyncio.to_thread(scrape, m.node_a, "/nope")
    e.value.close()
    assert e.value.code == 404


# -- long-lived connections: bytes reach the counters before the connection closes ----------------------------------


async def test_periodic_flush_counts_bytes_of_open_connections_once() -> None:
    """The relay keeps plain ints; the flusher adds what is new every interval, and the close adds only the rest."""
    import ipaddress

    from ztunnel.proxy.connection_manager import ConnectionManager, ConnectionRecord, Direction
    from ztunnel.proxy.metrics import TrafficMetrics, flush_periodically

    traffic = TrafficMetrics(Registry())
    manager = ConnectionManager(traffic)
    counted = {"sent": 0, "recv": 0}
    ip = ipaddress.ip_address("10.0.0.1")
    record = ConnectionRecord(Direction.OUTBOUND, (ip, 1), (ip, 2))
    record.bytes_sent, record.bytes_recv = (lambda: counted["sent"]), (lambda: counted["recv"])
    manager.register(record)
    assert record.metrics is not None
    flusher = asyncio.ensure_future(flush_periodically(lambda: manager, traffic, interval=0.01))  # noqa: TID251 - test
    try:
        counted.update(sent=100, recv=1000)
        await asyncio.sleep(0.05)
        assert (record.metrics.sent.value, record.metrics.received.value) == (100, 1000)
        counted.update(sent=150, recv=4000)
        await asyncio.sleep(0.05)
        assert (record.metrics.sent.value, record.metrics.received.value) == (150, 4000)
        counted.update(sent=160)
        manager.release(record)  # the close adds the last 10 bytes, not the 150 already flushed
        assert (record.metrics.sent.value, record.metrics.received.value) == (160, 4000)
        counted.update(sent=999)
        await asyncio.sleep(0.05)  # a released connection is no longer flushed
        assert record.metrics.sent.value == 160
    finally:
        flusher.cancel()


async def test_long_lived_connection_bytes_scraped_before_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream counts bytes as they are copied; here a flush every FLUSH_INTERVAL (5 s, 0.1 s for this test) makes
    an open connection's bytes visible to a scrape on both reporters, and its close does not count them again."""
    from ztunnel.proxy import metrics as proxy_metrics

    monkeypatch.setattr(proxy_metrics, "FLUSH_INTERVAL", 0.1)
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)

    async def bytes_on_both(expect: int) -> None:
        for node in (m.node_a, m.node_b):
            for _ in range(50):
                scraped = samples((await asyncio.to_thread(scrape, node))[0])
                received = [s.value for s in scraped.get("istio_tcp_received_bytes", [])]
                sent = [s.value for s in scraped.get("istio_tcp_sent_bytes", [])]
                if received == sent == [expect]:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"{node}: received {received}, sent {sent}, want {expect}")

    try:
        async with running_app(m.env_a()), running_app(m.env_b()):
            reader, writer = await m.socks5()
            try:
                writer.write(b"x" * 50_000)
                assert len(await asyncio.wait_for(reader.readexactly(50_000), 10)) == 50_000
                await bytes_on_both(50_000)  # still open
                a = samples((await asyncio.to_thread(scrape, m.node_a))[0])
                assert "istio_tcp_connections_closed" not in a
                assert {s.labels["reporter"]: s.value for s in a["istio_tcp_sockets_open"]} == {"source": 1}
                writer.write(b"y" * 20_000)
                await asyncio.wait_for(reader.readexactly(20_000), 10)
                await bytes_on_both(70_000)  # still open, and growing
                writer.write_eof()
                assert await asyncio.wait_for(reader.read(), 10) == b""
            finally:
                writer.close()  # (a client left open would hang the test loop's close on failure)
            await asyncio.sleep(0.3)
            await bytes_on_both(70_000)  # closed: the same total, not counted twice
            a = samples((await asyncio.to_thread(scrape, m.node_a))[0])
            assert [s.value for s in a["istio_tcp_connections_closed"]] == [1]
    finally:
        await echo.stop()


async def test_sockets_open_counts_accepted_sockets(tmp_path: Path) -> None:
    """``istio_tcp_sockets_open`` as upstream: accepted sockets, not proxied connections. Two SOCKS5 tunnels share
    one pooled HBONE connection, so node B has accepted one socket for both; a plain TCP socket on B's 15008 that
    never starts TLS is an accepted socket too. All back to 0 once closed."""
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)

    async def sockets(node: str, want: dict[str, float]) -> None:
        got: dict[str, float] = {}
        for _ in range(100):
            scraped = samples((await asyncio.to_thread(scrape, node))[0])
            got = {s.labels["reporter"]: s.value for s in scraped.get("istio_tcp_sockets_open", [])}
            if got == want:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{node}: istio_tcp_sockets_open {got}, want {want}")

    try:
        async with running_app(m.env_a()), running_app(m.env_b()):
            tunnels = [await m.socks5() for _ in range(2)]
            for reader, writer in tunnels:
                writer.write(b"ping")
                assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
            await sockets(m.node_a, {"source": 2})
            await sockets(m.node_b, {"destination": 1})
            _, raw = await asyncio.open_connection(m.node_b, 15008)
            await sockets(m.node_b, {"destination": 2})
            raw.close()
            for _, writer in tunnels:
                writer.close()
            await sockets(m.node_a, {"source": 0})
            await sockets(m.node_b, {"destination": 1})  # the pooled HBONE connection stays open
    finally:
        await echo.stop()


def hist(fams: dict[str, list[Any]], name: str) -> tuple[float, dict[str, float]]:
    """(_count, {le: cumulative count}) of a histogram family summed over its label sets."""
    count = sum(s.value for s in fams.get(name, []) if s.name == name + "_count")
    buckets: dict[str, float] = {}
    for s in fams.get(name, []):
        if s.name == name + "_bucket":
            buckets[s.labels["le"]] = buckets.get(s.labels["le"], 0.0) + s.value
    return count, buckets


async def test_runtime_metrics_see_a_blocked_loop_and_gc(tmp_path: Path) -> None:
    """In place of upstream's tokio_* metrics: the event loop's lag (a 400 ms block shows as a late timer), its
    tasks, and garbage-collection pauses."""
    import gc
    import time

    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_a()):
        await asyncio.sleep(0.6)
        before = samples((await asyncio.to_thread(scrape, m.node_a))[0])
        count, buckets = hist(before, "ztunnel_event_loop_lag_seconds")
        assert count >= 1 and "unstable" in before["#help:ztunnel_event_loop_lag_seconds"][0]
        assert before["ztunnel_event_loop_tasks"][0].value >= 1
        late_before = count - buckets["0.25"]
        gc_before, _ = hist(before, "ztunnel_gc_pause_seconds")
        time.sleep(0.4)  # noqa: ASYNC251 - the point: hold the event loop, as a blocking call would
        gc.collect()
        await asyncio.sleep(0.6)
        after = samples((await asyncio.to_thread(scrape, m.node_a))[0])
    count, buckets = hist(after, "ztunnel_event_loop_lag_seconds")
    assert count - buckets["0.25"] == late_before + 1  # one timer fired more than 250 ms late
    gc_after, _ = hist(after, "ztunnel_gc_pause_seconds")
    assert gc_after >= gc_before + 1
    assert {s.labels["generation"] for s in after["ztunnel_gc_pause_seconds"] if "generation" in s.labels} >= {"2"}


async def test_runtime_metrics_of_every_process(tmp_path: Path) -> None:
    """With worker processes, /metrics sums every process's runtime metrics: the control process and two workers
    each probe their own loop (4 probes a second each)."""
    m = TwoNodeMesh(tmp_path)
    a = ZtunnelProcess(m.env_a(ZTUNNEL_WORKER_THREADS="2"), tmp_path / "a.log").start()
    try:
        await asyncio.sleep(1.0)
        scraped = samples((await asyncio.to_thread(scrape, m.node_a))[0])
    finally:
        a.stop()
    count, _ = hist(scraped, "ztunnel_event_loop_lag_seconds")
    assert count >= 3 * 3, count  # at least 3 probes from each of 3 loops
    assert scraped["ztunnel_event_loop_tasks"][0].value >= 3
    assert [s.value for s in scraped["ztunnel_log_lines_dropped"]] == [0]

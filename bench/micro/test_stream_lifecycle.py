"""One HBONE stream's whole life in the sans-IO cores, both sides: what a new connection costs in HTTP/2 alone.

CONNECT with upstream's three headers, the 200 with baggage, one byte each way, END_STREAM both ways. No TLS, no
sockets: this is the share of the connection-rate benchmark that h2 and the core account for.
"""

from __future__ import annotations

from pytest_benchmark.fixture import BenchmarkFixture

from bench.micro.test_hbone_frames import _exchange
from ztunnel.proxy.hbone.core import FRAME_HEADER_SIZE, HboneConnection

HEADERS = [
    ("baggage", "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=client,service.name=c"),
    ("forwarded", 'for="10.0.0.1:40000"'),
    ("traceparent", "00-0123456789abcdef0123456789abcdef-0123456789abcdef-00"),
]


def test_stream_lifecycle(benchmark: BenchmarkFixture) -> None:
    client, server = HboneConnection(True), HboneConnection(False)
    client.initiate()
    server.initiate()
    _exchange(client, server)
    buf = bytearray(FRAME_HEADER_SIZE + 1)

    def one() -> None:
        sid = client.send_connect("10.0.0.2:8080", HEADERS)
        _exchange(client, server)
        server.send_response(sid, 200, [("baggage", "k8s.cluster.name=Kubernetes")])
        _exchange(client, server)
        for a, b in ((client, server), (server, client)):
            assert a.frame_data(sid, buf, FRAME_HEADER_SIZE, 1) == 1
            b.receive_data(a.data_to_send() + bytes(buf))
        client.end_stream(sid)
        server.end_stream(sid)
        _exchange(client, server)
        assert not client.streams and not server.streams

    benchmark(one)

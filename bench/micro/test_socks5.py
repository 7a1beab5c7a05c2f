"""The SOCKS5 handshake the benchmark's ztunnel modes add per connection: parsing a pipelined greeting, CONNECT
request and first payload byte (the sans-IO parser only; the listener's socket work is not included)."""

from __future__ import annotations

from pytest_benchmark.fixture import BenchmarkFixture

from bench.worker import socks5_request
from ztunnel.proxy.socks5 import ConnectRequested, Reply, Socks5Parser, reply


def test_socks5_handshake(benchmark: BenchmarkFixture) -> None:
    request = socks5_request("10.0.0.2", 8080) + b"x"

    def handshake() -> bytes:
        events = Socks5Parser().receive(request)
        assert isinstance(events[-1], ConnectRequested)
        return reply(Reply.SUCCEEDED)

    benchmark(handshake)

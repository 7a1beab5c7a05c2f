"""One relay step through the real protocol objects, with in-memory transports instead of sockets.

* ``hbone``: a 64 KiB chunk read from the client's plaintext socket goes through the client side's HBONE framing
  and TLS encryption, then the server side's TLS decryption and HBONE parsing, and is written to the server's
  plaintext socket; window updates travel back. That is both ztunnels' user-space work per chunk (no syscalls).
* ``plain``: a 64 KiB chunk through the TCP passthrough relay (:class:`PlainRelay`), one plaintext socket to another.
"""

from __future__ import annotations

from pytest_benchmark.fixture import BenchmarkFixture

from bench.micro.pipes import HbonePair, sink_plain
from ztunnel.proxy.relay import PlainRelay

CHUNK = 64 * 1024


def test_relay_step_hbone(benchmark: BenchmarkFixture, pair: HbonePair) -> None:
    payload = memoryview(bytes(range(256)) * (CHUNK // 256))
    for _ in range(64):  # let the relay buffers grow to their steady size (1 KiB -> 256 KiB on full reads)
        pair.send(payload)
    before = pair.server_plain.bytes_written

    def step() -> int:
        return pair.send(payload)

    benchmark.extra_info["bytes_per_op"] = CHUNK
    benchmark(step)
    assert pair.server_plain.bytes_written > before
    assert pair.client_stream.bytes_from_plain == pair.server_plain.bytes_written


def test_relay_step_plain(benchmark: BenchmarkFixture) -> None:
    a, b = sink_plain(), sink_plain()
    PlainRelay(a, b).start()
    payload = memoryview(bytes(CHUNK))

    def step() -> int:
        buf = a.get_buffer(CHUNK)
        n = min(len(buf), CHUNK)
        buf[:n] = payload[:n]
        a.buffer_updated(n)
        return n

    for _ in range(64):
        step()
    benchmark.extra_info["bytes_per_op"] = CHUNK
    benchmark(step)
    assert b.bytes_written == a.bytes_read

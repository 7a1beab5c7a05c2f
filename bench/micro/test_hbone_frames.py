"""HBONE DATA frames in and out of the sans-IO core (:class:`ztunnel.proxy.hbone.core.HboneConnection`).

No TLS, no sockets: the cost of framing and parsing alone, per frame, for 16 KiB frames (what Envoy sends) and
256 KiB frames (a full relay read; ztunnel advertises 1 MiB frames).
"""

from __future__ import annotations

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from ztunnel.proxy.hbone.core import FRAME_HEADER_SIZE, ConnectRequested, HboneConnection

SIZES = [16 * 1024, 256 * 1024]


def _exchange(a: HboneConnection, b: HboneConnection) -> list[object]:
    events: list[object] = []
    while True:
        out_a, out_b = a.data_to_send(), b.data_to_send()
        if not out_a and not out_b:
            return events
        if out_a:
            events += b.receive_data(out_a)
        if out_b:
            events += a.receive_data(out_b)


def connected() -> tuple[HboneConnection, HboneConnection, int]:
    """A client and a server core with one open CONNECT stream (answered 200)."""
    client, server = HboneConnection(True), HboneConnection(False)
    client.initiate()
    server.initiate()
    _exchange(client, server)
    sid = client.send_connect("10.0.0.2:8080", [("baggage", "k8s.namespace.name=default")])
    events = _exchange(client, server)
    assert any(isinstance(e, ConnectRequested) for e in events)
    server.send_response(sid, 200)
    _exchange(client, server)
    return client, server, sid


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s // 1024}KiB")
def test_data_frame_out(benchmark: BenchmarkFixture, size: int) -> None:
    """``frame_data`` (header written in place before the payload) + ``data_to_send``, per frame.

    The send windows are given back after each frame by adding to the core's counters directly, which costs two
    integer additions, so the loop never runs dry; a real sender gets them back from WINDOW_UPDATE frames.
    """
    client, _server, sid = connected()
    buf = bytearray(FRAME_HEADER_SIZE + size)
    stream = client.streams[sid]

    def frame_out() -> int:
        n = client.frame_data(sid, buf, FRAME_HEADER_SIZE, size)
        client.data_to_send()
        client._send_window += n
        stream.send_window += n
        return n

    assert frame_out() == min(size, client.send_window(sid) or size)
    benchmark.extra_info["bytes_per_op"] = size
    benchmark(frame_out)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s // 1024}KiB")
def test_data_frame_in(benchmark: BenchmarkFixture, size: int) -> None:
    """One received DATA frame: copied into the core's buffer (as TLS decryption does), parsed into events,
    released by the consumer (``ack_data``), window updates produced when due."""
    client, server, sid = connected()
    if size > 16 * 1024:
        # The server accepts frames up to its advertised maximum; a client only sends them once it has seen it.
        assert server.settings.max_frame_size >= size
    buf = bytearray(FRAME_HEADER_SIZE + size)
    n = client.frame_data(sid, buf, FRAME_HEADER_SIZE, size)
    assert n == size, "the initial windows hold one frame of each size"
    frame = memoryview(buf)[: FRAME_HEADER_SIZE + n]

    def frame_in() -> int:
        got = 0
        view = frame
        while view:
            dst = server.get_buffer()
            k = min(len(dst), len(view))
            dst[:k] = view[:k]
            view = view[k:]
            for ev in server.buffer_updated(k):
                length = getattr(ev, "flow_controlled_length", 0)
                if length:
                    server.ack_data(sid, length)
                    got += length
        server.data_to_send()
        return got

    assert frame_in() == size
    benchmark.extra_info["bytes_per_op"] = size
    benchmark(frame_in)

"""A policy pushed by the local control plane (real gRPC, ztunnel/standins/istiod) closes the connections it denies
in whichever worker process holds them: node B runs two workers, and its inbound connections are on both."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from tests.xds.test_e2e_control_plane import NODE_B, SOCKS_A, VIP, mesh, start_mesh
from ztunnel.testing import socks5_connect

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <_io.FileIO name='[^']*\.log':pytest.PytestUnraisableExceptionWarning"
)


def inbound_workers(ip: str) -> Counter[int]:
    with urllib.request.urlopen(f"http://{ip}:15000/connections", timeout=10) as r:
        return Counter(row["worker"] for row in json.loads(r.read()) if row["direction"] == "inbound")


async def test_a_pushed_policy_closes_denied_connections_in_every_worker(tmp_path: Path) -> None:
    # Node A opens one HBONE connection per tunnel (POOL_MAX_STREAMS_PER_CONNECTION=1 in start_mesh), so node B's
    # kernel spreads them over its two workers.
    async with start_mesh(tmp_path, mesh(), ZTUNNEL_WORKER_THREADS="2") as m:
        conns = []
        for i in range(24):
            reader, writer = await socks5_connect(SOCKS_A, *VIP)
            writer.write(b"hello %d\n" % i)
            assert await asyncio.wait_for(reader.readline(), 10) == b"hello %d\n" % i
            conns.append((reader, writer))
        held = await asyncio.to_thread(inbound_workers, NODE_B)
        assert set(held) == {0, 1} and sum(held.values()) == 24, held

        m.write(mesh(deny=True))
        for reader, writer in conns:
            try:
                rest = await asyncio.wait_for(reader.read(), 10)
            except ConnectionResetError:
                rest = b""
            assert rest == b""  # closed by the policy, whichever worker held it
            writer.close()
        assert await asyncio.to_thread(inbound_workers, NODE_B) == Counter()
        log = (tmp_path / "b.log").read_text()
        assert log.count("connection closed due to policy change") >= 24

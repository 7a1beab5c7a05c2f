"""A tunnel through a draining server ztunnel, with upstream Rust ztunnel on one side (``make interop-upstream``).

The server's ztunnel gets SIGTERM while a tunnel through it is open: it sends its drain GOAWAY in two steps (GOAWAY
2^31-1 and a PING, the final GOAWAY once the PING is answered: the h2 crate's graceful shutdown, and this project's
since it matches it). The client's ztunnel, the other implementation, must answer the PING and keep the open
stream, so the tunnel finishes intact; and the HBONE connection must then close by itself (the peer answered, the
stream ended), so the draining ztunnel never needs its deadline: both log "drain duration expired" when they do.
Dedicated mode (SOCKS5 on the client's node), both directions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
from pathlib import Path

import pytest

from ztunnel.testing import socks5_connect
from ztunnel.testing.interop import SOCKS5, VIP, Impl, InteropMesh, Mode, require_upstream

pytestmark = pytest.mark.root

PAYLOAD = hashlib.shake_256(b"drain payload").digest(256 * 1024)  # past the first fill of every HTTP/2 window
DEADLINE_HIT = "drain duration expired"  # the same words in both implementations' logs


async def _through_a_drain(server_pid: int) -> tuple[bytes, bytes, bytes]:
    """Open a tunnel, exchange a line, SIGTERM the server's ztunnel, then send the payload and half-close: (the
    greeting, the line's echo, the payload's echo)."""
    reader, writer = await socks5_connect(SOCKS5, *VIP)
    try:
        greeting = await reader.readuntil(b"\n")
        writer.write(b"before the drain\n")
        line = await reader.readline()
        os.kill(server_pid, signal.SIGTERM)
        # Let the drain's GOAWAY and PING reach the client's ztunnel and its answer come back before more bytes
        # go: the stream must outlive the whole exchange, not race ahead of it.
        await asyncio.sleep(0.5)
        writer.write(PAYLOAD)
        writer.write_eof()
        echoed = await reader.read()
        return greeting, line, echoed
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.mark.parametrize("server", [Impl.OURS, Impl.UPSTREAM], ids=["ours-drains", "upstream-drains"])
def test_a_tunnel_finishes_through_the_server_ztunnels_drain(tmp_path: Path, server: Impl) -> None:
    client = Impl.UPSTREAM if server is Impl.OURS else Impl.OURS
    mesh = InteropMesh(Mode.DEDICATED, tmp_path, require_upstream())
    try:
        mesh.start(client, server)
        proc = mesh.ztunnels["node2"].proc
        assert proc is not None
        greeting, line, echoed = mesh.clients.call(asyncio.wait_for(_through_a_drain(proc.pid), 30), 35)
        assert greeting.startswith(b"peer="), greeting
        assert line == b"before the drain\n"
        assert len(echoed) == len(PAYLOAD) and echoed == PAYLOAD
        assert proc.wait(15) == 0  # the drain ended (SIGTERM), and cleanly
        log = mesh.log_text("node2")
        assert DEADLINE_HIT not in log, log
    finally:
        mesh.stop()
        mesh.close()

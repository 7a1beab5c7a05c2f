"""ZTUNNEL_OPENSSL_RECORD_LAYER: which TLS record layer two in-process ztunnels' HBONE connections run after the
handshake (ztunnel/proxy/hbone/records.py by default, OpenSSL's with the variable), and that traffic and a graceful
close work through either."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.testing import EchoServer, TwoNodeMesh, running_app


@pytest.mark.parametrize("openssl", [False, True], ids=["own-records", "openssl-records"])
async def test_the_setting_picks_the_record_layer_of_both_nodes(tmp_path: Path, openssl: bool) -> None:
    mesh = TwoNodeMesh(tmp_path)
    env = {"RUST_LOG": "warn", "ZTUNNEL_OPENSSL_RECORD_LAYER": "true" if openssl else "false"}
    echo = await EchoServer().start(*mesh.server_app)
    try:
        async with running_app(mesh.env_b(**env)), running_app(mesh.env_a(**env)):
            reader, writer = await mesh.socks5()
            payload = bytes(range(256)) * 1024  # 256 KiB: many records each way
            writer.write(payload)
            assert await asyncio.wait_for(reader.readexactly(len(payload)), 10) == payload
            live = [o for o in gc.get_objects() if isinstance(o, HboneTransport) and o.handshake_done and not o.closed]
            assert {o.core.client_side for o in live} == {True, False}  # node A's pooled client, node B's server
            for conn in live:
                assert (conn._records is None) is openssl, conn
            writer.close()
            await writer.wait_closed()
    finally:
        await echo.stop()

"""A DENY policy that arrives while inbound is still connecting to the app applies to that connection.

Upstream registers an inbound connection with its connection manager before it checks policy, and keeps it there
through the connect to the app, so the policy watcher sees it. Here the app's connect is held open (a listener with
a full accept queue: the kernel drops the SYN, so the connect stays in SYN_SENT), a DENY arrives meanwhile, and the
stream is answered 401 (15008) or closed (15006) without reaching the app; the half-open app socket is closed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ztunnel import sockets
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.rbac import Action, Authorization, Match, Scope, StringMatch, StringMatchKind
from ztunnel.state import StateUpdate
from ztunnel.state.workload import IPAddress
from ztunnel.testing import HeldListener, TwoNodeMesh, access_fields, eventually, hbone_dial, hbone_request, running_app

CLIENT = Identity("cluster.local", "default", "client")
DENY_CLIENT = Authorization(
    "deny-client",
    "default",
    Scope.NAMESPACE,
    Action.DENY,
    rules=(((Match(principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/client"),)),),),),
)
# istiod's PeerAuthentication STRICT: plaintext (no principal) is denied.
DENY_PLAINTEXT = Authorization(
    "istio_converted_static_strict",
    "default",
    Scope.NAMESPACE,
    Action.DENY,
    rules=(((Match(not_principals=(StringMatch(StringMatchKind.PRESENCE),)),),),),
)


@pytest.fixture
async def node_b(tmp_path: Path) -> AsyncIterator[tuple[TwoNodeMesh, Any, HeldListener]]:
    m = TwoNodeMesh(tmp_path)
    held = HeldListener(m.node_b)
    try:
        async with running_app(m.env_b()) as b:
            yield m, b, held
    finally:
        held.close()


async def test_hbone_deny_while_connecting_answers_401(
    node_b: tuple[TwoNodeMesh, Any, HeldListener], caplog: pytest.LogCaptureFixture
) -> None:
    m, b, held = node_b
    caplog.set_level(logging.INFO, logger="access")
    authority = f"{held.address[0]}:{held.address[1]}"
    cert = LocalCA.load_or_create(m.ca_dir, "cluster.local").issue(CLIENT, timedelta(hours=1))
    conn: Any = await hbone_dial((m.node_b, 15008), cert, local_addr=(m.node_a, 0))
    try:
        async with asyncio.TaskGroup() as tg:
            request = tg.create_task(hbone_request(conn, authority))
            assert await eventually(held.syn_sent), "the connect to the app never started"
            # Allowed so far, connecting: tracked, so the policy watcher can see it.
            assert [r.hbone_target for r in b.proxy.pi.connections] == [authority]
            b.state.apply(StateUpdate(policies=[DENY_CLIENT]))
        status, _ = request.result()
    finally:
        conn.close("test done")
    assert status == 401
    assert held.syn_sent() == 0  # the app socket was closed, not left connecting
    queued = held.accept_nowait()  # the filler, and nothing of ours
    assert queued is not None
    queued.close()
    assert held.accept_nowait() is None
    lines = await eventually(lambda: access_fields(caplog.records))
    assert [(f["error"], f["dst.hbone_addr"]) for f in lines] == [
        ("connection closed due to policy change", authority)
    ], lines
    assert len(b.proxy.pi.connections) == 0


async def test_hbone_connect_held_then_released_is_not_affected(
    node_b: tuple[TwoNodeMesh, Any, HeldListener], caplog: pytest.LogCaptureFixture
) -> None:
    """The control: a held connect that no policy denies completes (after the SYN is retransmitted) and gets 200;
    an unrelated policy change meanwhile does not disturb it."""
    m, b, held = node_b
    caplog.set_level(logging.INFO, logger="access")
    authority = f"{held.address[0]}:{held.address[1]}"
    cert = LocalCA.load_or_create(m.ca_dir, "cluster.local").issue(CLIENT, timedelta(hours=1))
    conn: Any = await hbone_dial((m.node_b, 15008), cert, local_addr=(m.node_a, 0))
    try:
        async with asyncio.TaskGroup() as tg:
            request = tg.create_task(hbone_request(conn, authority))
            assert await eventually(held.syn_sent)
            b.state.apply(StateUpdate(policies=[DENY_PLAINTEXT]))  # denies plaintext only, not the client
            filler = held.release()
        status, _ = request.result()
        filler.close()
        assert status == 200
        app = held.accept_nowait()
        assert app is not None
        app.close()
    finally:
        conn.close("test done")


async def test_passthrough_deny_while_connecting_closes(
    node_b: tuple[TwoNodeMesh, Any, HeldListener], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """15006 (SO_ORIGINAL_DST stood in for: the connection is treated as captured on its way to the held app)."""
    m, b, held = node_b
    caplog.set_level(logging.INFO, logger="access")
    target: tuple[IPAddress, int] = (ipaddress.ip_address(held.address[0]), held.address[1])
    monkeypatch.setattr(sockets, "accepted_destination", lambda transport, cfg: target)
    b.state.apply(StateUpdate(removed_policies=["default/allow-client"]))  # plaintext has no principal to allow
    reader, writer = await asyncio.open_connection(m.node_b, 15006)
    writer.write(b"never delivered")
    assert await eventually(held.syn_sent), "the connect to the app never started"
    assert len(b.proxy.pi.connections) == 1
    b.state.apply(StateUpdate(policies=[DENY_PLAINTEXT]))
    try:
        data = await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        data = b""
    writer.close()
    assert data == b""
    assert held.syn_sent() == 0
    lines = await eventually(lambda: access_fields(caplog.records))
    assert [f.get("error") for f in lines] == ["connection closed due to policy change"], lines
    assert len(b.proxy.pi.connections) == 0

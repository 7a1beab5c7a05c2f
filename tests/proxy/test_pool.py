"""The HBONE connection pool (``WorkloadHBONEPool``) against real HBONE servers: in-process ztunnels on loopback.

Node B (127.0.42.2) proxies "server" with an echo app on :8080; node C (127.0.42.3) proxies "server2". The pool
under test is built the way the app builds it, for the client workload on 127.0.42.1, from the same local CA.
Mirrors upstream ``proxy/pool.rs`` tests: connections_reused, unique_keys_have_unique_connections,
connection_limits, server_goaway, idle_eviction(_with_persistent), plus coalescing and failed dials.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ztunnel.config import from_env
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.manager import LocalCertificateProvider
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.common import ProxyError, ResponseFlag, TlsContextCache
from ztunnel.proxy.hbone.connection import HboneTransport
from ztunnel.proxy.hbone.stream import HboneStream
from ztunnel.proxy.pool import WorkloadHBONEPool, WorkloadKey
from ztunnel.proxy.relay import PlainConnection
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.state.workload import IPAddress
from ztunnel.testing import EchoServer, node_env, running_app

A_IP, B_IP, C_IP = "127.0.42.1", "127.0.42.2", "127.0.42.3"
NOBODY_IP = "127.0.42.9"
TD = "cluster.local"
CLIENT_ID = Identity(TD, "default", "client")
SERVER_ID = Identity(TD, "default", "server")
SERVER2_ID = Identity(TD, "default", "server2")

CONFIG = f"""
workloads:
- uid: Kubernetes//v1/Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  workloadIps: ["{A_IP}"]
  protocol: HBONE
  node: pool-a
- uid: Kubernetes//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  workloadIps: ["{B_IP}"]
  protocol: HBONE
  node: pool-b
- uid: Kubernetes//v1/Pod/default/server2
  name: server2
  namespace: default
  serviceAccount: server2
  workloadIps: ["{C_IP}"]
  protocol: HBONE
  node: pool-c
"""


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def key_for(
    src_id: Identity = CLIENT_ID,
    dst_id: tuple[Identity, ...] = (SERVER_ID,),
    dst: str = B_IP,
    src: str = A_IP,
) -> WorkloadKey:
    return WorkloadKey(src_id, dst_id, (ip(dst), 15008), ip(src))


@dataclass
class Env:
    tmp: Path
    config: Path
    b: Any  # node B's App
    echo: EchoServer
    pools: list[WorkloadHBONEPool]
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    def pool(self, ca_dir: Path | None = None, **extra: str) -> WorkloadHBONEPool:
        """A pool for the client workload, as the app builds one (``extra``: POOL_* and other env overrides)."""
        ca = ca_dir if ca_dir is not None else self.tmp / "ca"
        cfg = from_env(node_env("pool-a", A_IP, "default/client/client", ca, config=self.config, **extra))
        certs = LocalCertificateProvider(LocalCA.load_or_create(ca, TD))
        pool = WorkloadHBONEPool(cfg, certs, SocketFactory(SocketConfig.from_config(cfg)), TlsContextCache())
        self.pools.append(pool)
        return pool

    def server_connections(self) -> int:
        return len(self.b.proxy.inbound.connections)

    async def attach(self, stream: HboneStream) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Relay the stream to one end of a socket pair; the test talks through the other end."""
        ours, theirs = socket.socketpair()
        plain = PlainConnection()
        await asyncio.get_running_loop().create_connection(lambda: plain, sock=theirs)
        stream.attach(plain)
        reader, writer = await asyncio.open_connection(sock=ours)
        self.writers.append(writer)
        return reader, writer


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    config = tmp_path / "pool.yaml"
    config.write_text(CONFIG)
    echo = await EchoServer().start(B_IP, 8080)
    async with running_app(node_env("pool-b", B_IP, "default/server/server", tmp_path / "ca", config=config)) as b:
        e = Env(tmp_path, config, b, echo, [])
        try:
            yield e
        finally:
            # Close the client side first, so node B has nothing to wait for when it drains.
            for w in e.writers:
                w.close()  # a test that failed half-way must not leave sockets for the loop to trip on
            for p in e.pools:
                p.abort("test done")
    await echo.stop()


@pytest.fixture
async def node_c(env: Env) -> AsyncIterator[Any]:
    async with running_app(node_env("pool-c", C_IP, "default/server2/server2", env.tmp / "ca", config=env.config)) as c:
        try:
            yield c
        finally:
            for p in env.pools:
                p.abort("test done")


async def open_ok(pool: WorkloadHBONEPool, key: WorkloadKey, authority: str = f"{B_IP}:8080") -> HboneStream:
    stream = await asyncio.wait_for(pool.open_stream(key, authority, []), 5)
    assert stream.response is not None
    status, _ = await asyncio.wait_for(stream.response, 5)
    assert status == 200
    return stream


def conn_of(stream: HboneStream) -> HboneTransport:
    """The pooled connection a stream was opened on."""
    assert isinstance(stream.conn, HboneTransport)
    return stream.conn


async def roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    assert await asyncio.wait_for(reader.readexactly(len(data)), 5) == data


async def finish(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream: HboneStream) -> None:
    """Close the tunnel cleanly (FIN both ways) and wait until the stream is done."""
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await eventually(lambda: stream.done)


async def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# -- reuse and keys ------------------------------------------------------------------------------------------------


async def test_connections_reused_for_same_key(env: Env) -> None:
    pool = env.pool()
    key = key_for()
    s1 = await open_ok(pool, key)
    r, w = await env.attach(s1)
    await roundtrip(r, w, b"first")
    s2 = await open_ok(pool, key)  # concurrent with s1
    assert s2.conn is s1.conn
    assert s2.stream_id != s1.stream_id
    await finish(r, w, s1)
    s3 = await open_ok(pool, key)  # after s1 finished
    assert s3.conn is s1.conn
    r3, w3 = await env.attach(s3)
    await roundtrip(r3, w3, b"third")
    await finish(r3, w3, s3)
    s2.reset()
    assert pool.dials == 1
    assert len(pool) == 1
    assert pool.connections(key) == [s1.conn]
    assert env.server_connections() == 1
    assert env.echo.connections == 3  # node B connects to the app before answering 200, s2 included


async def test_different_keys_get_different_connections(env: Env, node_c: Any) -> None:
    pool = env.pool()
    keys = {
        "base": key_for(),
        # Another source identity (the server may refuse it by policy later, but the TLS connection is its own).
        "src identity": key_for(src_id=Identity(TD, "default", "other-client")),
        # Another set of expected identities, even one that the same server satisfies.
        "dst identities": key_for(dst_id=(SERVER_ID, Identity(TD, "default", "extra"))),
        # Another downstream client IP (upstream keys on it because the source may be spoofed).
        "src ip": key_for(src="127.0.42.11"),
        "destination": key_for(dst_id=(SERVER2_ID,), dst=C_IP),
    }
    conns: dict[str, HboneTransport] = {}
    for name, key in keys.items():
        authority = f"{C_IP}:8080" if name == "destination" else f"{B_IP}:8080"
        stream = await asyncio.wait_for(pool.open_stream(key, authority, []), 5)
        conns[name] = conn_of(stream)
    assert len({id(c) for c in conns.values()}) == len(keys)
    assert pool.dials == len(keys)
    assert len(pool) == len(keys)
    for name, key in keys.items():
        assert pool.connections(key) == [conns[name]], name
    assert conns["destination"].peer is not None and conns["destination"].peer[0] == C_IP
    assert env.server_connections() == len(keys) - 1
    assert len(node_c.proxy.inbound.connections) == 1
    # Same key again: no new dial.
    again = await asyncio.wait_for(pool.open_stream(keys["src identity"], f"{B_IP}:8080", []), 5)
    assert again.conn is conns["src identity"]
    assert pool.dials == len(keys)


async def test_concurrent_requests_for_new_key_share_one_dial(env: Env) -> None:
    pool = env.pool()
    key = key_for()
    streams = await asyncio.gather(*(open_ok(pool, key) for _ in range(25)))
    assert pool.dials == 1
    assert len({id(s.conn) for s in streams}) == 1
    assert len({s.stream_id for s in streams}) == 25
    assert env.server_connections() == 1
    assert streams[0].conn is pool.connections(key)[0] and pool.connections(key)[0].stream_count == 25


# -- stream limits ---------------------------------------------------------------------------------------------------


async def test_client_stream_limit_opens_new_connection(env: Env) -> None:
    pool = env.pool(POOL_MAX_STREAMS_PER_CONNECTION="2")
    key = key_for()
    s1 = await open_ok(pool, key)
    s2 = await open_ok(pool, key)
    assert s2.conn is s1.conn
    s3 = await open_ok(pool, key)
    assert s3.conn is not s1.conn  # the first one is full
    assert pool.dials == 2
    assert len(pool.connections(key)) == 2
    # Freeing a slot makes the first connection usable again.
    r, w = await env.attach(s1)
    await roundtrip(r, w, b"x")
    await finish(r, w, s1)
    s4 = await open_ok(pool, key)
    assert s4.conn is s2.conn
    assert pool.dials == 2
    s5 = await open_ok(pool, key)
    assert s5.conn is s3.conn
    s6 = await open_ok(pool, key)
    assert s6.conn not in (s2.conn, s3.conn)
    assert pool.dials == 3
    assert all(c.stream_count <= 2 for c in pool.connections(key))


async def test_client_stream_limit_with_concurrent_requests(env: Env) -> None:
    """Upstream ``connection_limits``: a limit of 2 and 4 concurrent requests: exactly two connections."""
    pool = env.pool(POOL_MAX_STREAMS_PER_CONNECTION="2")
    key = key_for()
    streams = await asyncio.gather(*(open_ok(pool, key) for _ in range(4)))
    assert pool.dials == 2
    by_conn: dict[int, int] = {}
    for s in streams:
        by_conn[id(s.conn)] = by_conn.get(id(s.conn), 0) + 1
    assert sorted(by_conn.values()) == [2, 2]


async def test_limit_of_one_stream_per_connection(env: Env) -> None:
    """Upstream ``single_pool``: a pool size of 1 still works, one connection per concurrent stream."""
    pool = env.pool(POOL_MAX_STREAMS_PER_CONNECTION="1")
    key = key_for()
    streams = await asyncio.gather(*(open_ok(pool, key) for _ in range(3)))
    assert pool.dials == 3
    assert len({id(s.conn) for s in streams}) == 3


async def test_server_max_concurrent_streams_lower_than_pool_limit(env: Env) -> None:
    inbound = env.b.proxy.inbound
    inbound.settings = replace(inbound.settings, max_concurrent_streams=2)
    pool = env.pool()  # POOL_MAX_STREAMS_PER_CONNECTION defaults to 100
    key = key_for()
    s1 = await open_ok(pool, key)
    assert conn_of(s1).core.peer_max_streams == 2  # learnt from the server's SETTINGS
    s2 = await open_ok(pool, key)
    assert s2.conn is s1.conn
    s3 = await open_ok(pool, key)
    assert s3.conn is not s1.conn
    assert pool.dials == 2


async def test_requests_racing_the_servers_settings_all_succeed(env: Env) -> None:
    """Streams opened on a new connection before the server's SETTINGS arrive are not refused (the server applies
    its limit only once we ACK it); once the limit is known, no connection is given more streams."""
    inbound = env.b.proxy.inbound
    inbound.settings = replace(inbound.settings, max_concurrent_streams=2)
    pool = env.pool()
    key = key_for()
    streams = await asyncio.gather(*(open_ok(pool, key) for _ in range(3)))  # every one answered 200
    assert {conn_of(s).core.peer_max_streams for s in streams} == {2}
    s4 = await open_ok(pool, key)
    assert conn_of(s4).stream_count <= 2
    assert 2 <= pool.dials <= 3


# -- GOAWAY and idle eviction ------------------------------------------------------------------------------------------


async def test_server_goaway_moves_new_streams_to_new_connection(env: Env) -> None:
    pool = env.pool()
    key = key_for()
    s1 = await open_ok(pool, key)
    r1, w1 = await env.attach(s1)
    await roundtrip(r1, w1, b"before goaway")
    old = conn_of(s1)

    env.b.proxy.inbound.drain()  # GOAWAY on every server connection
    await eventually(lambda: old.goaway_received)

    s2 = await open_ok(pool, key)
    assert s2.conn is not old
    assert pool.dials == 2
    assert pool.connections(key) == [old, s2.conn] or pool.connections(key) == [s2.conn]

    # The stream opened before the GOAWAY still works, both ways, to a clean end.
    await roundtrip(r1, w1, b"after goaway")
    await finish(r1, w1, s1)
    assert s1.error is None
    # Its last stream done, the old connection closes and leaves the pool.
    await eventually(lambda: old.closed)
    assert pool.connections(key) == [s2.conn]
    r2, w2 = await env.attach(s2)
    await roundtrip(r2, w2, b"new connection")
    await finish(r2, w2, s2)


async def test_goaway_on_idle_connection_is_dropped_and_redialled(env: Env) -> None:
    """Upstream ``server_goaway``: the pooled connection is busted by the server; the next request dials anew."""
    pool = env.pool()
    key = key_for()
    s1 = await open_ok(pool, key)
    r, w = await env.attach(s1)
    await finish(r, w, s1)
    old = conn_of(s1)
    env.b.proxy.inbound.drain()
    await eventually(lambda: old.closed)
    assert pool.connections(key) == []
    s2 = await open_ok(pool, key)
    assert s2.conn is not old
    assert pool.dials == 2


async def test_idle_connection_is_evicted(env: Env) -> None:
    pool = env.pool(POOL_UNUSED_RELEASE_TIMEOUT="200ms")
    assert pool.idle_timeout == pytest.approx(0.2)
    key = key_for()
    s1 = await open_ok(pool, key)
    r, w = await env.attach(s1)
    await roundtrip(r, w, b"x")
    await finish(r, w, s1)
    conn = s1.conn
    assert not conn.closed
    await eventually(lambda: conn.closed, timeout=2.0)
    assert len(pool) == 0
    await eventually(lambda: env.server_connections() == 0, timeout=2.0)
    s2 = await open_ok(pool, key)
    assert s2.conn is not conn
    assert pool.dials == 2


async def test_connection_with_open_stream_is_not_evicted(env: Env) -> None:
    """Upstream ``idle_eviction_with_persistent``: a stream in use keeps its connection, however long."""
    pool = env.pool(POOL_UNUSED_RELEASE_TIMEOUT="100ms")
    key = key_for()
    persistent = await open_ok(pool, key)
    r, w = await env.attach(persistent)
    await asyncio.sleep(0.5)
    assert not persistent.conn.closed
    assert pool.connections(key) == [persistent.conn]
    await roundtrip(r, w, b"still here")
    await finish(r, w, persistent)
    await eventually(lambda: persistent.conn.closed, timeout=2.0)
    assert len(pool) == 0


# -- failures -------------------------------------------------------------------------------------------------------


def assert_nothing_pooled(pool: WorkloadHBONEPool) -> None:
    assert len(pool) == 0
    assert pool.connections() == []
    assert pool.dials == 0
    assert not pool._dialing


async def test_dial_to_nothing_listening(env: Env) -> None:
    pool = env.pool()
    key = key_for(dst=NOBODY_IP)
    with pytest.raises(ProxyError, match=f"failed to connect to {NOBODY_IP}:15008") as err:
        await pool.open_stream(key, f"{NOBODY_IP}:8080", [])
    assert err.value.flag is ResponseFlag.CONNECT
    assert_nothing_pooled(pool)


async def test_concurrent_requests_share_a_failed_dial(env: Env) -> None:
    pool = env.pool()
    key = key_for(dst=NOBODY_IP)
    results = await asyncio.gather(
        *(pool.open_stream(key, f"{NOBODY_IP}:8080", []) for _ in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, ProxyError) for r in results), results
    assert_nothing_pooled(pool)


async def test_server_identity_mismatch(env: Env) -> None:
    """A server of another identity: refused, CONNECT as upstream's failed client handshake (upstream's binary counts
    a wrong SAN, an unknown root and a CA as the leaf all as CONNECT at the source)."""
    pool = env.pool()
    key = key_for(dst_id=(Identity(TD, "default", "someone-else"),))
    with pytest.raises(ProxyError) as err:
        await pool.open_stream(key, f"{B_IP}:8080", [])
    assert err.value.flag is ResponseFlag.CONNECT
    assert "someone-else" in str(err.value) or "identity" in str(err.value).lower()
    assert_nothing_pooled(pool)
    # The right identity on the same address works, and is its own key.
    await open_ok(pool, key_for())
    assert pool.dials == 1


async def test_server_from_another_ca_fails_the_connection(env: Env) -> None:
    pool = env.pool(ca_dir=env.tmp / "other-ca")  # trusts a different root: the server's chain fails
    with pytest.raises(ProxyError) as err:
        await pool.open_stream(key_for(), f"{B_IP}:8080", [])
    assert err.value.flag is ResponseFlag.CONNECT
    assert "TLS" in str(err.value)
    assert_nothing_pooled(pool)


async def test_no_certificate_for_the_source_is_an_identity_error(env: Env) -> None:
    """The source's certificate cannot be had (here a local CA that refuses to sign): upstream's Error::Identity,
    IDENTITY_ERROR, the reason in the message; nothing dialled."""
    pool = env.pool()
    pool._certs = LocalCertificateProvider(LocalCA.load_or_create(env.tmp / "ca", TD), ttl=timedelta(seconds=-10))
    with pytest.raises(ProxyError) as err:
        await pool.open_stream(key_for(), f"{B_IP}:8080", [])
    assert err.value.flag is ResponseFlag.IDENTITY_ERROR
    assert f"no certificate for {CLIENT_ID}" in str(err.value) and "ttl must be positive" in str(err.value)
    assert_nothing_pooled(pool)


async def test_a_connection_out_of_stream_ids_is_left_for_a_new_one(env: Env) -> None:
    """A long-lived pooled connection that used its 2^30 client stream ids takes no more: the next request dials a
    new connection instead of failing (it raised StreamLimitError out of the pool, for every later request too)."""
    pool = env.pool()
    first = await open_ok(pool, key_for())
    worn = conn_of(first)
    worn.core._next_stream_id = 2**31 + 1  # as after 2^30 streams
    second = await open_ok(pool, key_for())
    assert conn_of(second) is not worn and pool.dials == 2
    assert worn.draining and not worn.closed  # its open stream may finish
    first.reset()
    await eventually(lambda: worn.closed)


async def test_closed_pool_refuses_new_streams(env: Env) -> None:
    pool = env.pool()
    s1 = await open_ok(pool, key_for())
    pool.close()
    await asyncio.sleep(0.05)  # let whatever close() sent reach the server
    with pytest.raises(ProxyError, match="shutting down"):
        await pool.open_stream(key_for(), f"{B_IP}:8080", [])
    # The stream that was open keeps working until it ends; then the connection closes.
    r, w = await env.attach(s1)
    await roundtrip(r, w, b"draining")
    await finish(r, w, s1)
    await eventually(lambda: s1.conn.closed)

"""Pool checkout against a real inbound: a CONNECT stream opened on a warm pooled HBONE connection, answered 200.

Node B is a real ztunnel (:func:`ztunnel.testing.running_app`, in this process and on this event loop) whose app is
the benchmark server in its own process; the pool is node A's, built as the app builds it. One operation: take a
pooled connection, send the CONNECT, node B checks policy and connects to the app, the 200 comes back; then the
stream is reset (node B closes its app connection). So it is both ends' work for one tunnel, minus the client's
TCP socket, plus one ``run_until_complete`` (``test_loop_overhead`` measures that alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvloop
from pytest_benchmark.fixture import BenchmarkFixture

from ztunnel.config import from_env
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.manager import LocalCertificateProvider
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.common import TlsContextCache
from ztunnel.proxy.hbone.core import ErrorCode
from ztunnel.proxy.pool import WorkloadHBONEPool, WorkloadKey
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.state.workload import canonical_ip
from ztunnel.testing import TwoNodeMesh, running_app

TD = "cluster.local"
CLIENT_ID = Identity(TD, "default", "client")
SERVER_ID = Identity(TD, "default", "server")


@dataclass
class Node:
    loop: asyncio.AbstractEventLoop
    pool: WorkloadHBONEPool
    key: WorkloadKey
    authority: str
    headers: list[tuple[str, str]]


@pytest.fixture
def node() -> Iterator[Node]:
    import ipaddress

    workdir = Path(tempfile.mkdtemp(prefix="bench-micro-pool-"))
    mesh = TwoNodeMesh(workdir)
    LocalCA.load_or_create(mesh.ca_dir, TD)
    host, port = mesh.server_app
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.server", "--listen", f"{host}:{port}"], stdout=subprocess.PIPE
    )
    assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
    loop = uvloop.new_event_loop()
    stack = contextlib.AsyncExitStack()
    try:
        loop.run_until_complete(stack.enter_async_context(running_app(mesh.env_b(RUST_LOG="error"))))
        cfg = from_env(mesh.env_a())
        certs = LocalCertificateProvider(LocalCA.load_or_create(mesh.ca_dir, TD))
        pool = WorkloadHBONEPool(cfg, certs, SocketFactory(SocketConfig.from_config(cfg)), TlsContextCache())
        key = WorkloadKey(
            CLIENT_ID,
            (SERVER_ID,),
            (canonical_ip(ipaddress.ip_address(mesh.node_b)), 15008),
            canonical_ip(ipaddress.ip_address(mesh.node_a)),
        )
        headers = [
            ("baggage", "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=client"),
            ("forwarded", f'for="{mesh.node_a}:40000"'),
            ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ]
        yield Node(loop, pool, key, f"{host}:{port}", headers)
        pool.abort("benchmark done")
    finally:
        loop.run_until_complete(stack.aclose())
        loop.close()
        server.terminate()
        server.wait()
        server.stdout.close()


async def _checkout(n: Node) -> int:
    stream = await n.pool.open_stream(n.key, n.authority, n.headers)
    assert stream.response is not None
    status, _ = await stream.response
    stream.reset(ErrorCode.CANCEL)
    return status


def test_pool_checkout(benchmark: BenchmarkFixture, node: Node) -> None:
    assert node.loop.run_until_complete(_checkout(node)) == 200  # the dial: not measured
    dials = node.pool.dials

    def checkout() -> Any:
        return node.loop.run_until_complete(_checkout(node))

    assert benchmark(checkout) == 200
    assert node.pool.dials == dials, "every measured stream must reuse the pooled connection"


def test_loop_overhead(benchmark: BenchmarkFixture) -> None:
    """What one ``run_until_complete`` costs by itself (subtract it from ``test_pool_checkout``)."""
    loop = uvloop.new_event_loop()

    async def nothing() -> None:
        return None

    try:
        benchmark(lambda: loop.run_until_complete(nothing()))
    finally:
        loop.close()

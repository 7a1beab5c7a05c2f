"""Faults of the control plane, against real ztunnel processes: down at start, and answering garbage.

The ztunnels run with ``FAKE_CA=false`` against the local control plane (``ztunnel/standins/istiod/server.py``) on a
random loopback block (:class:`~ztunnel.testing.TwoNodeMesh`, served over xDS instead of from a file). What must hold
(ztunnel-facts §6, upstream ``xds/client.rs`` and ``identity/manager.rs``): not ready until the first xDS sync;
reconnects with backoff (10 ms doubling to 15 s) rather than a loop, measured as CPU time; a clear log line per failure
and never a traceback; the last good state keeps being served; a connection that finds no certificate fails with the
reason instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from xds.envoy.service.discovery.v3 import discovery_pb2 as pb
from xds.istio.security import authorization_pb2 as authz_pb
from ztunnel.identity.spiffe import Identity
from ztunnel.standins.istiod.server import XdsServer, issue_server_certificate
from ztunnel.testing import EchoServer, TwoNodeMesh, ZtunnelProcess
from ztunnel.testing.control_plane import wait_until
from ztunnel.xds.types import ADDRESS_TYPE

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <_io.FileIO name='[^']*\.log':pytest.PytestUnraisableExceptionWarning"
)

TD = "cluster.local"
CLIENT = Identity(TD, "default", "client")
SERVER = Identity(TD, "default", "server")
TOKENS = {"tok-a": CLIENT, "tok-b": SERVER}
ADS_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def readiness(ip: str) -> tuple[int, str] | None:
    """``GET /healthz/ready`` on ``ip``:15021: (status, body), or None if nothing answers."""
    try:
        with socket.create_connection((ip, 15021), timeout=1) as s:
            s.sendall(b"GET /healthz/ready HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    except OSError:
        return None
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def cp_env(env: dict[str, str], xds: XdsServer, ca: XdsServer, token: str) -> dict[str, str]:
    """A node's environment switched from the local config and fake CA to ``xds`` and ``ca``."""
    env = dict(env)
    del env["LOCAL_XDS_PATH"]
    assert xds.root_cert_path is not None and ca.root_cert_path is not None
    env.update(
        XDS_ADDRESS=xds.url,
        CA_ADDRESS=ca.url,
        XDS_ROOT_CA=str(xds.root_cert_path),
        CA_ROOT_CA=str(ca.root_cert_path),
        FAKE_CA="false",
        AUTH_TOKEN=token,
    )
    return env


def log_of(node: ZtunnelProcess) -> str:
    assert node.log_path is not None
    return node.log_path.read_text()


def retry_delays(text: str, reason: str = "") -> list[float]:
    """The delays of the xDS client's "retrying in ..." lines (that mention ``reason``), in seconds, in order."""
    out = []
    for line in text.splitlines():
        found = re.search(r"XDS client (?:connection )?error: .*, retrying in ([\d.]+)(ms|s)$", line)
        if found and reason in line:
            out.append(float(found[1]) / (1000 if found[2] == "ms" else 1))
    return out


# What node A logs for each kind of garbage.
ERRORS = {
    "bytes": "XDS client error: the server sent 33 bytes that are not a DeltaDiscoveryResponse (system_version_info "
    "at byte 0: length 33554431 runs past the end of its message (28 left))",
    "abort": 'status: Internal, message: "control plane exploded"',
    "empty": "ended the stream without sending a response",
}


async def echo_once(m: TwoNodeMesh, msg: bytes = b"ping") -> bool:
    """One connection from node A's workload to the echo service VIP; True if the echo came back."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(m.socks5(), 5)
        writer.write(msg)
        return await asyncio.wait_for(reader.readexactly(len(msg)), 5) == msg
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        return False
    finally:
        if writer is not None:
            writer.close()


@pytest.fixture
async def nodes() -> AsyncIterator[list[ZtunnelProcess]]:
    started: list[ZtunnelProcess] = []
    yield started
    for node in started:
        if node.proc is not None:
            await asyncio.to_thread(node.stop)


def resynced(cp: XdsServer, since: int) -> bool:
    """Both nodes opened a stream after the first ``since`` sessions and subscribed on it."""
    return len(cp.sessions) >= since + 2 and all(s.subscriptions for s in cp.sessions[since:])


def cp_host(m: TwoNodeMesh) -> str:
    """A loopback address of the mesh's block that no node uses: where the control plane listens."""
    return m.node_a.rsplit(".", 1)[0] + ".2"


# -- down at start -----------------------------------------------------------------------------------------------


async def unanswered_greeting(m: TwoNodeMesh) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Node A before its first xDS sync: not ready for that reason, and its listeners bound but accepting nothing
    (upstream's accept loops wait on the sync): a SOCKS5 greeting waits in the backlog, unanswered. Returns the
    connection, which is answered once xDS is in."""
    await wait_until(lambda: readiness(m.node_a) == (500, "not ready, pending: state manager\n"), 20, 0.05)
    reader, writer = await asyncio.open_connection(m.node_a, 15080)
    writer.write(b"\x05\x01\x00")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(2), 0.5)
    return reader, writer


async def test_inline_listeners_accept_only_after_the_first_sync(tmp_path: Path, nodes: list[ZtunnelProcess]) -> None:
    """The one-process model too (ZTUNNEL_INLINE_DATA_PLANE=true): bound at start, accepting once xDS is in."""
    m = TwoNodeMesh(tmp_path)
    xds = XdsServer.from_ca_dir(tmp_path / "cp-ca", listen=f"{cp_host(m)}:15012", tokens=TOKENS)
    xds.set_config(m.config.read_text())
    env = cp_env(m.env_a(ZTUNNEL_INLINE_DATA_PLANE="true"), xds, xds, "tok-a")
    a = ZtunnelProcess(env, tmp_path / "a.log").start(wait_ready=False)
    nodes.append(a)
    try:
        r, w = await unanswered_greeting(m)
        await xds.start()
        assert await asyncio.wait_for(r.readexactly(2), 10) == b"\x05\x00"
        w.close()
        await wait_until(lambda: readiness(m.node_a) == (200, "ready\n"), 5, 0.05)
    finally:
        await xds.stop()


async def test_control_plane_and_ca_down_at_start(tmp_path: Path, nodes: list[ZtunnelProcess]) -> None:
    m = TwoNodeMesh(tmp_path)
    host = cp_host(m)
    # xDS and the CA as two servers (same root), so they can come up one after the other.
    xds = XdsServer.from_ca_dir(tmp_path / "cp-ca", listen=f"{host}:15012", tokens=TOKENS)
    ca = XdsServer.from_ca_dir(tmp_path / "cp-ca", listen=f"{host}:15013", tokens=TOKENS)
    for server in (xds, ca):
        server.set_config(m.config.read_text())
    echo = await EchoServer().start(*m.server_app)
    a = ZtunnelProcess(cp_env(m.env_a(), xds, ca, "tok-a"), tmp_path / "a.log").start(wait_ready=False)
    nodes.append(a)
    assert a.proc is not None
    try:
        # Nothing listens at the control plane's address: the process is up, but not ready, and says why (once its
        # worker processes are up, "workers" is no longer pending; the state manager stays); nothing is accepted.
        early_r, early_w = await unanswered_greeting(m)
        # It retries with backoff, not in a loop: a few seconds cost it next to no CPU.
        cpu0, t0 = cpu_seconds(a.proc.pid), time.monotonic()
        await asyncio.sleep(2.0)
        cpu = cpu_seconds(a.proc.pid) - cpu0
        wall = time.monotonic() - t0
        assert readiness(m.node_a) == (500, "not ready, pending: state manager\n")
        delays = retry_delays(log_of(a))
        assert len(delays) >= 5, log_of(a)
        assert delays[:5] == [0.02, 0.04, 0.08, 0.16, 0.32], delays  # 10 ms doubling, as upstream
        assert "XDS client connection error: gRPC connection error connecting to " in log_of(a)
        print(f"control plane down: {len(delays)} attempts, {cpu * 1000:.0f} ms CPU in {wall:.1f} s")
        assert cpu < 0.1 * wall, f"{cpu:.2f}s CPU in {wall:.1f}s while the control plane is down"

        # xDS appears (the CA is still down): ready within the next backoff step.
        await xds.start()
        up = time.monotonic()
        await wait_until(lambda: readiness(m.node_a) == (200, "ready\n"), 10, interval=0.02)
        assert time.monotonic() - up < 2 * delays[-1] + 1.0
        assert await asyncio.wait_for(early_r.readexactly(2), 5) == b"\x05\x00"  # accepted now, same connection
        early_w.close()
        # A connection now needs the client's certificate, and the CA is down: it fails at once, with the reason.
        t = time.monotonic()
        assert not await echo_once(m)
        assert time.monotonic() - t < 5
        await wait_until(lambda: "no certificate for spiffe://cluster.local/ns/default/sa/client" in log_of(a), 5)
        assert re.search(
            r'connection (complete|failed).*error="no certificate for .*/sa/client: .*UNAVAILABLE', log_of(a)
        )

        # The CA appears, node B starts: the certificate retry (1 s backoff) succeeds and traffic flows.
        await ca.start()
        nodes.append(
            await asyncio.to_thread(ZtunnelProcess(cp_env(m.env_b(), xds, ca, "tok-b"), tmp_path / "b.log").start)
        )
        deadline = time.monotonic() + 10
        while not await echo_once(m):
            assert time.monotonic() < deadline, "no traffic after the control plane and the CA came up"
            await asyncio.sleep(0.1)
        assert {r.metadata.get("authorization") for r in ca.ca_requests} == {"Bearer tok-a", "Bearer tok-b"}
        assert "Traceback" not in log_of(a) and a.proc.poll() is None
    finally:
        await echo.stop()
        await xds.stop()
        await ca.stop()


# -- garbage -----------------------------------------------------------------------------------------------------


class GarbageAds:
    """A gRPC server on the ADS method whose answers the test chooses (raw bytes in and out):

    * ``bytes``: bytes that are not a ``DeltaDiscoveryResponse``;
    * ``bad-resources``: a valid response whose resources do not decode (corrupt bytes, another type's payload);
    * ``abort``: the stream fails with ``INTERNAL`` at once;
    * ``empty``: the stream ends with status OK and no message once the first request is in.

    Records every stream (monotonic time and the caller's token) and every request it reads.
    """

    def __init__(self, server: XdsServer) -> None:
        self.cp = server
        self.mode = "bytes"
        self.streams: list[tuple[float, str, str]] = []
        self.requests: list[tuple[str, pb.DeltaDiscoveryRequest]] = []
        self._server: Any = None

    async def start(self, mode: str) -> None:
        self.mode = mode
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        handler = grpc.method_handlers_generic_handler(
            "envoy.service.discovery.v3.AggregatedDiscoveryService",
            {"DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(self._stream)},
        )
        server.add_generic_rpc_handlers((handler,))
        chain, key = issue_server_certificate(
            self.cp.ca, ["localhost"], ["127.0.0.1", self.cp.host], Identity(TD, "istio-system", "istiod")
        )
        assert server.add_secure_port(f"{self.cp.host}:{self.cp.port}", grpc.ssl_server_credentials([(key, chain)]))
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    def nacks(self, token: str) -> list[pb.DeltaDiscoveryRequest]:
        return [r for t, r in self.requests if t == f"Bearer {token}" and r.response_nonce == "garbage-1"]

    def streams_of(self, token: str, mode: str) -> list[float]:
        return [t for t, tok, md in self.streams if tok == f"Bearer {token}" and md == mode]

    async def _stream(self, request_iterator: Any, context: Any) -> None:
        token = dict(context.invocation_metadata()).get("authorization", "")
        mode = self.mode
        self.streams.append((time.monotonic(), token, mode))
        if mode == "abort":
            await context.abort(grpc.StatusCode.INTERNAL, "control plane exploded")
        first = await context.read()
        if mode == "empty":
            return
        self.requests.append((token, pb.DeltaDiscoveryRequest.FromString(first)))
        if mode == "bytes":
            await context.write(b"\x0a\xff\xff\xff\x0fnot a DeltaDiscoveryResponse")
        else:
            policy = authz_pb.Authorization(name="p", namespace="default").SerializeToString()
            response = pb.DeltaDiscoveryResponse(type_url=ADDRESS_TYPE, nonce="garbage-1", system_version_info="x")
            response.resources.add(name="corrupt", version="1").resource.Pack(pb.Resource())
            response.resources[0].resource.type_url = ADDRESS_TYPE
            response.resources[0].resource.value = b"\x0a\xff\xff\xff\x0f"
            wrong = response.resources.add(name="Kubernetes//v1/Pod/default/wrong-type", version="1")
            wrong.resource.type_url = ADDRESS_TYPE
            wrong.resource.value = policy
            await context.write(response.SerializeToString())
        while (req := await context.read()) is not grpc.aio.EOF:
            self.requests.append((token, pb.DeltaDiscoveryRequest.FromString(req)))


async def test_control_plane_sends_garbage(tmp_path: Path, nodes: list[ZtunnelProcess]) -> None:
    m = TwoNodeMesh(tmp_path)
    cp = XdsServer.from_ca_dir(tmp_path / "cp-ca", listen=f"{cp_host(m)}:15012", tokens=TOKENS)
    cp.set_config(m.config.read_text())
    await cp.start()
    garbage = GarbageAds(cp)
    echo = await EchoServer().start(*m.server_app)
    try:
        a, b = await asyncio.gather(
            asyncio.to_thread(ZtunnelProcess(cp_env(m.env_a(), cp, cp, "tok-a"), tmp_path / "a.log").start),
            asyncio.to_thread(ZtunnelProcess(cp_env(m.env_b(), cp, cp, "tok-b"), tmp_path / "b.log").start),
        )
        nodes.extend((a, b))
        assert await echo_once(m)
        workloads = len(cp.snapshot.of(ADDRESS_TYPE))

        for mode in ("bytes", "abort", "empty", "bad-resources"):
            # The control plane is replaced by one answering garbage, on the same address.
            sessions, mark = len(cp.sessions), len(log_of(a))
            await cp.stop()
            await garbage.start(mode)
            if mode == "bad-resources":
                # The response is NACKed, naming each resource; the stream stays up.
                await wait_until(lambda: garbage.nacks("tok-a"), 5)
                (nack,) = garbage.nacks("tok-a")
                assert nack.error_detail.message.startswith("corrupt: decode: "), nack.error_detail.message
                assert "wrong-type" in nack.error_detail.message, nack.error_detail.message
                assert len(garbage.streams_of("tok-a", mode)) == 1
                await wait_until(lambda: "type=NACK error=corrupt: decode" in log_of(a), 5)
            else:
                # Each attempt fails with a clear log line, and the next one waits twice as long (from 20 ms: the
                # stream the real control plane's exit broke is retried after 10 ms).
                await wait_until(lambda: len(retry_delays(log_of(a)[mark:])) >= 5, 10)  # noqa: B023
                assert ERRORS[mode] in log_of(a)[mark:]
                delays = retry_delays(log_of(a)[mark:])
                assert all(abs(y / x - 2) < 0.1 for x, y in itertools.pairwise(delays)), delays
                # As the server sees it: five attempts took at least the four shortest waits, 20 + 40 + 80 + 160 ms.
                times = garbage.streams_of("tok-a", mode)[:5]
                assert len(times) == 5 and times[-1] - times[0] >= 0.3 * 0.95, times
            # Meanwhile the last good state is served: same workloads, ready, traffic flows.
            assert readiness(m.node_a) == (200, "ready\n")
            assert await echo_once(m), mode
            await garbage.stop()
            # The real control plane comes back: node A reconnects, holding the versions of its state.
            await cp.start()
            await wait_until(lambda: resynced(cp, sessions), 10)  # noqa: B023
            assert len(cp.snapshot.of(ADDRESS_TYPE)) == workloads

        text = log_of(a)
        assert 'status: Internal, message: "control plane exploded"' in text
        assert "Traceback" not in text and "Traceback" not in log_of(b)
        assert a.proc is not None and a.proc.poll() is None
        assert await echo_once(m)
    finally:
        await garbage.stop()
        await echo.stop()
        await cp.stop()

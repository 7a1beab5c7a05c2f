"""Test toolkit shipped with the package (like ``trio.testing``): servers, clients and node set-ups on loopback.

Used by the test suite, ``make demo`` and the benchmark. Nothing here is mocked: real sockets, real TLS, real
ztunnel processes or in-process apps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import os
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple, TypeVar

if TYPE_CHECKING:
    from ztunnel.testing.netns import Netns

T = TypeVar("T")

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
TWO_NODE = EXAMPLES / "two-node.yaml"

# The two-node example: node A proxies "client" (127.0.1.1), node B proxies "server" (127.0.2.1), whose app
# listens on 127.0.2.1:8080 behind the service VIP 127.10.0.10:80.
NODE_A_IP = "127.0.1.1"
NODE_B_IP = "127.0.2.1"
SERVER_APP = ("127.0.2.1", 8080)
SERVICE_VIP = ("127.10.0.10", 80)


def node_env(
    node: str,
    ip: str,
    workload: str,
    ca_dir: str | Path,
    config: str | Path = TWO_NODE,
    **extra: str,
) -> dict[str, str]:
    """Environment for a dedicated-mode ztunnel whose listeners all bind ``ip`` (admin/stats/readiness too)."""
    env = {
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "ZTUNNEL_CA_DIR": str(ca_dir),
        "LOCAL_XDS_PATH": str(config),
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": workload,
        "NODE_NAME": node,
        "ZTUNNEL_INBOUND_ADDR": f"{ip}:15008",
        "ZTUNNEL_OUTBOUND_ADDR": f"{ip}:15001",
        "ZTUNNEL_INBOUND_PLAINTEXT_ADDR": f"{ip}:15006",
        "ZTUNNEL_SOCKS5_ADDR": f"{ip}:15080",
        "ZTUNNEL_ADMIN_ADDR": f"{ip}:15000",
        "ZTUNNEL_STATS_ADDR": f"{ip}:15020",
        "ZTUNNEL_READINESS_ADDR": f"{ip}:15021",
        "ISTIO_META_DNS_PROXY_ADDR": f"{ip}:15053",  # the DNS proxy; the default (localhost) would clash
        "UNSTABLE_ENABLE_SOCKS5": "true",
    }
    env.update(extra)
    return env


class EchoServer:
    """A TCP echo server. Half-close aware: the client's FIN is answered with FIN after the echo.

    With ``greet`` every connection first gets one line ``peer=<ip>\n`` naming the address the server sees the
    client at (so a test can tell a spoofed source from the proxy's own address)."""

    def __init__(self, mode: str = "echo", greet: bool = False) -> None:
        self.mode = mode  # "echo", "reset" (RST after the first bytes), "sink" (read and count)
        self.greet = greet
        self.server: asyncio.Server | None = None
        self.received = 0
        self.connections = 0

    async def start(self, host: str | None = None, port: int = 0, *, sock: socket.socket | None = None) -> EchoServer:
        """Listen on ``host:port``, or on the listening ``sock`` (e.g. one made in a network namespace)."""
        if sock is not None:
            self.server = await asyncio.start_server(self._handle, sock=sock)
        else:
            self.server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
        return self

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.greet:
                writer.write(f"peer={writer.get_extra_info('peername')[0]}\n".encode())
            while True:
                data = await reader.read(1 << 18)
                if not data:
                    break
                self.received += len(data)
                if self.mode == "reset":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if self.mode == "echo":
                    writer.write(data)
                    await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)


class HeldListener:
    """A TCP listener whose accept queue is full, so a connect to it hangs: the kernel drops its SYNs (it stays in
    SYN_SENT and retransmits after 1 s, 3 s, ...) until :meth:`release` makes room. Holds an app's connect open
    for as long as a test needs, with no timing involved."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.bind((host, 0))
        self.sock.listen(0)  # Linux queues backlog + 1 = one connection
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.filler = socket.create_connection(self.address)  # completes at once, and fills the queue

    def syn_sent(self) -> int:
        """How many sockets on this host are connecting to us and still waiting (state SYN_SENT)."""
        ip = ipaddress.ip_address(self.address[0])
        if ip.version == 4:
            path, addr = "/proc/net/tcp", f"{int.from_bytes(ip.packed, 'little'):08X}"
        else:
            path = "/proc/net/tcp6"
            addr = "".join(f"{int.from_bytes(ip.packed[i : i + 4], 'little'):08X}" for i in range(0, 16, 4))
        remote = f"{addr}:{self.address[1]:04X}"
        with open(path) as f:
            return sum(1 for line in f if line.split()[2:4] == [remote, "02"])

    def release(self) -> socket.socket:
        """Accept the filler: the next retransmitted SYN gets in. Returns the filler's server side."""
        conn, _ = self.sock.accept()
        return conn

    def accept_nowait(self) -> socket.socket | None:
        """A queued connection, or None when none is waiting."""
        self.sock.setblocking(False)
        try:
            return self.sock.accept()[0]
        except BlockingIOError:
            return None
        finally:
            self.sock.setblocking(True)

    def close(self) -> None:
        self.filler.close()
        self.sock.close()


async def eventually(check: Callable[[], T], timeout: float = 5.0, until: Callable[[T], object] = bool) -> T:
    """Poll ``check`` every 10 ms until ``until`` holds for its result (by default: it is truthy), at most
    ``timeout`` seconds; e.g. an access line or a sample written a moment after the client saw the end. Returns the
    last result, whether or not it got there, so the caller's assert says what was missing."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = check()
        if until(got) or loop.time() >= deadline:
            return got
        await asyncio.sleep(0.01)


def access_fields(records: Iterable[logging.LogRecord], direction: str = "inbound") -> list[dict[str, Any]]:
    """The fields of each access-log ``connection complete`` record of ``direction`` (e.g. pytest's
    ``caplog.records``), in order."""
    out = []
    for r in records:
        fields = getattr(r, "fields", None)
        if fields is not None and r.getMessage() == "connection complete" and fields.get("direction") == direction:
            out.append(dict(fields))
    return out


class Sample(NamedTuple):
    """One metric sample as scraped."""

    name: str
    labels: dict[str, str]
    value: float


def scrape_now(host: str, port: int = 15020) -> list[Sample]:
    """Every sample on a ztunnel's stats port, blocking (both this project and upstream serve OpenMetrics text).
    Call it through :func:`scrape` from a loop that runs a ztunnel, or through ``Netns.run`` in a namespace."""
    import urllib.request

    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        text = str(resp.read().decode())
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(text)  # type: ignore[no-untyped-call]
        for s in fam.samples
    ]


async def scrape(host: str, port: int = 15020) -> list[Sample]:
    """:func:`scrape_now` in a thread: the ztunnel may be running on this event loop."""
    return await asyncio.to_thread(scrape_now, host, port)


async def socks5_connect(
    proxy: tuple[str, int], host: str, port: int, local_addr: tuple[str, int] | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A SOCKS5 CONNECT (no auth) through ``proxy``, from ``local_addr`` if given; raises ConnectionError with the
    reply code on failure."""
    reader, writer = await asyncio.open_connection(*proxy, local_addr=local_addr)
    writer.write(b"\x05\x01\x00")
    if await reader.readexactly(2) != b"\x05\x00":
        raise ConnectionError("SOCKS5 method negotiation failed")
    try:
        addr = b"\x01" + socket.inet_pton(socket.AF_INET, host)
    except OSError:
        try:
            addr = b"\x04" + socket.inet_pton(socket.AF_INET6, host)
        except OSError:
            addr = b"\x03" + bytes([len(host)]) + host.encode()
    writer.write(b"\x05\x01\x00" + addr + struct.pack("!H", port))
    head = await reader.readexactly(4)
    tail = 4 + 2 if head[3] == 1 else 16 + 2
    await reader.readexactly(tail)
    if head[1] != 0:
        writer.close()
        raise ConnectionError(f"SOCKS5 reply {head[1]}")
    return reader, writer


# The ztunnel processes with a log file that are running or stopped during the running test: tests/conftest.py
# attaches their logs' tails to a failing test's report, so a failure in CI says what the process under test did.
PROCESS_LOGS: list[ZtunnelProcess] = []


class ZtunnelProcess:
    """``python -m ztunnel`` in a subprocess, ready once its readiness probe answers 200.

    ``argv`` runs another ztunnel instead of ``python -m ztunnel proxy`` (upstream's binary: ``[path, "proxy",
    "ztunnel"]``); ``prefix`` is put before the command (e.g. ``setpriv`` to drop capabilities); ``netns`` (a
    :class:`ztunnel.testing.netns.Netns`) runs it, and probes its readiness, inside that network namespace.
    ``kill_with_parent`` has the kernel SIGKILL it when the thread that called :meth:`start` exits (PR_SET_PDEATHSIG,
    set by util-linux's ``setpriv``), so a test process killed mid-run leaves no proxy behind: start it from a thread
    that outlives it (the main one).
    """

    def __init__(
        self,
        env: Mapping[str, str],
        log_path: Path | None = None,
        *,
        argv: Sequence[str] | None = None,
        netns: Netns | None = None,
        prefix: Sequence[str] = (),
        kill_with_parent: bool = False,
    ) -> None:
        self.env = {"PATH": os.environ.get("PATH", ""), **env}
        self.log_path = log_path
        self.argv = list(argv) if argv is not None else [sys.executable, "-m", "ztunnel", "proxy"]
        self.netns = netns
        self.prefix = list(prefix)
        self.kill_with_parent = kill_with_parent
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = 20.0, wait_ready: bool = True) -> ZtunnelProcess:
        """Start the process and wait (up to ``timeout``) until it is ready, or only start it (``wait_ready``)."""
        if self.log_path is not None:
            self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            if self not in PROCESS_LOGS:  # started again (a restart): its log once
                PROCESS_LOGS.append(self)
        out = self._log if self._log is not None else subprocess.DEVNULL
        argv = [*self.prefix, *self.argv]
        if self.kill_with_parent:
            argv = with_parent_death_signal(argv)
        if self.netns is not None:
            argv = self.netns.command(argv)
        self.proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        if not wait_ready:
            return self
        host, _, port = self.env.get("ZTUNNEL_READINESS_ADDR", "127.0.0.1:15021").rpartition(":")
        host = host.strip("[]")
        if host in ("::", "0.0.0.0"):  # the default wildcard: probe over loopback
            host = "127.0.0.1"

        def ready() -> bool:
            try:
                with socket.create_connection((host, int(port)), timeout=1) as s:
                    s.sendall(b"GET /healthz/ready HTTP/1.0\r\n\r\n")
                    return b" 200 " in s.recv(100)
            except OSError:
                return False

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ztunnel exited with {self.proc.returncode}; log: {self.log_path}")
            if self.netns.run(ready) if self.netns is not None else ready():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"ztunnel not ready after {timeout}s; log: {self.log_path}")

    def children(self) -> list[int]:
        """The pids of the process's children now (its worker processes), from ``/proc``."""
        assert self.proc is not None
        return children_of(self.proc.pid)

    def stop(self, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode


def children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s children (``/proc/<pid>/task/*/children``); none once it is gone."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    return sorted(out)


def worker_pids(log: str) -> dict[int, int]:
    """{worker index: pid} of the worker processes a ztunnel's log says it started, the latest of each."""
    import re

    return {int(i): int(pid) for i, pid in re.findall(r"worker (\d+) started \(pid (\d+)\)", log)}


def with_parent_death_signal(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so the process gets SIGKILL when the thread that starts it exits (``setpriv --pdeathsig``;
    it survives the exec into ``argv`` and through ``ip netns exec``). No ``preexec_fn``: forking a threaded
    interpreter into Python code is unsafe."""
    return ["setpriv", "--pdeathsig", "KILL", "--", *argv]


@contextlib.asynccontextmanager
async def running_app(env: Mapping[str, str]) -> AsyncIterator[object]:
    """An in-process ztunnel (``App``) started from ``env``, drained on exit. Its data plane runs on the test's
    loop (``ZTUNNEL_INLINE_DATA_PLANE=true`` unless ``env`` says otherwise), so a test can reach into it; worker
    processes are tested through :class:`ZtunnelProcess`."""
    from ztunnel.app import build
    from ztunnel.config import from_env

    app = build(from_env({"ZTUNNEL_INLINE_DATA_PLANE": "true", **env}))
    await app.start()
    try:
        yield app
    finally:
        app.shutdown()
        await app.wait()


def hbone_transport(client_side: bool, ctx: ssl.SSLContext, done: asyncio.Future[Any]) -> Any:
    """An ``HboneTransport`` (our HTTP/2 core over TLS) that resolves ``done`` with itself once the TLS handshake is
    done, or fails it with ``ConnectionError(reason)`` if the connection closes first."""
    from ztunnel.proxy.hbone.connection import HboneTransport
    from ztunnel.proxy.hbone.core import HboneConnection

    def handshake(t: HboneTransport) -> None:
        if not done.done():
            done.set_result(t)

    def closed(t: HboneTransport) -> None:
        if not done.done():
            done.set_exception(ConnectionError(str(t.close_reason)))

    return HboneTransport(HboneConnection(client_side), ctx, on_handshake=handshake, on_closed=closed)


async def hbone_dial(
    addr: tuple[str, int],
    cert: object,
    verify_server: object = None,
    local_addr: tuple[str, int] | None = None,
    settle: float = 0.05,
) -> object:
    """A raw HBONE client connection (our HTTP/2 core over TLS) to ``addr``, presenting ``cert``.

    Returns the connected :class:`~ztunnel.proxy.hbone.connection.HboneTransport`. Raises ``ConnectionError``
    when the handshake fails (the reason is in the message). With TLS 1.3 the server checks our certificate after
    our side finished: ``settle`` seconds are given for its verdict to arrive (0: return at once; a rejection then
    shows up later as the connection closing).
    """
    from ztunnel import tls
    from ztunnel.identity.certificate import WorkloadCertificate

    assert isinstance(cert, WorkloadCertificate)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    ctx = tls.client_context(cert)
    await loop.create_connection(lambda: hbone_transport(True, ctx, done), *addr, local_addr=local_addr)
    conn = await asyncio.wait_for(done, 10)
    if settle:
        await asyncio.sleep(settle)
        if conn.closed:
            raise ConnectionError(str(conn.close_reason))
    return conn


async def hbone_request(
    conn: object, authority: str, method: str = "CONNECT", headers: list[tuple[str, str]] | None = None
) -> tuple[int, object]:
    """Send one request on a raw HBONE connection; returns (status, stream)."""
    from ztunnel.proxy.hbone.connection import HboneTransport

    assert isinstance(conn, HboneTransport)
    stream = conn.open_stream(authority, headers or [], method=method)
    assert stream.response is not None
    status, _ = await asyncio.wait_for(stream.response, 10)
    return status, stream


class EchoedBytes(NamedTuple):
    """What :func:`send_and_read_echo` saw: bytes that came back, and the sha256 of what went and what came."""

    received: int
    sent_sha256: str
    got_sha256: str


async def send_and_read_echo(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, block: bytes, count: int, timeout: float
) -> EchoedBytes:
    """Send ``count`` rotations of ``block`` (so every block differs) then FIN, while reading the echo to EOF; the
    writer is closed after. A short or altered echo shows in the result, for the caller to assert on."""
    sent, got = hashlib.sha256(), hashlib.sha256()
    received = 0

    async def send() -> None:
        for i in range(count):
            data = block[i:] + block[:i]
            sent.update(data)
            writer.write(data)
            await writer.drain()
        writer.write_eof()

    async def recv() -> None:
        nonlocal received
        while data := await reader.read(1 << 20):
            got.update(data)
            received += len(data)

    try:
        await asyncio.wait_for(asyncio.gather(send(), recv()), timeout)
    finally:
        writer.close()
    return EchoedBytes(received, sent.hexdigest(), got.hexdigest())


async def hbone_tunnel(conn: object, authority: str) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    """A CONNECT on a raw HBONE connection (:func:`hbone_dial`); on 200 its stream is relayed to one end of a local
    socket pair, whose other end is returned as asyncio streams: the client side of the tunnel (``write_eof`` ends
    the stream, EOF on the reader is the peer's end). On another status the streams are at EOF already."""
    from ztunnel.proxy.relay import PlainConnection

    status, stream = await hbone_request(conn, authority)
    ours, theirs = socket.socketpair()
    if status == 200:
        plain = PlainConnection()
        await asyncio.get_running_loop().connect_accepted_socket(lambda: plain, sock=ours)
        stream.attach(plain)  # type: ignore[attr-defined]
    else:
        ours.close()
    reader, writer = await asyncio.open_connection(sock=theirs)
    return status, reader, writer


class TwoNodeMesh:
    """``examples/two-node.yaml`` moved to a random block of 127/8, so tests never collide with each other (or with
    a demo or benchmark holding the example's fixed addresses). ``edit`` may rewrite the YAML text first."""

    def __init__(self, workdir: Path, edit: Callable[[str], str] | None = None) -> None:
        import random

        n, k = random.randrange(64, 250), random.randrange(0, 50) * 5
        self.node_a = f"127.{n}.{k + 1}.1"
        self.node_b = f"127.{n}.{k + 2}.1"
        self.plain = f"127.{n}.{k + 3}.1"
        self.vip = (f"127.{n}.{k + 4}.10", SERVICE_VIP[1])
        self.server_app = (self.node_b, SERVER_APP[1])
        text = TWO_NODE.read_text()
        for old, new in ((NODE_A_IP, self.node_a), (NODE_B_IP, self.node_b), ("127.0.3.1", self.plain)):
            text = text.replace(old, new)
        text = text.replace(SERVICE_VIP[0], self.vip[0])
        if edit is not None:
            text = edit(text)
        self.workdir = workdir
        self.ca_dir = workdir / "ca"
        self.config = workdir / "two-node.yaml"
        self.config.write_text(text)

    def env_a(self, workload: str = "default/client/client", **extra: str) -> dict[str, str]:
        return node_env("node-a", self.node_a, workload, self.ca_dir, self.config, **extra)

    def env_b(self, workload: str = "default/server/server", **extra: str) -> dict[str, str]:
        return node_env("node-b", self.node_b, workload, self.ca_dir, self.config, **extra)

    async def socks5(
        self, host: str | None = None, port: int | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection from node A's workload to ``host:port`` (default: the echo service VIP) via SOCKS5."""
        return await socks5_connect((self.node_a, 15080), host or self.vip[0], port or self.vip[1])

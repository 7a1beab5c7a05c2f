"""One worker process (``python -m ztunnel.workers``) driven by the test as its control process, over the real
channel: it serves only after its snapshot, applies batches in generation order and asks for a fresh snapshot on a
gap, asks for a certificate once and keeps it until a rotation is pushed, and exits at the end of its channel."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from ztunnel.config import from_env
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.inpod.netns import NetnsId
from ztunnel.localconfig import load_local_config
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.tasks import TaskGroup
from ztunnel.testing import EchoServer, TwoNodeMesh, eventually, hbone_dial, hbone_tunnel
from ztunnel.workers import protocol as p
from ztunnel.workers.balance import LoadBoard
from ztunnel.workers.channel import Channel

SERVER = Identity("cluster.local", "default", "server")
TASKS = TaskGroup("test")


@dataclass
class Control:
    """The test's end of the worker's channel: what the worker sent, in order."""

    channel: Channel
    proc: subprocess.Popen[bytes]
    got: asyncio.Queue[p.Message] = field(default_factory=asyncio.Queue)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    fds: list[int] = field(default_factory=list)  # what came with the messages, in order (the test closes them)

    async def next(self, timeout: float = 20, skip: type[p.Message] | None = None) -> p.Message:
        """The next message (``skip``: not of this type)."""
        while True:
            msg = await asyncio.wait_for(self.got.get(), timeout)
            if skip is None or not isinstance(msg, skip):
                return msg


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[tuple[Control, TwoNodeMesh]]:
    m = TwoNodeMesh(tmp_path)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115, ASYNC230 - set-up; closed below
    proc = subprocess.Popen(  # noqa: ASYNC220 - set-up, before the loop has anything to do
        [sys.executable, "-m", "ztunnel.workers", "--index", "0", str(theirs.fileno()), str(os.getpid())],
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    theirs.close()
    holder: list[Control] = []

    def received(msg: p.Message, fds: list[int]) -> None:
        holder[0].fds.extend(fds)
        holder[0].got.put_nowait(msg)

    channel = Channel(
        ours,
        received,
        lambda reason: holder[0].closed.set(),
        "worker",
    )
    control = Control(channel, proc)
    holder.append(control)
    try:
        yield control, m
    finally:
        channel.close()
        await asyncio.to_thread(proc.wait, 20)
        log.close()
        for fd in control.fds:
            os.close(fd)
    text = (tmp_path / "worker.log").read_text()
    # No task of the worker failed (its clients here present no certificate: their handshakes may fail, logged as such).
    assert "ztunnel::tasks" not in text and "Traceback" not in text, text


def state_of(m: TwoNodeMesh) -> ProxyState:
    state = ProxyState("node-b")
    state.apply(load_local_config(m.config, "cluster.local").update)
    return state


async def test_serves_after_its_snapshot_and_resyncs_on_a_gap(worker: tuple[Control, TwoNodeMesh]) -> None:
    control, m = worker
    cfg = from_env(m.env_b(ZTUNNEL_WORKER_THREADS="1"))
    control.channel.send(p.Start(0, cfg))
    with pytest.raises(TimeoutError):
        await control.next(timeout=1)  # nothing before its snapshot: no Ready, no listener
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(m.node_b, 15008)
    snap = p.snapshot_of(state_of(m))
    snap.generation = 5
    control.channel.send(snap)
    assert await control.next() == p.Ready(5)  # bound (a port in use would be Failed), not accepting yet
    # Until Serve (the control process's first xDS sync) a connection waits in the backlog; once served, the worker
    # accepts it, and the handshake makes it ask for its certificate.
    _, w = await asyncio.open_connection(m.node_b, 15008)
    with pytest.raises(TimeoutError):
        await control.next(timeout=0.5)  # not accepted: nothing asked
    control.channel.send(p.Serve())
    assert isinstance(await control.next(), p.CertificateRequest)
    w.close()

    control.channel.send(p.Delta(6, StateUpdate()))  # the next batch: applied
    control.channel.send(p.Delta(8, StateUpdate()))  # a gap: 7 is missing
    # (The probe of 15008 above made it ask for its certificate; not answered here.)
    assert await control.next(skip=p.CertificateRequest) == p.Resync(6, 8)  # it had applied 6
    control.channel.send(p.Delta(9, StateUpdate()))  # ignored until a fresh snapshot
    snap.generation = 9
    control.channel.send(snap)
    control.channel.send(p.Delta(10, StateUpdate()))
    control.channel.send(p.Delta(10, StateUpdate()))  # a repeat is a gap too
    assert await control.next(skip=p.CertificateRequest) == p.Resync(10, 10)

    control.channel.close()  # the control process is gone: the worker exits
    assert await asyncio.to_thread(control.proc.wait, 20) == 1


def server_serial(addr: tuple[str, int], roots: str) -> int:
    """The serial of the certificate the server presents (the handshake's first half is enough)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=roots)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(addr, timeout=10) as raw, ctx.wrap_socket(raw, server_hostname=None) as tls:
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number


async def test_a_certificate_is_asked_for_once_and_replaced_when_pushed(
    worker: tuple[Control, TwoNodeMesh],
) -> None:
    control, m = worker
    control.channel.send(p.Start(0, from_env(m.env_b(ZTUNNEL_WORKER_THREADS="1"))))
    control.channel.send(p.snapshot_of(state_of(m)))
    control.channel.send(p.Serve())
    assert isinstance(await control.next(), p.Ready)
    ca = LocalCA.generate("cluster.local")
    roots = ca.root_cert.public_bytes(Encoding.PEM).decode()
    first = ca.issue(SERVER, timedelta(hours=1))

    # A TLS client on 15008: the worker needs its workload's certificate and asks the control process for it.
    serial = TASKS.spawn(asyncio.to_thread(server_serial, (m.node_b, 15008), roots), "client")
    ask = await control.next()
    assert isinstance(ask, p.CertificateRequest) and ask.identity == SERVER
    control.channel.send(p.CertificateReply(ask.request_id, SERVER, p.CertificateData.of(first)))
    assert await serial == first.cert.serial_number
    # Kept: the next handshake asks nothing.
    assert await asyncio.to_thread(server_serial, (m.node_b, 15008), roots) == first.cert.serial_number
    assert control.got.empty()
    # Rotated by the control process: pushed, and used from the next handshake on.
    second = ca.issue(SERVER, timedelta(hours=1))
    control.channel.send(p.CertificatePush(SERVER, p.CertificateData.of(second)))
    assert await asyncio.to_thread(server_serial, (m.node_b, 15008), roots) == second.cert.serial_number
    assert control.got.empty()

    control.channel.send(p.Drain(graceful=True, deadline=5))
    assert await asyncio.to_thread(control.proc.wait, 20) == 0


# -- inbound connections handed between workers ------------------------------------------------------------------


async def test_a_handed_in_connection_is_served_and_never_handed_on(worker: tuple[Control, TwoNodeMesh]) -> None:
    """The worker's half of the balance, with the test as the control process and the load board's other writer:
    a connection handed in is served (and acknowledged) however loaded the board says this worker is; one it
    accepts itself while it has more than an idle worker 1 goes out as a HandOff with its socket, untouched, so the
    control process can give it back; a HandIn for a proxy it lacks is refused and leaves the socket alone; and
    its count on the board follows its connections."""
    control, m = worker
    board = LoadBoard.create(2)
    ca = LocalCA.generate("cluster.local")
    client = ca.issue(Identity("cluster.local", "default", "client"), timedelta(hours=1))
    server = p.CertificateData.of(ca.issue(SERVER, timedelta(hours=1)))
    cfg = from_env(m.env_b(ZTUNNEL_WORKER_THREADS="2"))
    control.channel.send(p.Start(0, cfg, load_board=True), [board.fd])
    control.channel.send(p.snapshot_of(state_of(m)))
    control.channel.send(p.Serve())
    assert isinstance(await control.next(), p.Ready)
    board.set_up(1, True)  # a worker 1, idle: by the counts, everything after this worker's first belongs there
    others: asyncio.Queue[p.Message] = asyncio.Queue()

    async def answer() -> None:  # the control process's certificate service; the rest goes to ``others``
        while True:
            msg = await control.got.get()
            if isinstance(msg, p.CertificateRequest):
                control.channel.send(p.CertificateReply(msg.request_id, SERVER, server))
            else:
                others.put_nowait(msg)

    answering = TASKS.spawn(answer(), "answer")
    authority = f"{m.server_app[0]}:{m.server_app[1]}"
    echo = await EchoServer().start(*m.server_app)
    listener = socket.create_server((m.node_b, 0))
    listener.setblocking(False)
    conns: list[Any] = []
    loop = asyncio.get_running_loop()
    try:
        # Accepted elsewhere (here, by the test), handed in: served, while the board says to hand it on.
        for i in range(2):
            dialing = TASKS.spawn(hbone_dial(listener.getsockname(), client, local_addr=(m.node_a, 0)), "dial")
            sock, _ = await loop.sock_accept(listener)
            ack = await control.channel.call(p.HandIn(None, 1), [sock.fileno()], p.Ack)
            sock.close()  # the worker has its own copy now
            assert ack.error is None
            conns.append(await dialing)
            assert await echoes(conns[-1], authority, b"handed in %d" % i)
        assert board.counts[0] == 2 and others.empty()  # both kept: no HandOff went out

        # Refused: a proxy it does not have. The socket stays ours, untouched.
        dialing = TASKS.spawn(hbone_dial(listener.getsockname(), client, local_addr=(m.node_a, 0)), "dial")
        sock, _ = await loop.sock_accept(listener)
        ack = await control.channel.call(p.HandIn(("no-such-pod", NetnsId(1, 2)), 1), [sock.fileno()], p.Ack)
        assert ack.error == "no proxy for pod no-such-pod"
        # Given again, to the dedicated proxy: the client's handshake only starts now, nothing was lost.
        assert (await control.channel.call(p.HandIn(None, 1), [sock.fileno()], p.Ack)).error is None
        sock.close()
        conns.append(await dialing)
        assert await echoes(conns[-1], authority, b"refused, then taken")
        assert board.counts[0] == 3

        # Accepted by the worker on 15008, 3 here and 0 at worker 1: handed on, with its socket, before any byte.
        dialing = TASKS.spawn(hbone_dial((m.node_b, 15008), client, local_addr=(m.node_a, 0)), "dial")
        handoff = await asyncio.wait_for(others.get(), 10)
        assert isinstance(handoff, p.HandOff) and (handoff.target, handoff.key) == (1, None)
        fd = control.fds[-1]
        handed = socket.socket(fileno=os.dup(fd))
        assert handed.getsockname() == (m.node_b, 15008)
        assert handed.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # the ClientHello, unread
        handed.close()
        assert board.counts[0] == 3
        # Worker 1 "could not take it": back to the worker that accepted it, which serves it (and hands it on no
        # more, though the board has not changed).
        assert (await control.channel.call(p.HandIn(None, 0), [fd], p.Ack)).error is None
        control.channel.send(p.Ack(handoff.request_id, "worker 1: gone"))
        conns.append(await dialing)
        assert await echoes(conns[-1], authority, b"back home")
        assert board.counts[0] == 4 and others.empty()

        for conn in conns:
            conn.close("done")
        assert await eventually(lambda: board.counts[0], 10, until=lambda n: n == 0) == 0
    finally:
        for conn in conns:
            conn.close("done")
        listener.close()
        await echo.stop()
        answering.cancel()
        control.channel.send(p.Drain(graceful=True, deadline=5))
        assert await asyncio.to_thread(control.proc.wait, 20) == 0
        board.close()


async def echoes(conn: Any, authority: str, data: bytes) -> bool:
    status, reader, writer = await hbone_tunnel(conn, authority)
    writer.write(data)
    writer.write_eof()
    got = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return status == 200 and got == data

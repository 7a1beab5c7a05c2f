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

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from ztunnel.config import from_env
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.localconfig import load_local_config
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.tasks import TaskGroup
from ztunnel.testing import TwoNodeMesh
from ztunnel.workers import protocol as p
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
    channel = Channel(
        ours,
        lambda msg, fds: holder[0].got.put_nowait(msg),
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
    assert await control.next() == p.Ready(5)
    _, w = await asyncio.open_connection(m.node_b, 15008)  # serving now
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

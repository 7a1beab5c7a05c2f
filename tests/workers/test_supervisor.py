"""The control process's relay of handed-over inbound connections, with the test playing both workers over real
channels (socketpairs) and a real TCP connection as the handed socket: the target first, then the worker that
accepted it, then any other; the control process keeps its copy until one acknowledges; what no worker takes is
closed and counted with ``to="none"``; a worker that is not serving is skipped."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest

from ztunnel.config import from_env
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.manager import LocalCertificateProvider
from ztunnel.readiness import Readiness
from ztunnel.state import ProxyState
from ztunnel.workers import protocol as p
from ztunnel.workers.channel import Channel
from ztunnel.workers.supervisor import Supervisor, WorkerHandle


@dataclass
class FakeWorker:
    """The test's end of one worker's channel: it answers each HandIn with ``answer`` (None: taken)."""

    channel: Channel
    index: int
    answer: str | None = None
    handed_in: list[tuple[p.HandIn, socket.socket]] = field(default_factory=list)
    got: list[p.Message] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def handle(self, msg: p.Message, fds: list[int]) -> None:
        if isinstance(msg, p.Query) and msg.what == "connections":
            self.channel.send(p.Reply(msg.request_id, [{"worker": self.index}]))
        elif isinstance(msg, p.HandIn):
            sock = socket.socket(fileno=fds[0])
            self.handed_in.append((msg, sock))
            if self.answer is not None:
                sock.close()  # refused: a worker lets its copy go
            self.channel.send(p.Ack(msg.request_id, self.answer))
        else:
            for fd in fds:
                os.close(fd)
        self.got.append(msg)
        self.arrived.set()


@pytest.fixture
async def control() -> AsyncIterator[tuple[Supervisor, list[FakeWorker]]]:
    cfg = from_env({"ZTUNNEL_WORKER_THREADS": "3", "FAKE_CA": "true", "XDS_ADDRESS": ""})
    sup = Supervisor(cfg, ProxyState(), LocalCertificateProvider(LocalCA.generate("cluster.local")), Readiness())
    workers: list[FakeWorker] = []
    for h in sup.handles:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        holder: list[FakeWorker] = []

        def on_worker_message(msg: p.Message, fds: list[int], w: list[FakeWorker] = holder) -> None:
            w[0].handle(msg, fds)

        worker = FakeWorker(Channel(theirs, on_worker_message, lambda r: None, "w"), h.index)
        holder.append(worker)
        workers.append(worker)

        def on_message(msg: p.Message, fds: list[int], h: WorkerHandle = h) -> None:
            assert h.channel is not None
            sup._handle(h, h.channel, msg, fds)

        h.channel = Channel(ours, on_message, lambda r: None, f"worker {h.index}")
        h.ready = True
        h.said_ready.set()
    yield sup, workers
    await sup.tasks.cancel_all(timeout=1)
    for h, w in zip(sup.handles, workers, strict=True):
        if h.channel is not None:
            h.channel.close()
        w.channel.close()
        for _, sock in w.handed_in:
            sock.close()


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A real TCP connection: (the client's end, the accepted end that is handed over)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    yield client, accepted
    client.close()
    accepted.close()


async def hand_off(worker: FakeWorker, target: int, accepted: socket.socket) -> p.Ack:
    ack = await asyncio.wait_for(worker.channel.call(p.HandOff(target, None), [accepted.fileno()], p.Ack), 10)
    accepted.close()  # the accepting worker lets its copy go as soon as it is sent
    return ack


def handoffs(sup: Supervisor) -> dict[tuple[str, str], float]:
    (family,) = [m for m in sup._worker_metrics() if m.name == "ztunnel_worker_inbound_handoffs"]
    return {(s.labels["worker"], s.labels["to"]): s.value for s in family.samples}


async def test_the_target_takes_it(
    control: tuple[Supervisor, list[FakeWorker]], connection: tuple[socket.socket, socket.socket]
) -> None:
    sup, workers = control
    client, accepted = connection
    ack = await hand_off(workers[0], 2, accepted)
    assert ack.error is None
    ((msg, sock),) = workers[2].handed_in
    assert (msg.key, msg.origin) == (None, 0)
    assert workers[0].handed_in == workers[1].handed_in == []
    client.sendall(b"to the one that took it")
    assert sock.recv(100) == b"to the one that took it"  # the same connection, and the only copy left open
    sock.close()
    assert client.recv(100) == b""
    assert handoffs(sup) == {("0", "2"): 1.0}


async def test_a_refused_connection_goes_back_to_the_worker_that_accepted_it(
    control: tuple[Supervisor, list[FakeWorker]], connection: tuple[socket.socket, socket.socket]
) -> None:
    sup, workers = control
    client, accepted = connection
    workers[2].answer = "draining"
    ack = await hand_off(workers[0], 2, accepted)
    assert ack.error == "worker 2: draining"
    ((msg, sock),) = workers[0].handed_in  # given back before the answer
    assert msg.origin == 0
    client.sendall(b"back home")
    assert sock.recv(100) == b"back home"
    assert handoffs(sup) == {("0", "0"): 1.0}


async def test_a_worker_that_is_not_serving_is_skipped(
    control: tuple[Supervisor, list[FakeWorker]], connection: tuple[socket.socket, socket.socket]
) -> None:
    sup, workers = control
    client, accepted = connection
    sup.handles[2].ready = False  # restarting: not asked at all
    ack = await hand_off(workers[0], 2, accepted)
    assert ack.error == "worker 2: not serving"
    assert workers[2].handed_in == [] and workers[2].got == []
    ((_msg, sock),) = workers[0].handed_in
    client.sendall(b"kept")
    assert sock.recv(100) == b"kept"
    assert handoffs(sup) == {("0", "0"): 1.0}


async def test_what_no_worker_takes_is_closed_and_counted(
    control: tuple[Supervisor, list[FakeWorker]],
    connection: tuple[socket.socket, socket.socket],
    caplog: pytest.LogCaptureFixture,
) -> None:
    sup, workers = control
    client, accepted = connection
    for w in workers:
        w.answer = "draining"
    sup.handles[1].ready = False
    ack = await hand_off(workers[0], 2, accepted)
    assert ack.error == "worker 2: draining; worker 0: draining; worker 1: not serving"
    assert [len(w.handed_in) for w in workers] == [1, 0, 1]
    client.settimeout(10)
    assert client.recv(100) == b""  # every copy closed: the client sees the end
    assert handoffs(sup) == {("0", "none"): 1.0}
    assert any(r.levelno == logging.WARNING and "no worker could take it" in r.getMessage() for r in caplog.records), (
        caplog.text
    )


async def test_a_worker_still_starting_is_not_queried(
    control: tuple[Supervisor, list[FakeWorker]],
) -> None:
    """A worker process that has not said Ready yet (a restart importing on a loaded node) is not queried (for
    /connections here; a scrape's metrics and the config dump's pods go the same way): it could answer only once
    started, so a scrape would wait on it (up to ANSWER_TIMEOUT, 10 s)."""
    sup, workers = control
    h = sup.handles[2]
    h.ready = False
    h.said_ready = asyncio.Event()  # its new process: started, not Ready
    rows = await asyncio.wait_for(sup.connections(), 5)
    assert sorted(r["worker"] for r in rows) == [0, 1]
    assert not any(isinstance(m, p.Query) for m in workers[2].got), workers[2].got
    assert any(isinstance(m, p.Query) for m in workers[0].got)

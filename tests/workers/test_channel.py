"""The channel adapter over a real unix socketpair: requests and answers, fds passed with SCM_RIGHTS and usable on
the other side, frames larger than the socket buffers, and the end of the channel failing what still waits."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from ztunnel.config import WorkloadInfo
from ztunnel.state import StateUpdate
from ztunnel.tasks import TaskGroup
from ztunnel.workers import protocol as p
from ztunnel.workers.channel import MAX_QUEUED, Channel, ChannelClosed

INFO = WorkloadInfo("pod", "default", "sa")
TASKS = TaskGroup("test")


@dataclass
class End:
    channel: Channel
    got: list[tuple[p.Message, list[int]]] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[End, End]]:
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ends: list[End] = []
    for name, sock in (("a", a_sock), ("b", b_sock)):
        holder: dict[str, End] = {}

        def handler(msg: p.Message, fds: list[int], h: dict[str, End] = holder) -> None:
            h["end"].got.append((msg, fds))
            h["end"].arrived.set()

        def on_close(reason: str, h: dict[str, End] = holder) -> None:
            h["end"].closed.append(reason)

        end = End(Channel(sock, handler, on_close, name))
        holder["end"] = end
        ends.append(end)
    yield ends[0], ends[1]
    for end in ends:
        end.channel.close()
        for _, fds in end.got:
            for fd in fds:
                os.close(fd)


async def next_message(end: End) -> tuple[p.Message, list[int]]:
    while not end.got:
        end.arrived.clear()
        await asyncio.wait_for(end.arrived.wait(), 10)
    return end.got.pop(0)


async def test_a_request_gets_its_answer(pair: tuple[End, End]) -> None:
    a, b = pair
    call = TASKS.spawn(a.channel.call(p.Query("connections"), response=p.Reply), "call")
    msg, _ = await next_message(b)
    assert isinstance(msg, p.Query) and msg.what == "connections" and msg.request_id > 0
    b.channel.send(p.Reply(msg.request_id + 100, "someone else's"))  # an answer nobody waits for is dropped
    b.channel.send(p.Reply(msg.request_id, [{"worker": 0}]))
    reply = await asyncio.wait_for(call, 10)
    assert reply.value == [{"worker": 0}]
    assert a.got == []  # answers never reach the handler


async def test_request_sends_before_it_returns(pair: tuple[End, End]) -> None:
    """``request`` copies the fds at once (a worker lets its accepted socket go right after handing it over); the
    answer is awaited afterwards, and a closed channel fails it at once."""
    a, b = pair
    ours, theirs = socket.socketpair()
    waiting = a.channel.request(p.HandOff(1, None), [ours.fileno()], p.Ack)
    ours.close()
    msg, fds = await next_message(b)
    assert isinstance(msg, p.HandOff) and len(fds) == 1
    with socket.socket(fileno=os.dup(fds[0])) as handed:
        handed.sendall(b"through the copy")
        assert theirs.recv(100) == b"through the copy"
    b.channel.send(p.Ack(msg.request_id, "not taken"))
    assert (await asyncio.wait_for(waiting, 10)).error == "not taken"
    theirs.close()
    a.channel.close()
    with pytest.raises(ChannelClosed):
        a.channel.request(p.HandOff(1, None), [], p.Ack)


async def test_a_wrong_answer_type_is_an_error(pair: tuple[End, End]) -> None:
    a, b = pair
    call = TASKS.spawn(a.channel.call(p.Query("metrics"), response=p.Reply), "call")
    msg, _ = await next_message(b)
    assert isinstance(msg, p.Query)
    b.channel.send(p.Ack(msg.request_id))
    with pytest.raises(p.ChannelError, match="answered by Ack"):
        await asyncio.wait_for(call, 10)


async def test_an_fd_crosses_and_works(pair: tuple[End, End]) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        a.channel.send(p.AddPod("uid", INFO, request_id=1), [w])
        a.channel.send(p.Ready(1))
        msg, fds = await next_message(b)
        assert isinstance(msg, p.AddPod) and len(fds) == 1 and fds[0] != w
        os.write(fds[0], b"through the passed fd")  # the same pipe, reached through the worker's copy
        assert os.read(r, 100) == b"through the passed fd"
        os.close(fds[0])
        msg, fds = await next_message(b)
        assert isinstance(msg, p.Ready) and fds == []
    finally:
        os.close(r)
        os.close(w)  # still the sender's: the channel sent a copy


async def test_frames_larger_than_the_socket_buffers(pair: tuple[End, End]) -> None:
    a, b = pair
    big = p.Failed(os.urandom(8 << 20).hex())  # 16 MiB of text: a big snapshot's size
    for i in range(3):
        a.channel.send(p.Ready(i))
        a.channel.send(big)
    got = [await next_message(b) for _ in range(6)]
    assert [type(m).__name__ for m, _ in got] == ["Ready", "Failed"] * 3
    assert all(m == big for m, _ in got if isinstance(m, p.Failed))
    await asyncio.wait_for(a.channel.drained(), 10)


async def test_the_end_of_the_channel_fails_what_waits(pair: tuple[End, End]) -> None:
    a, b = pair
    call = TASKS.spawn(a.channel.call(p.DelPod("uid"), response=p.Ack), "call")
    await next_message(b)
    b.channel.close()
    with pytest.raises(ChannelClosed, match="peer closed the channel"):
        await asyncio.wait_for(call, 10)
    assert a.closed == ["the peer closed the channel"] and b.closed == ["closed"]
    with pytest.raises(ChannelClosed):
        a.channel.send(p.Ready(1))


async def test_a_peer_that_dies_mid_frame_is_named(pair: tuple[End, End]) -> None:
    a, b = pair
    frame = p.encode(p.Delta(3, StateUpdate()))
    a.channel.sock.send(frame[:5])  # behind the channel's back: half a frame, then the writer is gone
    a.channel.close()
    while not b.closed:
        await asyncio.sleep(0.01)
    assert b.closed == ["the peer closed the channel mid-frame (5 bytes of a frame)"]


async def test_a_garbled_stream_closes_the_channel(pair: tuple[End, End]) -> None:
    a, b = pair
    a.channel.sock.send(p.HEADER.pack(4, 0) + b"junk")
    while not b.closed:
        await asyncio.sleep(0.01)
    assert "does not decode" in b.closed[0]


async def test_a_peer_that_stops_reading_is_cut_off(pair: tuple[End, End]) -> None:
    a, b = pair
    asyncio.get_running_loop().remove_reader(b.channel.sock.fileno())  # b never reads again
    chunk = p.Reply(1, b"x" * (32 << 20))
    with pytest.raises(ChannelClosed, match="stopped reading"):
        for _ in range(MAX_QUEUED // (32 << 20) + 2):
            a.channel.send(chunk)
    assert a.closed and "stopped reading" in a.closed[0]

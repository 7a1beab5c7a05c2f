"""TLS on a loopback TCP pair, two ways: the HBONE pump's memory BIOs over a uvloop transport, or OpenSSL on the socket.

Issue 17's gate for moving :class:`~ztunnel.proxy.hbone.connection.HboneTransport` off memory BIOs: what would the
socket design save, in CPU per byte and per round trip, before anything is rebuilt? Two processes (a sender/client
and a receiver/server), each with its own uvloop loop, on a TCP pair over 127.0.0.1 with the project's own TLS
contexts (TLS 1.3, the HBONE cipher suites, ALPN h2, workload certificates of a fresh CA). The handshake is done
before measuring; CPU is ``time.process_time`` of each process over the transfer only, summed.

Designs (``--designs``):

* ``bio``: as ``HboneTransport`` does it. Receive: ``BufferedProtocol.get_buffer`` (ciphertext, 256 KiB) ->
  ``MemoryBIO.write`` (copy) -> ``SSLObject.read`` into the plaintext buffer until it would block. Send:
  ``SSLObject.write`` of the 256 KiB application buffer -> ``out_bio.read()`` (copy, a new ``bytes``) ->
  ``transport.write``; ``pause_writing``/``resume_writing`` for backpressure.
* ``sock``: a non-blocking ``ssl.SSLSocket`` on the same descriptor, driven by ``loop.add_reader``/``add_writer``.
  Receive: ``read`` (``recv_into``) straight into the plaintext buffer until ``SSLWantReadError``. Send: ``write``
  of the whole 256 KiB buffer; on ``SSLWantWriteError`` wait for writability and retry with the same buffer (CPython
  sets ``SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER | SSL_MODE_AUTO_RETRY`` and no partial writes: OpenSSL keeps what it
  sealed and the retry must pass the same bytes).
* ``sock-ra``: ``sock`` with OpenSSL's read-ahead on (``SSL_CTX_set_read_ahead`` through ``ztunnel.tls``'s ctypes
  handle): without it OpenSSL reads each record with two ``recv`` calls (its 5-byte header, then its body).

Workloads: ``bulk`` moves ``--gib`` GiB one way in 256 KiB application writes (16 KiB TLS records, OpenSSL's
maximum); ``ping`` makes ``--pings`` sequential 64 B round trips (client sends, server echoes). Rounds alternate
the designs (``--rounds``, 3 by default); the summary is the median per design.

    .venv/bin/python -m bench.micro.tls_io --gib 2 --pings 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import multiprocessing
import os
import socket
import ssl
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import uvloop

from bench.micro.pipes import certificates
from ztunnel import tls

CHUNK = 256 * 1024
PING = 64
_SSL_CTRL_SET_READ_AHEAD = 41  # ssl.h: what SSL_CTX_set_read_ahead() expands to
DESIGNS = ("bio", "sock", "sock-ra", "sock-ra256", "sock-ra-hp")
_TLS_RECORD = 16 * 1024


def _contexts(design: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    client_cert, server_cert = certificates()
    cctx, sctx = tls.client_context(client_cert), tls.server_context(server_cert)
    if design.startswith("sock-ra"):
        lib = tls._libssl()
        lib.SSL_CTX_set_default_read_buffer_len.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.SSL_CTX_set_default_read_buffer_len.restype = None
        for ctx in (cctx, sctx):
            pointer = tls._ssl_ctx_pointer(ctx)
            lib.SSL_CTX_ctrl(pointer, _SSL_CTRL_SET_READ_AHEAD, 1, None)
            if design == "sock-ra256":
                # With read-ahead, one recv fills OpenSSL's read buffer: 256 KiB of records per recv, as uvloop's
                # reads in the bio design, instead of about one record.
                lib.SSL_CTX_set_default_read_buffer_len(pointer, CHUNK + 18 * 1024)
    return cctx, sctx


def _handshake_bio(sock: socket.socket, sslobj: ssl.SSLObject, in_bio: ssl.MemoryBIO, out_bio: ssl.MemoryBIO) -> None:
    while True:
        try:
            sslobj.do_handshake()
            break
        except ssl.SSLWantReadError:
            if out_bio.pending:
                sock.sendall(out_bio.read())
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("peer closed during the handshake") from None
            in_bio.write(data)
    if out_bio.pending:
        sock.sendall(out_bio.read())


# -- bio -----------------------------------------------------------------------------------------------------------


class _BioProtocol(asyncio.BufferedProtocol):
    def __init__(self, sslobj: ssl.SSLObject, in_bio: ssl.MemoryBIO, out_bio: ssl.MemoryBIO) -> None:
        self.tls: Any = sslobj._sslobj  # type: ignore[attr-defined]  # as connection._tls_io
        self.in_bio, self.out_bio = in_bio, out_bio
        self.cbuf = memoryview(bytearray(CHUNK))
        self.pbuf = memoryview(bytearray(CHUNK + 16384))
        self.transport: Any = None
        self.on_plain: Callable[[memoryview, int], None] = lambda buf, n: None
        self.resumed: asyncio.Future[None] | None = None
        self.paused = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=1024 * 1024, low=256 * 1024)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.cbuf

    def buffer_updated(self, nbytes: int) -> None:
        self.in_bio.write(self.cbuf[:nbytes])
        self.decrypt()

    def decrypt(self) -> None:
        tls_, dst, in_bio = self.tls, self.pbuf, self.in_bio
        size = len(dst)
        more = True
        while more:  # until the BIO is drained: a full buffer delivers and reads on
            got = 0
            more = False
            try:
                while got < size:
                    n = tls_.read(size - got, dst[got:])
                    if n == 0:
                        break
                    got += n
                    if not in_bio.pending and not tls_.pending():
                        break
                else:
                    more = True
            except ssl.SSLWantReadError:
                pass
            if got:
                self.on_plain(dst, got)

    def send(self, data: memoryview | bytes) -> None:
        self.tls.write(data)
        self.transport.write(self.out_bio.read())

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)


async def _bio_endpoint(sock: socket.socket, ctx: ssl.SSLContext, server: bool) -> _BioProtocol:
    in_bio, out_bio = ssl.MemoryBIO(), ssl.MemoryBIO()
    sslobj = ctx.wrap_bio(in_bio, out_bio, server_side=server, server_hostname=None)
    _handshake_bio(sock, sslobj, in_bio, out_bio)
    sock.setblocking(False)
    proto = _BioProtocol(sslobj, in_bio, out_bio)
    loop = asyncio.get_running_loop()
    if server:
        await loop.connect_accepted_socket(lambda: proto, sock)
    else:
        await loop.create_connection(lambda: proto, sock=sock)
    return proto


# -- sock ----------------------------------------------------------------------------------------------------------


class _SockEndpoint:
    def __init__(self, sslsock: ssl.SSLSocket, loop: asyncio.AbstractEventLoop, read_ahead: bool) -> None:
        self.sock = sslsock
        self.read_ahead = read_ahead
        self.has_pending: Callable[[], int] | None = None
        if _CTX["design"] == "sock-ra-hp":
            self.has_pending = _has_pending(sslsock)
        self.tls: Any = sslsock._sslobj  # type: ignore[attr-defined]  # the C object: no Python wrapper frames
        self.fd = sslsock.fileno()
        self.loop = loop
        self.pbuf = memoryview(bytearray(CHUNK + 16384))
        self.on_plain: Callable[[memoryview, int], None] = lambda buf, n: None
        self.pending_out: memoryview | bytes | None = None
        self.writable: asyncio.Future[None] | None = None

    def start_reading(self) -> None:
        self.loop.add_reader(self.fd, self.on_readable)

    def on_readable(self) -> None:
        tls_, dst = self.tls, self.pbuf
        size = len(dst)
        more = True
        while more:  # a full buffer delivers and reads on: with read-ahead OpenSSL may hold records the poll can't see
            got = 0
            more = False
            try:
                while got < size:
                    n = tls_.read(size - got, dst[got:])
                    if n == 0:
                        break
                    got += n
                    # A short record usually ends the peer's write: asking again would be a recv that fails with
                    # EAGAIN plus an exception. If more is queued in the kernel, the (level-triggered) poll says
                    # so; but with read-ahead OpenSSL may hold more records than the poll can see.
                    if (
                        n < _TLS_RECORD
                        and not tls_.pending()
                        and (not self.read_ahead or (self.has_pending is not None and not self.has_pending()))
                    ):
                        break
                else:
                    more = True
            except ssl.SSLWantReadError:
                pass
            if got:
                self.on_plain(dst, got)

    def try_send(self, data: memoryview | bytes) -> bool:
        """True when all of ``data`` went; else it is kept and must be retried (same bytes) when writable."""
        try:
            self.tls.write(data)
        except ssl.SSLWantWriteError:
            self.pending_out = data
            self.loop.add_writer(self.fd, self._on_writable)
            return False
        return True

    def _on_writable(self) -> None:
        data = self.pending_out
        assert data is not None
        try:
            self.tls.write(data)
        except ssl.SSLWantWriteError:
            return
        self.pending_out = None
        self.loop.remove_writer(self.fd)
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)


def _has_pending(sslsock: ssl.SSLSocket) -> Callable[[], int]:
    """``SSL_has_pending`` of this socket's ``SSL*`` (records read ahead but not yet decrypted), through ctypes.

    CPython's ``PySSLSocket`` is ``{PyObject_HEAD; PyObject *Socket; SSL *ssl; ...}``; the pointer is checked by
    asking libssl for the descriptor it drives."""
    lib = tls._libssl()
    lib.SSL_has_pending.argtypes = [ctypes.c_void_p]
    lib.SSL_has_pending.restype = ctypes.c_int
    lib.SSL_get_fd.argtypes = [ctypes.c_void_p]
    lib.SSL_get_fd.restype = ctypes.c_int
    obj = sslsock._sslobj  # type: ignore[attr-defined]
    pointer = ctypes.c_void_p.from_address(id(obj) + object.__basicsize__ + ctypes.sizeof(ctypes.c_void_p)).value
    if not pointer or lib.SSL_get_fd(pointer) != sslsock.fileno():
        raise RuntimeError("cannot locate the SSL* inside _ssl._SSLSocket")
    return functools.partial(lib.SSL_has_pending, pointer)


async def _sock_endpoint(sock: socket.socket, ctx: ssl.SSLContext, server: bool) -> _SockEndpoint:
    sslsock = ctx.wrap_socket(sock, server_side=server, server_hostname=None)  # blocking handshake
    sslsock.setblocking(False)
    return _SockEndpoint(sslsock, asyncio.get_running_loop(), _CTX["design"] != "sock")


# -- workloads -----------------------------------------------------------------------------------------------------


async def _run(
    design: str, workload: str, role: str, sock: socket.socket, ctx: ssl.SSLContext, arg: int, pipe: Connection
) -> None:
    """One end of one run: handshake, then ``ready``; on ``go``, the workload; then its CPU seconds to ``pipe``."""
    loop = asyncio.get_running_loop()
    server = role == "server"
    done: asyncio.Future[None] = loop.create_future()
    ep: Any = await (_bio_endpoint if design == "bio" else _sock_endpoint)(sock, ctx, server)
    ping = bytes(range(PING))
    count = 0

    def send_small(data: memoryview | bytes) -> None:
        if design == "bio":
            ep.send(data)
        elif not ep.try_send(data):
            # Never on loopback with 64 B in flight; if it were, the round trips would stall and the numbers lie.
            raise RuntimeError("a 64 B write would block")

    def sink(buf: memoryview, n: int) -> None:  # bulk receiver
        nonlocal count
        count += n
        if count >= arg and not done.done():
            done.set_result(None)

    def echo(buf: memoryview, n: int) -> None:  # ping server
        nonlocal count
        send_small(buf[:n])
        count += n
        if count >= arg * PING and not done.done():
            done.set_result(None)

    def pong(buf: memoryview, n: int) -> None:  # ping client
        nonlocal count
        if buf[:n] != ping[count % PING : count % PING + n]:
            # Raised here it would only be logged by the loop: fail the run instead (the child exits non-zero).
            if not done.done():
                done.set_exception(RuntimeError("the echo differs from what was sent"))
            return
        count += n
        if count >= arg * PING:
            if not done.done():
                done.set_result(None)
        elif count % PING == 0:
            send_small(ping)

    if workload == "ping":
        ep.on_plain = echo if server else pong
    elif server:
        ep.on_plain = sink
    if design != "bio":
        ep.start_reading()
    payload = memoryview(bytearray(os.urandom(CHUNK)))
    pipe.send("ready")
    pipe.recv()  # go
    cpu0 = time.process_time()
    if workload == "bulk" and not server:
        sent = 0
        while sent < arg:
            if design == "bio":
                ep.send(payload)
                if ep.paused:
                    ep.resumed = loop.create_future()
                    await ep.resumed
            elif not ep.try_send(payload):
                ep.writable = loop.create_future()
                await ep.writable
            sent += CHUNK
        if design == "bio" and ep.transport.get_write_buffer_size():
            # The loop stops at pipe.recv() below: what uvloop still holds must reach the socket first. A zero
            # low-water mark makes resume_writing say when it has.
            ep.resumed = loop.create_future()
            ep.transport.set_write_buffer_limits(high=1, low=0)
            await ep.resumed
    else:
        if workload == "ping" and not server:
            send_small(ping)
        await done
    pipe.send(time.process_time() - cpu0)
    if not server:
        pipe.recv()  # the parent has both numbers: the receiver has everything, close


def _child(design: str, workload: str, role: str, sock: socket.socket, arg: int, pipe: Connection) -> None:
    if _CTX["cpu"] is not None:
        os.sched_setaffinity(0, {_CTX["cpu"]})
    ctx = _CTX[role]  # made by the parent (one CA for both ends), inherited through the fork
    uvloop.run(_run(design, workload, role, sock, ctx, arg, pipe))


_CTX: dict[str, Any] = {}


def measure(design: str, workload: str, arg: int, cpu: int | None = None) -> tuple[float, float]:
    """CPU seconds of (sender/client, receiver/server) for one run; both processes on CPU ``cpu`` if given."""
    _CTX["cpu"] = cpu
    cctx, sctx = _contexts(design)
    _CTX["client"], _CTX["server"], _CTX["design"] = cctx, sctx, design
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    mp = multiprocessing.get_context("fork")
    pipes = {}
    procs = []
    for role, sock in (("server", server), ("client", client)):
        parent_end, child_end = mp.Pipe()
        # Daemons: if one end fails, the parent's error ends the other instead of waiting for it.
        p = mp.Process(target=_child, args=(design, workload, role, sock, arg, child_end), daemon=True)
        p.start()
        child_end.close()  # the child's alone now: its exit is EOF here
        pipes[role] = parent_end
        procs.append(p)
    client.close()
    server.close()
    for role in ("server", "client"):
        assert pipes[role].recv() == "ready"
    for role in ("server", "client"):
        pipes[role].send("go")
    used = {role: pipes[role].recv() for role in ("client", "server")}
    pipes["client"].send("close")
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"{design}/{workload} child exited with {p.exitcode}")
    return used["client"], used["server"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--pings", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--designs", default=",".join(DESIGNS))
    parser.add_argument(
        "--cpu",
        type=int,
        default=None,
        help="pin both processes to this CPU (a ping-pong's cost then does not depend on where they were scheduled)",
    )
    parser.add_argument("--workloads", default="bulk,ping", help="bulk, ping or both (one alone for strace -c)")
    args = parser.parse_args()
    designs = args.designs.split(",")
    workloads = args.workloads.split(",")
    total = int(args.gib * 1024**3) // CHUNK * CHUNK
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for design in designs if r % 2 == 0 else designs[::-1]:
            line = f"round {r + 1} {design:10}"
            if "bulk" in workloads:
                a, b = measure(design, "bulk", total, args.cpu)
                per_gib = (a + b) / (total / 1024**3)
                results.setdefault((design, "bulk"), []).append(per_gib)
                line += f" bulk: {per_gib:.3f} CPU-s/GiB (sender {a:.2f} s, receiver {b:.2f} s)"
            if "ping" in workloads:
                c, d = measure(design, "ping", args.pings, args.cpu)
                per_rt = (c + d) / args.pings * 1e6
                results.setdefault((design, "ping"), []).append(per_rt)
                line += f" ping: {per_rt:.1f} us CPU/round trip (client {c:.2f} s, server {d:.2f} s)"
            print(line, flush=True)
    sizes = f"{args.gib:g} GiB in {CHUNK // 1024} KiB writes; {args.pings} x {PING} B"
    print(f"\n{args.rounds} rounds ({sizes}), against {designs[0]}:")
    print("  design       CPU-s/GiB: median  min    paired    us CPU/round trip: median  min   paired")
    for design in designs:
        cells = ["-", "-"]
        for i, workload in enumerate(("bulk", "ping")):
            if workload not in workloads:
                continue
            mine, base = results[(design, workload)], results[(designs[0], workload)]
            # Paired: each round ran the designs back to back, so the ratio within a round cancels the slow drift
            # of other work on the machine; other work only ever adds CPU time, so the least round is the least
            # disturbed one.
            paired = statistics.median(m / b for m, b in zip(mine, base, strict=True))
            cells[i] = (
                f"{statistics.median(mine):7.3f} {min(mine):6.3f} {paired - 1:+7.1%}"
                if workload == "bulk"
                else f"{statistics.median(mine):6.1f} {min(mine):6.1f} {paired - 1:+6.1%}"
            )
        print(f"  {design:10} {cells[0]}             {cells[1]}")


if __name__ == "__main__":
    main()

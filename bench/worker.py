"""A client process: ``python -m bench.worker`` reads one JSON command per line on stdin and answers one JSON line.

Clients run in their own processes so that neither the proxies nor the server share an event loop (or a GIL) with
them; the orchestrator only sends commands and reads answers. Every command names a *route*: where to connect,
and, for the ztunnel modes, the destination to ask for over SOCKS5 (ztunnel's explicit way in, since loopback has
no iptables capture)::

    {"addr": ["127.1.2.1", 15080], "socks": ["127.1.5.10", 80]}    # via ztunnel A's SOCKS5 listener
    {"addr": ["127.1.3.1", 8080], "socks": null}                  # straight to a server (or to Envoy's listener)

The SOCKS5 exchange is pipelined: greeting, CONNECT request and (where the scenario has one) the first payload
bytes leave in one write, so SOCKS5 adds bytes and parsing but no round trip to a connection. The reply arrives
once ztunnel has established the tunnel (its SOCKS5 answers after connecting, unlike upstream's).

Commands (``op``): ``throughput``, ``latency``, ``connrate``, ``hold``, ``release``, ``ping``, ``quit``. Each may
carry ``pids`` (name -> pid): their CPU seconds are sampled at the edges of the measured window and returned as
``cpu``, with the window's length as ``cpu_window_s`` (``throughput`` and ``connrate`` also return ``cpu_kernel``, the
kernel's part of each: :func:`bench.procstat.kernel_delta`). Blocking sockets on threads carry bulk and ping-pong
traffic (the GIL is released in every send and receive); uvloop carries the many-connection scenarios.
"""

from __future__ import annotations

import asyncio
import errno
import json
import resource
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import uvloop

from bench.procstat import cpu_delta, cpu_snapshot, kernel_delta, split_snapshot

Route = Mapping[str, Any]
_GREETING = b"\x05\x01\x00"  # SOCKS5, one method: no authentication


def socks5_request(host: str, port: int) -> bytes:
    """Greeting + CONNECT request for an IPv4 destination, to be sent in one write."""
    return _GREETING + b"\x05\x01\x00\x01" + socket.inet_aton(host) + struct.pack("!H", port)


SOCKS5_REPLY_V4 = 2 + 10  # method selection + a reply with an IPv4 bound address


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"EOF after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def _check_socks_reply(reply: bytes) -> None:
    if reply[:2] != b"\x05\x00":
        raise ConnectionError(f"SOCKS5 method selection refused: {reply[:2].hex()}")
    if reply[3] != 0:
        raise ConnectionError(f"SOCKS5 reply code {reply[3]}")


# A blocking send or receive that makes no progress for this long fails the sample instead of hanging the run.
STALL_TIMEOUT = 10.0


# Bind the source address but let connect() pick the port, so ports are shared across destinations and
# TIME_WAIT ports can be reused (a plain bind() to port 0 would reserve a port for good).
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)


def new_socket(route: Route) -> socket.socket:
    """A TCP socket bound to the route's source address (if any), with TCP_NODELAY."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bind = route.get("bind")
        if bind:
            sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            sock.bind((bind, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def open_blocking(route: Route, timeout: float = STALL_TIMEOUT) -> socket.socket:
    """A connected socket through ``route`` (SOCKS5 handshake done, reply checked), with a stall timeout."""
    host, port = route["addr"]
    sock = new_socket(route)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    if route.get("socks"):
        dst_host, dst_port = route["socks"]
        sock.sendall(socks5_request(dst_host, dst_port))
        reply = _recv_exact(sock, SOCKS5_REPLY_V4)
        _check_socks_reply(reply)
        if reply[5] != 1:  # ATYP: only IPv4 replies are expected on this IPv4 route
            raise ConnectionError(f"unexpected SOCKS5 reply address type {reply[5]}")
    return sock


# -- bulk throughput -----------------------------------------------------------------------------------------------


def throughput(cmd: Mapping[str, Any]) -> dict[str, Any]:
    """``streams`` connections each send zeros (sink mode) for ``seconds``, then FIN and read the server's count."""
    route, streams, seconds = cmd["route"], int(cmd["streams"]), float(cmd["seconds"])
    chunk = int(cmd.get("chunk", 1 << 20))
    pids = cmd.get("pids", {})
    stall = float(cmd.get("stall_timeout", STALL_TIMEOUT))
    socks = [open_blocking(route, stall) for _ in range(streams)]
    barrier = threading.Barrier(streams + 1)
    confirmed = [0] * streams
    ended = [0.0] * streams
    errors: list[str] = []
    start = [0.0]

    def run(i: int) -> None:
        sock = socks[i]
        data = memoryview(bytearray(chunk))
        sent = 0
        try:
            barrier.wait()
            deadline = start[0] + seconds
            while time.perf_counter() < deadline:
                sock.sendall(data)
                sent += chunk
            sock.shutdown(socket.SHUT_WR)
            (count,) = struct.unpack("!Q", _recv_exact(sock, 8))
            confirmed[i] = count
            if count != sent:
                errors.append(f"stream {i}: sent {sent} bytes, server counted {count}")
        except (OSError, ConnectionError, threading.BrokenBarrierError) as e:
            errors.append(f"stream {i}: {type(e).__name__}: {e}")
        finally:
            ended[i] = time.perf_counter()
            sock.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    split0, cpu0 = split_snapshot(pids), cpu_snapshot(pids)
    start[0] = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    cpu1, split1 = cpu_snapshot(pids), split_snapshot(pids)
    cpu_window = time.perf_counter() - start[0]
    wall = max(ended) - start[0]
    total = sum(confirmed)
    per_stream = [c * 8 / (e - start[0]) / 1e9 for c, e in zip(confirmed, ended, strict=True)]
    return {
        "bytes": total,
        "seconds": round(wall, 4),
        "gbps": total * 8 / wall / 1e9,
        "per_stream_gbps": [round(g, 3) for g in per_stream],
        "cpu": (cpu := cpu_delta(cpu0, cpu1)),
        "cpu_kernel": kernel_delta(cpu, split0, split1),
        "cpu_window_s": round(cpu_window, 4),
        "errors": errors,
    }


# -- request/response latency --------------------------------------------------------------------------------------


def latency(cmd: Mapping[str, Any]) -> dict[str, Any]:
    """Ping-pong ``size`` bytes on one open connection: ``warmup`` untimed rounds, then ``count`` timed ones."""
    route, size, count = cmd["route"], int(cmd["size"]), int(cmd["count"])
    warmup = int(cmd.get("warmup", 200))
    pids = cmd.get("pids", {})
    sock = open_blocking(route, float(cmd.get("stall_timeout", STALL_TIMEOUT)))
    payload = b"\x01" * size  # a non-zero first byte: echo mode
    buf = bytearray(size)
    view = memoryview(buf)
    rtts = []
    perf = time.perf_counter_ns
    try:
        cpu0: dict[str, float] = {}
        t_start = 0
        for i in range(warmup + count):
            if i == warmup:
                cpu0 = cpu_snapshot(pids)
                t_start = perf()
            t0 = perf()
            sock.sendall(payload)
            got = 0
            while got < size:
                n = sock.recv_into(view[got:])
                if not n:
                    raise ConnectionError("server closed the connection")
                got += n
            if i >= warmup:
                rtts.append(perf() - t0)
        cpu1 = cpu_snapshot(pids)
        wall = (perf() - t_start) / 1e9
    finally:
        sock.close()
    if bytes(buf) != payload:
        raise ConnectionError("echo mismatch")
    return {
        "rtt_us": [round(r / 1000, 1) for r in rtts],
        "seconds": round(wall, 4),
        "cpu": cpu_delta(cpu0, cpu1),
        "cpu_window_s": round(wall, 4),
    }


# -- many connections (uvloop) -------------------------------------------------------------------------------------


async def _recv_exact_async(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = await loop.sock_recv(sock, n - len(out))
        if not chunk:
            raise ConnectionError(f"EOF after {len(out)} of {n} bytes")
        out += chunk
    return out


async def _open_echo_once(loop: asyncio.AbstractEventLoop, route: Route) -> socket.socket:
    """Connect through ``route`` and echo one byte; returns the open socket (the tunnel is fully established)."""
    host, port = route["addr"]
    sock = new_socket(route)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        if route.get("socks"):
            dst_host, dst_port = route["socks"]
            await loop.sock_sendall(sock, socks5_request(dst_host, dst_port) + b"x")
            reply = await _recv_exact_async(loop, sock, SOCKS5_REPLY_V4 + 1)
            _check_socks_reply(reply)
            echoed = reply[-1:]
        else:
            await loop.sock_sendall(sock, b"x")
            echoed = await _recv_exact_async(loop, sock, 1)
        if echoed != b"x":
            raise ConnectionError(f"echo mismatch: {echoed!r}")
    except BaseException:
        sock.close()
        raise
    return sock


def _error_kind(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return errno.errorcode.get(e.errno, str(e.errno))
    return type(e).__name__


async def _connrate(cmd: Mapping[str, Any]) -> dict[str, Any]:
    route, concurrency, seconds = cmd["route"], int(cmd["concurrency"]), float(cmd["seconds"])
    pids = cmd.get("pids", {})
    loop = asyncio.get_running_loop()
    done = 0
    errors: dict[str, int] = {}
    samples: list[float] = []
    perf = time.perf_counter

    async def one_client(deadline: float) -> None:
        nonlocal done
        while perf() < deadline:
            t0 = perf()
            try:
                sock = await asyncio.wait_for(_open_echo_once(loop, route), 10)
            except (OSError, ConnectionError, TimeoutError) as e:
                kind = _error_kind(e)
                errors[kind] = errors.get(kind, 0) + 1
                await asyncio.sleep(0.001)
                continue
            sock.close()
            done += 1
            samples.append(perf() - t0)

    split0, cpu0 = split_snapshot(pids), cpu_snapshot(pids)
    t_start = perf()
    await asyncio.gather(*(one_client(t_start + seconds) for _ in range(concurrency)))
    wall = perf() - t_start
    cpu1, split1 = cpu_snapshot(pids), split_snapshot(pids)
    cpu_window = perf() - t_start
    samples.sort()
    return {
        "connections": done,
        "seconds": round(wall, 4),
        "rate": done / wall,
        "errors": errors,
        "conn_us": _percentiles([s * 1e6 for s in samples]),
        "cpu": (cpu := cpu_delta(cpu0, cpu1)),
        "cpu_kernel": kernel_delta(cpu, split0, split1),
        "cpu_window_s": round(cpu_window, 4),
    }


def _percentiles(sorted_values: list[float]) -> dict[str, float]:
    if not sorted_values:
        return {}
    n = len(sorted_values)
    return {f"p{q:g}": round(sorted_values[min(n - 1, int(q / 100 * n))], 1) for q in (50, 90, 99, 99.9)}


class Holder:
    """Idle connections kept open between a ``hold`` and a ``release`` command."""

    def __init__(self) -> None:
        self.socks: list[socket.socket] = []

    async def hold(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        route, count = cmd["route"], int(cmd["count"])
        concurrency = int(cmd.get("concurrency", 128))
        loop = asyncio.get_running_loop()
        errors: dict[str, int] = {}
        todo = iter(range(count))
        t0 = time.perf_counter()

        async def opener() -> None:
            for _ in todo:
                try:
                    self.socks.append(await asyncio.wait_for(_open_echo_once(loop, route), 20))
                except (OSError, ConnectionError, TimeoutError) as e:
                    kind = _error_kind(e)
                    errors[kind] = errors.get(kind, 0) + 1

        await asyncio.gather(*(opener() for _ in range(concurrency)))
        return {"opened": len(self.socks), "errors": errors, "seconds": round(time.perf_counter() - t0, 3)}

    def release(self) -> dict[str, Any]:
        n = len(self.socks)
        for s in self.socks:
            s.close()
        self.socks.clear()
        return {"closed": n}


def handle(cmd: Mapping[str, Any], holder: Holder) -> dict[str, Any]:
    op = cmd.get("op")
    ops: dict[str, Callable[[], dict[str, Any]]] = {
        "ping": lambda: {"pong": True},
        "throughput": lambda: throughput(cmd),
        "latency": lambda: latency(cmd),
        "connrate": lambda: uvloop.run(_connrate(cmd)),
        "hold": lambda: uvloop.run(holder.hold(cmd)),
        "release": holder.release,
    }
    fn = ops.get(str(op))
    if fn is None:
        raise ValueError(f"unknown op {op!r}")
    return fn()


def main() -> int:
    # Up to 10,000 idle tunnels from one client process.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    holder = Holder()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        try:
            out: dict[str, Any] = {"ok": True, **handle(cmd, holder)}
        except Exception as e:
            out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    holder.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())

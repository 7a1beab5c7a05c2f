"""The benchmark's TCP server, in its own process: ``python -m bench.server --listen IP:PORT [--listen ...]``.

One port serves every scenario, so each proxy needs only one route to it (Envoy's terminator has a single
upstream). The first byte of a connection picks the behaviour:

* ``0x00`` -> **sink**: read and count until the client's FIN, then answer the count as 8 bytes (big-endian) and
  close. Throughput is measured on bytes the server confirmed, not bytes the client managed to write.
* anything else -> **echo**: every byte read is written back (the first one included); FIN is answered with FIN.

Reads go into one preallocated 1 MiB buffer shared by all connections (the process is single-threaded and each
read is handled before the next), so the server itself costs one ``recv_into`` per read and no allocation while
sinking. It prints ``ready`` on stdout once every address is bound, and exits on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal
import socket
import struct
import sys
from typing import cast

import uvloop

_BUFFER = bytearray(1 << 20)
_VIEW = memoryview(_BUFFER)
_SINK, _ECHO = 1, 2


class BenchServerProtocol(asyncio.BufferedProtocol):
    __slots__ = ("count", "mode", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.mode = 0
        self.count = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        return _VIEW

    def buffer_updated(self, nbytes: int) -> None:
        if not self.mode:
            self.mode = _SINK if _BUFFER[0] == 0 else _ECHO
        if self.mode == _SINK:
            self.count += nbytes
        else:
            assert self.transport is not None
            self.transport.write(_BUFFER[:nbytes])  # a copy: the shared buffer is reused by the next read

    def eof_received(self) -> bool:
        assert self.transport is not None
        if self.mode == _SINK:
            self.transport.write(struct.pack("!Q", self.count))
        self.transport.close()  # flushes what is queued, then FIN
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


async def serve(addresses: list[str]) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for addr in addresses:
        host, port = _split(addr)
        servers.append(await loop.create_server(BenchServerProtocol, host, port, reuse_address=True, backlog=4096))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.server")
    p.add_argument("--listen", action="append", required=True, metavar="IP:PORT")
    args = p.parse_args(argv)
    # 10,000 idle tunnels end here as 10,000 sockets.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    uvloop.run(serve(args.listen))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m ztunnel.workers <fd> <control pid>``: one data-plane worker, started by the control process (never by
hand) with its end of the channel as ``fd``.

It dies with its parent: ``PR_SET_PDEATHSIG`` has the kernel SIGKILL it when the control process exits, however
that happens (kill -9 included), and it exits by itself when the channel ends. A terminal's Ctrl-C reaches every
process of the group, so the worker ignores SIGINT: the control process decides (first SIGINT drains, second ends
at once) and tells it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent exits; exit now if the parent is already gone (it died before the
    prctl took effect, and no signal will come)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"error: ztunnel worker: prctl(PR_SET_PDEATHSIG): {os.strerror(err)}\n")
        os._exit(1)
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not all(a.isdigit() for a in argv):
        sys.stderr.write("usage: python -m ztunnel.workers <fd> <control pid> (started by ztunnel, not by hand)\n")
        return 2
    fd, parent = int(argv[0]), int(argv[1])
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)

    import uvloop

    from ztunnel.workers.channel import Channel
    from ztunnel.workers.worker import Worker

    worker = Worker(lambda handler, on_close: Channel(sock, handler, on_close, "control"))
    code = uvloop.run(worker.run())
    logging.shutdown()
    return code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: sockets and tasks die with the process, as they would anyway

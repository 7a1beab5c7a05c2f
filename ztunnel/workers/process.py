"""Linux process controls the worker processes need: ``prctl(2)`` through ctypes (Python has no binding for it), and
the command line ``ps`` shows."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_NAME = 15

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def prctl(option: int, arg: int) -> None:
    """``prctl(option, arg)``; raises ``OSError`` with the reason."""
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` (its parent now) exits; exit now if it is already gone (it died before
    the prctl took effect, and no signal will come)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def set_name(name: str) -> None:
    """The process's name in ``ps`` and ``/proc/<pid>/comm`` (at most 15 bytes), e.g. ``zt-worker-1``."""
    buf = ctypes.create_string_buffer(name.encode()[:15])
    _libc.prctl(PR_SET_NAME, buf, 0, 0, 0)


def set_cmdline(args: list[str]) -> None:
    """What ``/proc/<pid>/cmdline`` (and ``ps``, and the benchmark) shows for this process: ``args``, written over the
    process's original argument strings (what setproctitle does; Python keeps copies of its arguments and never
    reads these again). Cut to the original length, the rest filled with NULs. Best effort: a failure changes
    nothing but the name shown."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
        size = end - start
        if size <= 1:
            return
        data = "\0".join(args).encode()[: size - 1]
        ctypes.memmove(start, data + b"\0" * (size - len(data)), size)


def leave_signals_to_the_control_process() -> None:
    """Ignore SIGINT and SIGTERM: a terminal's Ctrl-C reaches every process of the group, and systemd (or
    ``kill -- -<pgid>``) may send SIGTERM to every process of the ztunnel; a worker that died of it would cut its
    tunnels instead of draining them. The control process gets the same signal and tells the workers what to do
    (``Drain``); a worker still exits with its control process (``PR_SET_PDEATHSIG``, the end of its channel) and
    to SIGKILL."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

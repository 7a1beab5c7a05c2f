"""Linux process controls the worker processes need (``prctl(2)`` through ctypes: Python has no binding for it)."""

from __future__ import annotations

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

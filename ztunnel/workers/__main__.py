"""``python -m ztunnel.workers --index <i> <fd> <control pid>``: one data-plane worker started as a new interpreter,
with its end of the channel as ``fd``. The control process starts a worker this way when it replaces one (the first
ones are forked at start: :mod:`ztunnel.workers.prefork`); never by hand.

It dies with its parent: ``PR_SET_PDEATHSIG`` has the kernel SIGKILL it when the control process exits, however
that happens (kill -9 included), and it exits by itself when the channel ends. It ignores SIGINT and SIGTERM,
which the control process handles for it (first SIGINT or SIGTERM drains, a second SIGINT ends at once).
"""

from __future__ import annotations

import os
import sys

from ztunnel.workers.prefork import serve_worker
from ztunnel.workers.process import die_with_parent, leave_signals_to_the_control_process

USAGE = "usage: python -m ztunnel.workers --index <i> <fd> <control pid> (started by ztunnel, not by hand)\n"


def main(argv: list[str]) -> int:
    if argv in (["--help"], ["-h"]):
        sys.stdout.write(USAGE)
        return 0
    # The index is for ps and the benchmark (the worker learns it, with everything else, from its Start message).
    if len(argv) != 4 or argv[0] != "--index" or not all(a.isdigit() for a in argv[1:]):
        sys.stderr.write(USAGE)
        return 2
    fd, parent = int(argv[2]), int(argv[3])
    die_with_parent(parent)
    leave_signals_to_the_control_process()
    return serve_worker(fd)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: sockets and tasks die with the process, as they would anyway

"""The first workers, forked from the control process while it has one thread, so they share the pages of the
modules they run with it.

Why: a worker started as a new interpreter (``python -m ztunnel.workers``) imports the data plane afresh, ~36 MiB of
PSS each (measured idle), nothing shared with the control process. Forked from a process that imported them once,
and with ``gc.freeze()`` so no collection writes to those objects' pages, a worker's PSS is ~22 MiB with one worker
and ~17 MiB each with two: most of what is left are the shared pages that either process writes after the fork
(docs/process-model.md, "A worker's idle memory", has the numbers). So only what a worker uses is imported here.

Why it is safe to fork here: ``ztunnel/__main__.py`` calls :meth:`Preforked.start` before the event loop, gRPC or
any other thread exists (but the log writer's, ``ztunnel/telemetry.py``, whose queue and thread a forked child
replaces with its own at once), so no fork copies a lock another thread holds; and before importing aiohttp or any
control-plane client, so no worker has them. Later, with threads running, the control process never forks: a
worker that has to be replaced is started as a new interpreter (the supervisor does it), which only costs more.

A preforked worker waits for its ``Start`` on its end of the channel, like any other; it dies with the control
process (``PR_SET_PDEATHSIG``, its parent being the control process's main thread).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import sys

from ztunnel.workers.process import die_with_parent, leave_signals_to_the_control_process

log = logging.getLogger("ztunnel.workers")


def serve_worker(fd: int) -> int:
    """Run one worker on ``fd`` (its end of the channel) until it exits; returns its exit status."""
    import uvloop

    from ztunnel.workers.channel import Channel
    from ztunnel.workers.worker import Worker

    sock = socket.socket(fileno=fd)
    worker = Worker(lambda handler, on_close: Channel(sock, handler, on_close, "control"))
    code = uvloop.run(worker.run())
    logging.shutdown()
    return int(code)


def _warm_up_tls() -> None:
    """One mutual-TLS handshake in memory, with a throwaway certificate, before the fork: OpenSSL and cryptography
    set up their algorithm and method tables on first use, and set up here they are shared by every worker instead of
    built in each (~5 MiB of each worker's private memory, measured; ~15 ms once, at start). Nothing is kept."""
    import ssl
    from datetime import timedelta

    from ztunnel import tls
    from ztunnel.identity.ca import LocalCA
    from ztunnel.identity.spiffe import Identity
    from ztunnel.workers.protocol import CertificateData

    try:
        ca = LocalCA.generate("warm-up.invalid")
        cert = CertificateData.of(ca.issue(Identity("warm-up.invalid", "ns", "sa"), timedelta(minutes=5)))
        workload = cert.certificate()  # the way a worker gets its certificates: PEM from the control process
        bios = [ssl.MemoryBIO() for _ in range(4)]
        client = tls.client_context(workload).wrap_bio(bios[0], bios[1], server_side=False, server_hostname=None)
        server = tls.server_context(workload).wrap_bio(bios[2], bios[3], server_side=True)
        for _ in range(4):  # TLS 1.3 with a client certificate: done in two round trips
            for end in (client, server):
                with contextlib.suppress(ssl.SSLWantReadError):
                    end.do_handshake()
            bios[2].write(bios[1].read())
            bios[0].write(bios[3].read())
    except Exception as e:  # only memory is at stake: say so and go on
        log.debug("TLS warm-up before forking the workers failed: %s", e)


def _decide_patches() -> None:
    """Decide, once for the whole ztunnel, which of ``ztunnel/thirdparty.py``'s patches apply to the installed
    libraries (and warn about those that do not), so that no worker looks the versions up itself: each lookup walks
    every ``dist-info`` on ``sys.path`` through ``importlib.metadata``, whose objects and code a worker would then
    write to (0.25 MiB of its idle PSS, measured). A required patch that cannot apply is left undecided: the
    control process's start then fails with that error, as before."""
    from ztunnel import thirdparty

    for patch in thirdparty.PATCHES:
        with contextlib.suppress(thirdparty.PatchError):
            thirdparty.enabled(patch)


class Preforked:
    """Worker processes forked at start, each waiting on its channel until the supervisor takes it."""

    def __init__(self) -> None:
        self._ready: list[tuple[int, socket.socket]] = []

    @classmethod
    def start(cls, count: int) -> Preforked:
        """Import what a worker runs and fork ``count`` of them. Call it before any thread exists."""
        import uvloop  # noqa: F401 - imported here so that every worker shares its pages

        import ztunnel.workers.channel
        import ztunnel.workers.worker  # noqa: F401

        _warm_up_tls()
        _decide_patches()
        out = cls()
        control = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        # What exists now is shared with every worker until someone writes to its page; a full collection, in any of
        # the processes, would write to all of them. Frozen, they are never collected (they live as long as the
        # process anyway: modules, functions, constants).
        gc.freeze()
        for _ in range(count):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                pid = os.fork()
            except OSError as e:
                ours.close()
                theirs.close()
                log.warning("could not fork a worker (%s): the supervisor starts it as a new interpreter", e)
                break
            if pid == 0:
                code = 1
                try:
                    ours.close()
                    for _, sock in out._ready:  # the earlier workers' channels are not this one's
                        sock.close()
                    die_with_parent(control)
                    leave_signals_to_the_control_process()
                    code = serve_worker(theirs.detach())
                finally:
                    os._exit(code)
            theirs.close()
            out._ready.append((pid, ours))
        return out

    def take(self) -> tuple[int, socket.socket] | None:
        """A forked worker (pid, the control's end of its channel), or None once all were taken."""
        return self._ready.pop(0) if self._ready else None

    def close(self) -> None:
        """Workers nobody took (ztunnel did not start): end them."""
        for pid, sock in self._ready:
            sock.close()  # the worker exits at the end of its channel
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._ready.clear()

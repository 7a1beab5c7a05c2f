"""The control process's side of the workers: it starts ``worker_threads`` worker processes, keeps each one's state
and certificates current, hands them the pods, restarts the ones that die, and gathers what they know for the
admin and stats servers.

- Spawning: the first workers were forked by the CLI before this process had a thread
  (:mod:`ztunnel.workers.prefork`: they share its memory); a worker started later is a new interpreter,
  ``python -m ztunnel.workers`` with one end of a unix ``socketpair`` inherited (``pass_fds``): this process never
  forks once it runs gRPC threads. The first messages are :class:`~ztunnel.workers.protocol.Start`, a
  :class:`~ztunnel.workers.protocol.Snapshot` of the state and, in-pod, an ``AddPod`` per current pod.
- State: every batch the control process applies (``ProxyState.observe``) goes to every worker as a ``Delta``,
  encoded once; certificates are asked for by the workers and pushed to them when the secret manager rotates them.
- Readiness: the ``workers`` task is released once every worker has said Ready (and caught up with the pods), and
  blocks again while one is down.
- Faults: a worker that exits is logged with its status and restarted after a backoff (0.1 s doubling to 10 s,
  back to 0.1 s once one has run 30 s); the others carry on. A worker that cannot start during ztunnel's own start
  (a port in use) fails the start, as the listener would have in one process.
- Shutdown: ``Drain`` to every worker, which drains within the deadline and exits; what is left after it is
  killed. A second SIGINT sends an immediate ``Drain``.
- Metrics: at each scrape (and every second, so a worker that dies loses at most a second of counts) each worker's
  families are fetched; counters and histograms are summed over the workers plus what the dead ones had counted
  (kept, so no series goes backwards), gauges over the live ones (each worker's is its share).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ztunnel.config import Config, ProxyMode, SocketAddress, WorkloadInfo
from ztunnel.errors import ZtunnelError
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.manager import CertificateProvider, CertificateUnavailable, SecretManager
from ztunnel.identity.spiffe import Identity
from ztunnel.inpod.netns import Netns, NetnsId
from ztunnel.metrics import Metric, Registry, Sample
from ztunnel.metrics_merge import MetricsMerger, snapshot
from ztunnel.readiness import BlockReady, Readiness
from ztunnel.sockets import SocketConfig, SocketFactory
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.tasks import TaskGroup
from ztunnel.workers import protocol as p
from ztunnel.workers.balance import LoadBoard
from ztunnel.workers.channel import Channel, ChannelClosed
from ztunnel.workers.prefork import Preforked

log = logging.getLogger("ztunnel.workers")

READINESS_TASK = "workers"
BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 10.0
BACKOFF_RESET_AFTER = 30.0  # a worker that ran this long starts the backoff again from BACKOFF_INITIAL
# How long a worker may take to answer a query or a pod change. Each is a few ms of work on its loop; a worker
# that needs seconds is stuck, and an admin request or a ZDS ack must not hang on it.
ANSWER_TIMEOUT = 10.0
METRICS_POLL = 1.0
# A worker's first Ready: an interpreter start plus imports (~0.5 s here) and binding its listeners.
START_TIMEOUT = 60.0
# After the drain deadline: time for a worker to close what it forced and exit before it is killed.
EXIT_GRACE = 5.0
# A worker whose channel ended without its process exiting is killed after this (it exits on its own at once).
CHANNEL_GRACE = 1.0


class WorkerStartError(ZtunnelError):
    """A worker could not start while ztunnel was starting; the message says which and why."""


OnDemand = Callable[[str], Awaitable[None]]


@dataclass(eq=False)
class WorkerHandle:
    """One worker slot: the process now in it (replaced on restart) and what the control process knows of it."""

    index: int
    pid: int | None = None  # its process now (forked at start, or a new interpreter)
    returncode: int | None = None  # once that process was reaped: its status (negative: killed by that signal)
    popen: subprocess.Popen[bytes] | None = None  # a new interpreter's Popen, told its status (no warning at exit)
    channel: Channel | None = None
    pidfd: int | None = None
    started: float = 0.0
    ready: bool = False
    generation: int | None = None
    failure: str | None = None  # what its last process said before it gave up (Failed)
    identities: set[Identity] = field(default_factory=set)
    restarts: int = 0
    backoff: float = BACKOFF_INITIAL
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    said_ready: asyncio.Event = field(default_factory=asyncio.Event)  # its current process sent Ready
    # The first process's start: None once it is ready, else why it could not start (ztunnel's start fails).
    started_result: asyncio.Future[str | None] | None = None

    @property
    def running(self) -> bool:
        return self.pid is not None and self.returncode is None

    def kill(self) -> None:
        """SIGKILL its process, through its pidfd (never a pid that could have been reused)."""
        if self.running and self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)


@dataclass(frozen=True)
class _Pod:
    info: WorkloadInfo
    netns: Netns


class Supervisor:
    """Starts and tends the worker processes; see the module docstring."""

    def __init__(
        self,
        config: Config,
        state: ProxyState,
        certs: CertificateProvider,
        readiness: Readiness,
        *,
        on_demand: OnDemand | None = None,
        prefork: Preforked | None = None,
        argv: Sequence[str] | None = None,
        synced: asyncio.Event | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.certs = certs
        self.readiness = readiness
        self.on_demand = on_demand
        # Set once the first xDS sync is in (None: the state is complete from the start): workers accept only then.
        self.synced = synced
        self.prefork = prefork  # the first workers, forked at start (ztunnel/workers/prefork.py)
        # The command of a worker started later (a restart): its index, the fd and this process's pid are appended.
        self.argv = list(argv) if argv is not None else [sys.executable, "-m", "ztunnel.workers"]
        self.handles = [WorkerHandle(i) for i in range(max(1, config.worker_threads))]
        self.tasks = TaskGroup("supervisor")
        self.pods: dict[str, _Pod] = {}
        # Each worker's last metrics snapshot, and what exited ones counted (ztunnel/metrics_merge.py).
        self.merger = MetricsMerger()
        self.draining = False
        self._block: BlockReady | None = None
        # With several workers: the shared counts by which they spread inbound HBONE connections
        # (ztunnel/workers/balance.py), made at start; and how many connections went from worker i to worker j
        # (j None: none could take it).
        self.board: LoadBoard | None = None
        self.handoffs: Counter[tuple[int, int | None]] = Counter()

    # -- start -----------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until each is serving. Raises :class:`WorkerStartError` (after stopping the
        others) when one cannot start."""
        self._block = self.readiness.register(READINESS_TASK)
        if self.config.proxy_mode is ProxyMode.DEDICATED:
            self._probe_ports()
        self.state.observe(self._state_applied)
        if isinstance(self.certs, SecretManager):
            self.certs.watch(self._certificate_changed)
        if len(self.handles) > 1 and self.board is None:
            self.board = LoadBoard.create(len(self.handles))
        if self.synced is not None and not self.synced.is_set():
            self.tasks.spawn(self._serve_after_sync(self.synced), "serve after the first xDS sync")
        loop = asyncio.get_running_loop()
        for h in self.handles:
            h.started_result = loop.create_future()
            self._spawn(h)
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(h.started_result for h in self.handles if h.started_result is not None)),
                START_TIMEOUT,
            )
        except BaseException as e:
            self.kill_all()
            if isinstance(e, TimeoutError):
                raise WorkerStartError(f"workers did not start within {START_TIMEOUT:g}s") from None
            raise
        errors = [r for r in results if r is not None]
        if errors:
            self.kill_all()
            raise WorkerStartError(errors[0])
        self.tasks.spawn(self._poll_metrics(), "metrics poll")
        log.info("%d worker process%s serving", len(self.handles), "" if len(self.handles) == 1 else "es")

    def _probe_ports(self) -> None:
        """Dedicated mode: fail now, as one process would, when a listener's address is taken. Each worker binds with
        SO_REUSEPORT, which would otherwise share the port with any process of this user that also asks for it;
        a plain bind here sees everyone holding it. Port 0 would give each worker a port of its own."""
        cfg = self.config
        addrs: list[tuple[str, SocketAddress]] = []
        if cfg.enable_proxy:
            addrs += [
                ("inbound", cfg.inbound_addr),
                ("inbound plaintext", cfg.inbound_plaintext_addr),
                ("outbound", cfg.outbound_addr),
            ]
            if cfg.socks5_addr is not None:
                addrs.append(("socks5", cfg.socks5_addr))
        if cfg.dns_proxy:
            addrs.append(("dns", cfg.dns_proxy_addr))
        probe = SocketFactory(SocketConfig())
        for name, addr in addrs:
            if addr.port == 0:
                if len(self.handles) > 1:
                    raise WorkerStartError(
                        f"the {name} listener's port is 0 (any): with {len(self.handles)} worker processes each would "
                        "get a different port; give it a port, or set ZTUNNEL_WORKER_THREADS=1"
                    )
                continue
            try:
                socks = [s for s, _ in probe.listeners(addr, ipv6=cfg.ipv6_enabled)]
                if name == "dns":
                    socks += probe.udp_listeners(addr, ipv6=cfg.ipv6_enabled)
            except OSError as e:
                raise WorkerStartError(f"{name} listener {addr}: {e.strerror or e}") from None
            for s in socks:
                s.close()

    # -- spawning and exits ----------------------------------------------------------------------------------------

    def _spawn(self, h: WorkerHandle) -> None:
        pid, ours = self._start_process(h)
        h.pid = pid
        h.returncode = None
        h.started = time.monotonic()
        h.ready = False
        h.generation = None
        h.failure = None
        h.identities = set()
        h.exited = asyncio.Event()
        h.said_ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        h.pidfd = os.pidfd_open(pid)
        loop.add_reader(h.pidfd, self._exited, h)
        channel = h.channel = Channel(
            ours,
            lambda msg, fds: self._handle(h, channel, msg, fds),
            lambda reason: self._channel_closed(h, channel, reason),
            f"worker {h.index}",
        )
        on_demand = self.on_demand is not None
        board = self.board
        channel.send(
            p.Start(h.index, self.config, on_demand=on_demand, load_board=board is not None),
            [board.fd] if board is not None else [],
        )
        channel.send(p.snapshot_of(self.state))
        if self.synced is None or self.synced.is_set():
            channel.send(p.Serve())
        # In-pod: the pods it must serve before it counts as ready (a ZDS add meanwhile reaches it the usual way).
        catch_up = [self._add_pod(h, uid, pod.info, pod.netns) for uid, pod in self.pods.items()]
        self.tasks.spawn(self._become_ready(h, channel, catch_up), f"worker {h.index} start")
        log.info("worker %d started (pid %d)", h.index, pid)

    def _start_process(self, h: WorkerHandle) -> tuple[int, socket.socket]:
        """A process for the worker and the control's end of its channel: one forked at start while there is one,
        else a new interpreter (``python -m ztunnel.workers``)."""
        h.popen = None
        taken = self.prefork.take() if self.prefork is not None else None
        if taken is not None:
            return taken
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            h.popen = subprocess.Popen(
                [*self.argv, "--index", str(h.index), str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        return h.popen.pid, ours

    def _reap(self, h: WorkerHandle) -> None:
        """Collect the exited worker's status into ``h.returncode`` (None if it cannot be had)."""
        assert h.pid is not None
        try:
            _pid, status = os.waitpid(h.pid, 0)  # it has exited (its pidfd said so): this does not block
        except ChildProcessError:
            return
        h.returncode = os.waitstatus_to_exitcode(status)
        if h.popen is not None:
            h.popen.returncode = h.returncode

    async def _become_ready(self, h: WorkerHandle, channel: Channel, catch_up: Sequence[Awaitable[str | None]]) -> None:
        errors = [e for e in await asyncio.gather(*catch_up) if e is not None]
        for error in errors:
            log.warning("worker %d: %s", h.index, error)
        said_ready = h.said_ready
        await said_ready.wait()  # usually long before the pods' acks; set on exit too
        if h.channel is not channel:
            return
        h.ready = True
        if self.board is not None and not self.draining:
            self.board.set_up(h.index, True)
        if h.started_result is not None and not h.started_result.done():
            h.started_result.set_result(None)
        log.info("worker %d (pid %s) ready", h.index, h.pid)
        self._update_readiness()

    def _exited(self, h: WorkerHandle) -> None:
        loop = asyncio.get_running_loop()
        assert h.pidfd is not None and h.pid is not None
        loop.remove_reader(h.pidfd)
        self._reap(h)
        os.close(h.pidfd)
        h.pidfd = None
        code = h.returncode
        ran = time.monotonic() - h.started
        self.merger.exited(h.index)  # its counters are kept, its gauges dropped
        if self.board is not None:
            self.board.forget(h.index)
        if h.channel is not None:
            h.channel.close("the worker exited")
        h.ready = False
        h.exited.set()
        h.said_ready.set()  # wakes its start task, which sees the channel gone
        self._update_readiness()
        status = _status(code)
        if self.draining:
            level = logging.INFO if code == 0 else logging.WARNING
            log.log(level, "worker %d (pid %d) %s", h.index, h.pid, status)
            return
        first = h.started_result
        if first is not None and not first.done():
            log.error("worker %d (pid %d) %s before it was ready", h.index, h.pid, status)
            # What the worker said is what one process would have said (e.g. a listener's error), word for word.
            first.set_result(h.failure or f"worker {h.index} {status} before it was ready")
            return  # start() fails with it
        if ran >= BACKOFF_RESET_AFTER:
            h.backoff = BACKOFF_INITIAL
        delay = h.backoff
        h.backoff = min(h.backoff * 2, BACKOFF_MAX)
        why = f" ({h.failure})" if h.failure else ""
        log.warning(
            "worker %d (pid %d) %s%s after %.1fs; restarting it in %gs",
            h.index,
            h.pid,
            status,
            why,
            ran,
            delay,
        )
        self.tasks.spawn(self._restart(h, delay), f"restart worker {h.index}")

    async def _restart(self, h: WorkerHandle, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.draining:
            return
        h.restarts += 1
        try:
            self._spawn(h)
        except OSError as e:
            retry = h.backoff
            h.backoff = min(h.backoff * 2, BACKOFF_MAX)
            log.error("worker %d could not be started: %s; trying again in %gs", h.index, e, retry)
            self.tasks.spawn(self._restart(h, retry), f"restart worker {h.index}")

    def _channel_closed(self, h: WorkerHandle, channel: Channel, reason: str) -> None:
        if h.channel is not channel:
            return
        h.channel = None
        h.ready = False
        if self.board is not None:
            self.board.set_up(h.index, False)
        self._update_readiness()
        pid = h.pid
        if pid is None or self.draining or reason == "the worker exited":
            return

        def kill() -> None:
            # Without its channel a worker is useless (no state, no certificates): end it, and the exit restarts it.
            # A worker that is exiting closes its end first; give it a moment before saying anything.
            if h.running and h.pid == pid:
                log.warning("worker %d (pid %d): channel ended (%s); killing it", h.index, pid, reason)
                h.kill()

        asyncio.get_running_loop().call_later(CHANNEL_GRACE, kill)

    def _update_readiness(self) -> None:
        if self.draining:
            return
        if all(h.ready for h in self.handles):
            if self._block is not None:
                self._block.release()
                self._block = None
        elif self._block is None:
            self._block = self.readiness.register(READINESS_TASK)

    def live(self) -> list[WorkerHandle]:
        """The workers with a channel now (starting or serving)."""
        return [h for h in self.handles if h.channel is not None]

    def kill_all(self) -> None:
        for h in self.handles:
            h.kill()

    # -- messages from workers ---------------------------------------------------------------------------------------

    def _handle(self, h: WorkerHandle, channel: Channel, msg: p.Message, fds: list[int]) -> None:
        if isinstance(msg, p.HandOff):
            self._hand_off(h, channel, msg, fds)
            return
        _close(fds)  # only a HandOff carries one
        match msg:
            case p.Ready():
                h.generation = msg.generation
                h.said_ready.set()
            case p.Failed():
                h.failure = msg.reason
                log.error("worker %d (pid %s) cannot serve: %s", h.index, h.pid, msg.reason)
            case p.Resync():
                log.error(
                    "worker %d lost track of the state (had batch %s, got %d): sending it a fresh snapshot",
                    h.index,
                    msg.have,
                    msg.got,
                )
                channel.send(p.snapshot_of(self.state))
            case p.CertificateRequest():
                self.tasks.spawn(self._certificate(h, channel, msg), f"worker {h.index} certificate")
            case p.OnDemandRequest():
                self.tasks.spawn(self._on_demand(channel, msg), f"worker {h.index} on-demand")
            case _:
                log.warning("worker %d sent an unexpected %s", h.index, p.describe(msg))

    # -- inbound connections handed from one worker to another -------------------------------------------------------

    def _hand_off(self, h: WorkerHandle, channel: Channel, msg: p.HandOff, fds: list[int]) -> None:
        if not fds:
            log.warning("worker %d handed over a connection without its socket", h.index)
            with contextlib.suppress(ChannelClosed):
                channel.send(p.Ack(msg.request_id, "no socket came with it"))
            return
        fd = fds.pop(0)
        _close(fds)
        self.tasks.spawn(self._relay(h, channel, msg, fd), f"worker {h.index} handoff")

    async def _relay(self, origin: WorkerHandle, channel: Channel, msg: p.HandOff, fd: int) -> None:
        """Give the socket to ``msg.target``; if it cannot take it, back to the worker that accepted it, else to any
        other. This process keeps its copy until one acknowledged (before reading from it), so a refusal or a worker
        that dies meanwhile never costs the connection: nothing has been read from it."""
        order = dict.fromkeys([msg.target, origin.index, *(h.index for h in self.handles)])
        taken: int | None = None
        refused: list[str] = []
        try:
            for index in order:
                h = self.handles[index] if 0 <= index < len(self.handles) else None
                target = h.channel if h is not None else None
                if h is None or target is None or not h.ready:
                    refused.append(f"worker {index}: not serving")
                    continue
                log.debug("inbound connection accepted by worker %d: handing it to worker %d", origin.index, index)
                try:
                    ack = await target.call(p.HandIn(msg.key, origin.index), [fd], p.Ack)
                except ChannelClosed:
                    refused.append(f"worker {index}: gone")
                    continue
                if ack.error is None:
                    taken = index
                    break
                refused.append(f"worker {index}: {ack.error}")
        finally:
            os.close(fd)
            self.handoffs[(origin.index, taken)] += 1
        if taken is None:
            log.warning(
                "an inbound connection accepted by worker %d was closed: no worker could take it (%s)",
                origin.index,
                "; ".join(refused),
            )
        elif taken != msg.target:
            log.info(
                "an inbound connection accepted by worker %d went to worker %d instead of %d (%s)",
                origin.index,
                taken,
                msg.target,
                "; ".join(refused),
            )
        with contextlib.suppress(ChannelClosed):
            channel.send(p.Ack(msg.request_id, None if taken == msg.target else "; ".join(refused)))

    async def _certificate(self, h: WorkerHandle, channel: Channel, req: p.CertificateRequest) -> None:
        identity = req.identity
        try:
            cert = await self.certs.fetch_certificate(identity)
        except CertificateUnavailable as e:
            reply = p.CertificateReply(req.request_id, identity, None, str(e), e.reason)
        except Exception as e:
            reason = str(e) or type(e).__name__
            reply = p.CertificateReply(
                req.request_id, identity, None, f"no certificate for {identity}: {reason}", reason
            )
        else:
            if h.channel is channel:
                h.identities.add(identity)
            reply = p.CertificateReply(req.request_id, identity, p.CertificateData.of(cert))
        with contextlib.suppress(ChannelClosed):
            channel.send(reply)

    async def _on_demand(self, channel: Channel, req: p.OnDemandRequest) -> None:
        try:
            if self.on_demand is not None:
                await self.on_demand(req.name)
        except Exception as e:  # the worker decides without it, as after a timeout
            log.warning("on-demand lookup of %s failed: %s", req.name, e)
        with contextlib.suppress(ChannelClosed):
            channel.send(p.OnDemandDone(req.request_id))

    # -- what the workers are told ---------------------------------------------------------------------------------

    async def _serve_after_sync(self, synced: asyncio.Event) -> None:
        await synced.wait()
        frame = p.encode(p.Serve())
        for h in self.live():  # a worker started from now on gets it with its snapshot
            assert h.channel is not None
            with contextlib.suppress(ChannelClosed):
                h.channel.send_frame(frame)

    def _state_applied(self, update: StateUpdate, version: int) -> None:
        frame = p.encode(p.Delta(version, update))  # once, for every worker
        for h in self.live():
            assert h.channel is not None
            with contextlib.suppress(ChannelClosed):
                h.channel.send_frame(frame)

    def _certificate_changed(self, identity: Identity, cert: WorkloadCertificate | None) -> None:
        data: p.CertificateData | None = None
        for h in self.live():
            if identity not in h.identities:
                continue
            if cert is None:
                h.identities.discard(identity)
            elif data is None:
                data = p.CertificateData.of(cert)
            assert h.channel is not None
            with contextlib.suppress(ChannelClosed):
                h.channel.send(p.CertificatePush(identity, data))

    def set_log_level(self, reset: bool, spec: str) -> None:
        """The admin changed the log filter: the workers follow."""
        for h in self.live():
            assert h.channel is not None
            with contextlib.suppress(ChannelClosed):
                h.channel.send(p.SetLogLevel(reset, spec))

    # -- pods (in-pod mode) ------------------------------------------------------------------------------------------

    async def add_pod(self, uid: str, info: WorkloadInfo, netns: Netns) -> RemotePod:
        """Start the pod's listeners in every worker; returns once all have (the ZDS ack waits for this). A worker
        that fails fails the add (undone in the others); one that dies meanwhile gets the pod when it restarts."""
        self.pods[uid] = _Pod(info, netns)
        errors = [e for e in await asyncio.gather(*(self._add_pod(h, uid, info, netns) for h in self.live())) if e]
        if errors:
            await self.del_pod(uid)
            raise ZtunnelError("; ".join(errors))
        return RemotePod(self, uid, netns.id)

    async def _add_pod(self, h: WorkerHandle, uid: str, info: WorkloadInfo, netns: Netns) -> str | None:
        channel = h.channel
        if channel is None:
            return None
        try:
            ack = await asyncio.wait_for(channel.call(p.AddPod(uid, info), [netns.fd], p.Ack), ANSWER_TIMEOUT)
        except ChannelClosed:
            return None  # it died: its restart adds every current pod
        except TimeoutError:
            return f"worker {h.index} did not start the pod's proxies within {ANSWER_TIMEOUT:g}s"
        return f"worker {h.index}: {ack.error}" if ack.error else None

    async def del_pod(self, uid: str) -> None:
        """Close the pod's listeners and connections in every worker; returns once all have."""
        self.pods.pop(uid, None)

        async def one(h: WorkerHandle) -> None:
            channel = h.channel
            if channel is None:
                return
            try:
                ack = await asyncio.wait_for(channel.call(p.DelPod(uid), (), p.Ack), ANSWER_TIMEOUT)
            except ChannelClosed:
                return
            except TimeoutError:
                log.warning("worker %d did not stop %s's proxies within %gs", h.index, uid, ANSWER_TIMEOUT)
                return
            if ack.error:
                log.warning("worker %d: stopping %s: %s", h.index, uid, ack.error)

        await asyncio.gather(*(one(h) for h in self.live()))

    # -- gathering -------------------------------------------------------------------------------------------------

    async def _ask(
        self, handles: list[WorkerHandle], msg: p.Request, timeout: float, what: str
    ) -> list[tuple[WorkerHandle, Any]]:
        """``msg`` to each of ``handles`` at once, each answered by a Reply within ``timeout``: (handle, value) of
        those that answered; one that did not is left out, with a warning unless its channel closed."""

        async def one(h: WorkerHandle) -> Any:
            assert h.channel is not None
            reply = await asyncio.wait_for(h.channel.call(msg, (), p.Reply), timeout)
            return reply.value

        results = await asyncio.gather(*(one(h) for h in handles), return_exceptions=True)
        out = []
        for h, r in zip(handles, results, strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, ChannelClosed):
                    log.warning("worker %d did not answer %s: %s", h.index, what, r or type(r).__name__)
                continue
            out.append((h, r))
        return out

    async def _query(self, what: str) -> list[tuple[WorkerHandle, Any]]:
        # Only workers whose process has said Ready: one still starting (a new interpreter after a restart takes
        # ~0.5 s to import, several seconds on a loaded node) answers nothing before it has started and has no
        # connections or counts yet, so waiting for it would only hold a scrape (Prometheus gives up at 10 s).
        started = [h for h in self.live() if h.said_ready.is_set()]
        return await self._ask(started, p.Query(what), ANSWER_TIMEOUT, what)

    async def profile(
        self, process: str, kind: str, seconds: int = 0, frequency: int = 0, activate: bool | None = None
    ) -> list[tuple[str, Any]]:
        """The admin's profiling request (``Profile``) answered by the live workers ``process`` names (``all`` or
        ``worker-<i>``; no other worker is asked, so none samples or switches heap profiling for nothing), as
        ``("worker-<i>", value)`` (value: the worker's answer, or a ``ProfileFailed``). A worker that does not answer
        within the profile's seconds plus ``ANSWER_TIMEOUT`` is left out, with a warning."""
        handles = [h for h in self.live() if process in ("all", f"worker-{h.index}")]
        msg = p.Profile(kind, seconds, frequency, activate)
        answered = await self._ask(handles, msg, seconds + ANSWER_TIMEOUT, f"the {kind} profile")
        return [(f"worker-{h.index}", value) for h, value in answered]

    async def connections(self) -> list[dict[str, Any]]:
        """The admin ``/connections`` rows of every worker, each with its ``worker`` index."""
        return [row for _, rows in await self._query("connections") for row in rows]

    async def pod_connections(self) -> dict[str, dict[str, list[Any]]]:
        """Each pod's ``connections`` for the config dump's ``workloadState``, over every worker."""
        out: dict[str, dict[str, list[Any]]] = {}
        for _, pods in await self._query("pods"):
            for uid, conns in pods.items():
                entry = out.setdefault(uid, {"inbound": [], "outbound": []})
                entry["inbound"] += conns["inbound"]
                entry["outbound"] += conns["outbound"]
        return out

    async def refresh_metrics(self) -> None:
        """Fetch every live worker's metrics snapshot (each scrape, and every second)."""
        for h, snap in await self._query("metrics"):
            if h.channel is not None:  # not one that exited while answering: its exit retained its last one
                self.merger.update(h.index, snap)

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_POLL)
            await self.refresh_metrics()

    async def collect_metrics(self, registry: Registry) -> list[Metric]:
        """What a scrape of 15020 shows: this process's families (``registry``) with every worker's merged in
        (fetched now), the merge's per-worker families, then whether each worker is serving and its restarts."""
        await self.refresh_metrics()
        return self.merger.families(snapshot(registry)) + self._worker_metrics()

    def _worker_metrics(self) -> list[Metric]:
        unstable = "(unstable)"
        up = Metric("ztunnel_worker_up", f"Whether the data-plane worker process is serving {unstable}", "gauge")
        restarts = Metric(
            "ztunnel_worker_restarts", f"The number of times the worker process was restarted {unstable}", "counter"
        )
        for h in self.handles:
            labels = {"worker": str(h.index)}
            up.samples.append(Sample("ztunnel_worker_up", labels, 1.0 if h.ready else 0.0))
            restarts.samples.append(Sample("ztunnel_worker_restarts_total", labels, float(h.restarts)))
        handoffs = Metric(
            "ztunnel_worker_inbound_handoffs",
            f"Inbound HBONE connections a worker accepted and passed to the worker named by 'to' {unstable}",
            "counter",
        )
        for (origin, taken), n in sorted(
            self.handoffs.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1])
        ):
            labels = {"worker": str(origin), "to": "none" if taken is None else str(taken)}
            handoffs.samples.append(Sample("ztunnel_worker_inbound_handoffs_total", labels, float(n)))
        return [up, restarts, handoffs]

    # -- shutdown --------------------------------------------------------------------------------------------------

    async def drain(self, graceful: bool, deadline: float) -> None:
        """Tell every worker to drain (``deadline`` seconds when graceful) and wait for them all to exit; kill what is
        left ``EXIT_GRACE`` seconds after the deadline."""
        self.draining = True
        if self.board is not None:
            for h in self.handles:  # nothing is handed over during a drain: no worker takes new connections
                self.board.set_up(h.index, False)
        for h in self.live():
            assert h.channel is not None
            with contextlib.suppress(ChannelClosed):
                h.channel.send(p.Drain(graceful, deadline))
        waiting = [h.exited.wait() for h in self.handles if h.pid is not None and not h.exited.is_set()]
        try:
            await asyncio.wait_for(asyncio.gather(*waiting), (deadline if graceful else 0) + EXIT_GRACE)
        except TimeoutError:
            left = [h for h in self.handles if h.running]
            log.warning("worker(s) %s still running after the drain; killing them", [h.index for h in left])
            self.kill_all()
            waiting = [h.exited.wait() for h in left if not h.exited.is_set()]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waiting), EXIT_GRACE)
        await self.tasks.cancel_all(timeout=1.0)

    def force(self) -> None:
        """A second SIGINT during the drain: every worker closes what it still has, now."""
        for h in self.live():
            assert h.channel is not None
            with contextlib.suppress(ChannelClosed):
                h.channel.send(p.Drain(False, 0.0))


class RemotePod:
    """A pod's proxies in every worker (the in-pod state manager's ``PodProxies``)."""

    def __init__(self, supervisor: Supervisor, uid: str, netns_id: NetnsId) -> None:
        self.supervisor = supervisor
        self.uid = uid
        self.netns_id = netns_id

    async def stop(self, immediate: bool) -> None:
        await self.supervisor.del_pod(self.uid)


class PodFanout:
    """The in-pod state manager's ``ProxyFactory`` in the multi-process data plane: a pod starts in every worker."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    async def start(self, uid: str, info: WorkloadInfo, netns: Netns) -> RemotePod:
        return await self.supervisor.add_pod(uid, info, netns)


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _status(code: int | None) -> str:
    if code is None:
        return "is gone"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


__all__ = [
    "PodFanout",
    "RemotePod",
    "Supervisor",
    "WorkerHandle",
    "WorkerStartError",
]

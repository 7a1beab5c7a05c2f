"""What a scenario is (:class:`DataScenario`) and what it may use (:class:`Context`)."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from bench.clients import Clients
from bench.procstat import owner, process_tree, workers_of
from bench.profiles import Profile
from bench.progress import Progress
from bench.recorder import Recorder
from bench.topology import PATH_PROXIES, Topology

T = TypeVar("T")


@dataclass
class Context:
    """The run as a scenario sees it: settings, the client processes, where samples go, the progress lines."""

    profile: Profile
    modes: tuple[str, ...]  # the data-path modes that can run here
    reps: int
    fd_limit: int  # RLIMIT_NOFILE in force for every process the run starts
    workdir: Path
    ztunnel_env: dict[str, str]
    clients: Clients
    recorder: Recorder
    progress: Progress

    def call(self, cmd: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Send a command to the route's client process (see :meth:`Clients.call`)."""
        return self.clients.call(cmd, timeout)

    def pids(self, topo: Topology, route: Mapping[str, Any]) -> dict[str, int]:
        """The processes a client samples the CPU of: the topology's with every proxy's worker processes
        (:func:`~bench.procstat.process_tree`, read afresh: a restarted worker has a new pid), and the route's
        client."""
        return {**process_tree(topo.pids()), "client": self.clients.pid(route.get("client", "default"))}


def rotated(modes: Sequence[T], rep: int) -> list[T]:
    """``modes`` rotated by one per repetition, so no mode is always first after a start, or always after another
    (process models too)."""
    ms = list(modes)
    if not ms:
        return ms
    k = rep % len(ms)
    return ms[k:] + ms[:k]


def proxy_cpu(mode: str, cpu: Mapping[str, float]) -> float:
    """CPU seconds of the proxies on ``mode``'s path (each with all its processes), from a client's per-process
    sample."""
    path = PATH_PROXIES[mode]
    return sum(v for name, v in cpu.items() if owner(name) in path)


def proxy_kernel(mode: str, res: Mapping[str, Any]) -> float | None:
    """The kernel's part of :func:`proxy_cpu` (the client's ``cpu_kernel``), or None when the client sent none."""
    kernel = res.get("cpu_kernel")
    if kernel is None:
        return None
    return proxy_cpu(mode, kernel)


def process_split(mode: str, cpu: Mapping[str, float], seconds: float) -> dict[str, Any]:
    """How the proxies on ``mode``'s path used the CPU over a window of ``seconds``: ``proxy_cores`` (CPU seconds
    per second, all their processes), the busiest proxy's cores, and for proxies with worker processes each
    worker's CPU seconds and share of its proxy's worker CPU (``worker_share_min``/``_max`` over all of them)."""
    path = PATH_PROXIES[mode]
    if not path or seconds <= 0:
        return {}
    per_proxy = {p: sum(v for name, v in cpu.items() if owner(name) == p) for p in path}
    out: dict[str, Any] = {
        "proxy_cores": round(sum(per_proxy.values()) / seconds, 3),
        "busiest_proxy_cores": round(max(per_proxy.values()) / seconds, 3),
    }
    workers: dict[str, dict[str, float]] = {}
    shares: list[float] = []
    for p in path:
        names = workers_of(cpu, p)
        if not names:
            continue
        workers[p] = {n.partition("/")[2]: round(cpu[n], 6) for n in names}
        total = sum(cpu[n] for n in names)
        if total > 0:
            shares += [cpu[n] / total for n in names]
    if workers:
        out["worker_cpu_s"] = workers
        out["workers_found"] = {p: len(w) for p, w in workers.items()}
    if shares:
        out["worker_share_min"] = round(min(shares), 3)
        out["worker_share_max"] = round(max(shares), 3)
    return out


class DataScenario(abc.ABC):
    """A data-path scenario: measured in every repetition, with every mode, in the repetition's order."""

    name: ClassVar[str]
    # Not None: the scenario runs last in a repetition, on proxies started again for it alone; the text says what
    # for in the progress line ("proxies restarted for <fresh_proxies>").
    fresh_proxies: ClassVar[str | None] = None

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.p = ctx.profile

    @abc.abstractmethod
    def seconds(self) -> float:
        """Planned seconds per repetition (the progress estimate)."""

    def after_start(self, topo: Topology, rep: int) -> None:  # noqa: B027 - optional hook: most do nothing here
        """Right after a repetition's proxies started and settled, before the warm-up."""

    @abc.abstractmethod
    def run(self, topo: Topology, rep: int, order: Sequence[str]) -> None:
        """Measure every case with the modes in ``order``; samples and failures go to ``ctx.recorder``."""

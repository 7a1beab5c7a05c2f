"""What a scenario is (:class:`DataScenario`) and what it may use (:class:`Context`)."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bench.clients import Clients
from bench.profiles import Profile
from bench.progress import Progress
from bench.recorder import Recorder
from bench.topology import PATH_PROXIES, Topology


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
        """The processes a client samples the CPU of: the topology's and the route's client."""
        return {**topo.pids(), "client": self.clients.pid(route.get("client", "default"))}


def rotated(modes: Sequence[str], rep: int) -> list[str]:
    """``modes`` rotated by one per repetition, so no mode is always first after a start, or always after another."""
    ms = list(modes)
    if not ms:
        return ms
    k = rep % len(ms)
    return ms[k:] + ms[:k]


def proxy_cpu(mode: str, cpu: Mapping[str, float]) -> float:
    """CPU seconds of the proxies on ``mode``'s path, from a client's per-process sample."""
    return sum(cpu.get(p, 0.0) for p in PATH_PROXIES[mode])


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

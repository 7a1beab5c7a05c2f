"""Graceful and immediate drain, as one object (upstream ``drain.rs``).

A :class:`Drain` is triggered once. Listeners stop accepting as soon as it starts; connections watch it and either
finish on their own or are force-closed when the deadline passes. ``Immediate`` drains (a pod deleted: nobody is
left to finish with) skip the grace period.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable

log = logging.getLogger("ztunnel.drain")


class DrainMode(enum.Enum):
    GRACEFUL = "graceful"
    IMMEDIATE = "immediate"


class Drain:
    """A one-shot shutdown signal with a deadline; cheap to check on the connection path."""

    def __init__(self, name: str = "ztunnel") -> None:
        self.name = name
        self.mode: DrainMode | None = None
        self.started_at: float | None = None
        self._started = asyncio.Event()
        self._force = asyncio.Event()

    @property
    def draining(self) -> bool:
        return self.mode is not None

    def start(self, mode: DrainMode = DrainMode.GRACEFUL) -> None:
        """Begin draining; an immediate drain also forces at once. Repeated calls can only escalate."""
        if self.mode is None:
            self.mode = mode
            self.started_at = time.monotonic()
            log.info("%s: starting %s drain", self.name, mode.value)
            self._started.set()
        if mode is DrainMode.IMMEDIATE:
            self.mode = DrainMode.IMMEDIATE
            self._force.set()

    def force(self) -> None:
        """The deadline passed: everything still open must close now."""
        self.mode = self.mode or DrainMode.IMMEDIATE
        self._started.set()
        self._force.set()

    @property
    def forced(self) -> bool:
        return self._force.is_set()

    async def wait_started(self) -> None:
        await self._started.wait()

    async def wait_forced(self) -> None:
        await self._force.wait()


async def drain_together(parts: list[tuple[str, Awaitable[None]]]) -> None:
    """Run the named drains side by side (one deadline for all, as upstream's one drain signal) until each ended; one
    that fails is logged with its name and never cuts the others short."""
    results = await asyncio.gather(*(part for _, part in parts), return_exceptions=True)
    for (name, _), result in zip(parts, results, strict=True):
        if isinstance(result, Exception):
            log.error("draining %s failed: %s", name, result or type(result).__name__)

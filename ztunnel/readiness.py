"""Readiness: a registry of named tasks that must complete before ztunnel reports ready (upstream ``readiness.rs``).

``GET /healthz/ready`` on 15021 answers 200 ``ready`` when nothing is pending, else 500 listing what is. Draining
makes ztunnel not ready again so a rolling update stops sending it new work.
"""

from __future__ import annotations

from collections import Counter


class Readiness:
    def __init__(self) -> None:
        self._pending: Counter[str] = Counter()
        self.draining = False

    def register(self, name: str) -> BlockReady:
        """Block readiness on ``name`` until the returned token's :meth:`BlockReady.release` is called."""
        self._pending[name] += 1
        return BlockReady(self, name)

    def _release(self, name: str) -> None:
        self._pending[name] -= 1
        if self._pending[name] <= 0:
            del self._pending[name]

    def pending(self) -> list[str]:
        return sorted(self._pending)

    @property
    def ready(self) -> bool:
        return not self._pending and not self.draining


class BlockReady:
    """One pending readiness task; releasing twice is harmless."""

    def __init__(self, readiness: Readiness, name: str) -> None:
        self._readiness = readiness
        self.name = name
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._readiness._release(self.name)

    def subtask(self, name: str) -> BlockReady:
        return self._readiness.register(name)

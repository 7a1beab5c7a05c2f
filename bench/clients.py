"""The client processes (``bench.worker``) as the orchestrator drives them: one per client name, one JSON command
per line, replaced when one hangs or dies."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any


class WorkerError(RuntimeError):
    """A command failed; ``fatal`` when the worker hung or died (it must be replaced)."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


class Worker:
    """A ``bench.worker`` client process and its one-line-per-command protocol."""

    def __init__(self, log_path: Path, prefix: Sequence[str] = ()) -> None:
        """``prefix`` wraps the command (``ip netns exec <ns>`` to run the client inside a pod)."""
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.prefix = list(prefix)
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "bench.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, cmd: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise WorkerError(
                f"worker gave no answer to {cmd['op']} within {timeout:g}s (log: {self.log_path})", fatal=True
            )
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"worker exited ({self.proc.poll()}); log: {self.log_path}", fatal=True)
        out: dict[str, Any] = json.loads(line)
        if not out.get("ok"):
            raise WorkerError(f"{cmd['op']} failed: {out.get('error')}\n{out.get('traceback', '')}")
        return out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Clients:
    """The run's client processes by name (a topology names them; routes say which one to use)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.workers: dict[str, Worker] = {}
        self.replaced = 0  # workers replaced so far (names the replacements' logs)

    def start(self, name: str, prefix: Sequence[str]) -> None:
        self.workers[name] = Worker(self.workdir / f"worker-{name}.log", prefix)

    def pid(self, name: str) -> int:
        return self.workers[name].pid

    def pids(self) -> dict[str, int]:
        return {name: w.pid for name, w in self.workers.items()}

    def call(self, cmd: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Send a command to the route's client process; one that hangs or dies is replaced before the error is
        raised."""
        name = cmd.get("route", {}).get("client", "default")
        worker = self.workers[name]
        try:
            return worker.call(cmd, timeout)
        except WorkerError as e:
            if e.fatal:
                worker.kill()
                self.replaced += 1
                self.workers[name] = Worker(self.workdir / f"worker-{name}-{self.replaced + 1}.log", worker.prefix)
            raise

    def close(self) -> None:
        for w in self.workers.values():
            w.close()

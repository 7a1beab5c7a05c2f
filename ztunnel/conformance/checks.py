"""Checks as data, their verdicts and the runner.

A :class:`Check` names what it sends, what upstream ztunnel does in that situation (the behaviour the target is held
to, with the upstream source it was read from) and the verdict rule. Its coroutine returns an :class:`Outcome`:

* ``PASS``: the target behaves as upstream does.
* ``DIFF``: the target behaves differently from upstream but within HTTP/2, TLS and HBONE as upstream peers accept
  (another SETTINGS value, 400 where upstream resets the stream, no keepalive PINGs). Reported, not a failure,
  unless ``--strict``.
* ``FAIL``: the target broke the protocol or would break an upstream peer (a tunnel opened for a malformed
  request, DATA beyond the window, a refused certificate accepted).
* ``SKIP``: the check could not run here; the reason says why (e.g. no CA key to sign test certificates).
* ``ERROR``: the check itself could not get as far as a verdict (connection refused, timeout); counts as a failure.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ztunnel.errors import ZtunnelError

Ctx = TypeVar("Ctx")


class Verdict(enum.StrEnum):
    PASS = "PASS"
    DIFF = "DIFF"
    FAIL = "FAIL"
    SKIP = "SKIP"
    ERROR = "ERROR"


FAILING = frozenset({Verdict.FAIL, Verdict.ERROR})


@dataclass(frozen=True, slots=True)
class Outcome:
    verdict: Verdict
    observed: str


def judge(observed: str, *, like_upstream: bool, acceptable: bool | None = None) -> Outcome:
    """PASS when the target did what upstream does; else DIFF when the behaviour is still ``acceptable`` (default:
    not), else FAIL."""
    if like_upstream:
        return Outcome(Verdict.PASS, observed)
    return Outcome(Verdict.DIFF if acceptable else Verdict.FAIL, observed)


class Skip(ZtunnelError):
    """Raised by a check that cannot run; the message says why."""


class CheckError(ZtunnelError):
    """Raised by a check whose set-up failed before a verdict (e.g. the baseline tunnel was refused)."""


@dataclass(frozen=True, slots=True)
class Check(Generic[Ctx]):
    """One conformance check.

    ``sends`` is what the checker does, ``upstream`` what upstream ztunnel does (with the source it was read from),
    ``rule`` how the verdict is reached. ``background`` checks take long (waiting for a keepalive) and run
    alongside the others.
    """

    id: str
    title: str
    sends: str
    upstream: str
    rule: str
    run: Callable[[Ctx], Awaitable[Outcome]]
    background: bool = False


@dataclass(frozen=True, slots=True)
class Result:
    check: Check[object]
    outcome: Outcome
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.check.id,
            "title": self.check.title,
            "verdict": str(self.outcome.verdict),
            "observed": self.outcome.observed,
            "sends": self.check.sends,
            "upstream": self.check.upstream,
            "rule": self.check.rule,
            "seconds": round(self.seconds, 3),
        }


async def _no_violations() -> str | None:
    return None


async def _run_one(check: Check[Ctx], ctx: Ctx, limit: float, after: Callable[[], Awaitable[str | None]]) -> Result:
    start = time.monotonic()
    try:
        outcome = await asyncio.wait_for(check.run(ctx), limit)
        violation = await after()
        if violation is not None and outcome.verdict is not Verdict.SKIP:
            outcome = Outcome(Verdict.FAIL, f"{outcome.observed}; HTTP/2 violation: {violation}")
    except Skip as e:
        outcome = Outcome(Verdict.SKIP, str(e))
    except TimeoutError:
        outcome = Outcome(Verdict.ERROR, f"no verdict within {limit:g} s")
    except CheckError as e:
        outcome = Outcome(Verdict.ERROR, str(e))
    except (ConnectionError, OSError) as e:
        outcome = Outcome(Verdict.ERROR, f"{type(e).__name__}: {e}")
    except Exception as e:  # a check's bug or an unforeseen peer behaviour: reported, never a traceback
        outcome = Outcome(Verdict.ERROR, f"{type(e).__name__}: {e}")
    return Result(check, outcome, time.monotonic() - start)  # type: ignore[arg-type]


async def run_checks(
    checks: Sequence[Check[Ctx]],
    ctx: Ctx,
    *,
    limit: float,
    violations: Callable[[], Awaitable[str | None]] = _no_violations,
    on_result: Callable[[Result], None] = lambda r: None,
) -> list[Result]:
    """Run ``checks`` against ``ctx``: background checks alongside, the others one after the other (each on its own
    connections). ``limit`` bounds each check. ``violations()`` is asked after each check for an HTTP/2 violation
    the wire saw meanwhile (it turns the check's verdict into FAIL). Results come back in ``checks``' order."""
    background = {
        c.id: asyncio.get_running_loop().create_task(_run_one(c, ctx, limit, _no_violations), name=f"check-{c.id}")
        for c in checks
        if c.background
    }
    results: dict[str, Result] = {}
    try:
        for check in checks:
            if not check.background:
                results[check.id] = await _run_one(check, ctx, limit, violations)
                on_result(results[check.id])
        for cid, task in background.items():
            results[cid] = await task
            on_result(results[cid])
    finally:
        for task in background.values():
            task.cancel()
    return [results[c.id] for c in checks]


def select(checks: Sequence[Check[Ctx]], only: Sequence[str], skip: Sequence[str]) -> list[Check[Ctx]]:
    """The checks named by ``only`` (ids or id prefixes such as ``tls.``; all when empty) minus ``skip``. Raises
    ValueError naming a pattern that matches no check."""
    ids = [c.id for c in checks]
    for pattern in (*only, *skip):
        if not any(i == pattern or i.startswith(pattern) for i in ids):
            raise ValueError(f"no check matches {pattern!r}; known: {', '.join(ids)}")

    def matches(cid: str, patterns: Sequence[str]) -> bool:
        return any(cid == p or cid.startswith(p) for p in patterns)

    return [c for c in checks if (not only or matches(c.id, only)) and not matches(c.id, skip)]

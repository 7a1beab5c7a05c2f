"""Profiling a running ztunnel process: the Python analogue of upstream's ``/debug/pprof/profile`` and
``/debug/pprof/heap`` (``admin.rs``), used by the admin server for its own process and, over the worker channel,
by each data-plane worker for itself.

**CPU profile** (:func:`cpu_profile`): a sampler thread reads every other thread's Python stack
(``sys._current_frames``) ``frequency`` times a second (default 100 Hz, upstream's, 1-1000) for ``seconds``
(default 10, 1-300, upstream's bounds) and counts identical stacks. The result is the "folded" (collapsed-stack)
text that flamegraph.pl, inferno and speedscope read: one line per distinct stack, frames root first separated by
``;``, then a space and the number of samples. Each stack starts with the process (``control``, ``worker-<i>``) and
the thread name. It samples wall-clock stacks, not CPU time (Python cannot ask another thread whether it is on a
CPU): time the event loop spends waiting shows as stacks that end in the loop's runner (``run_until_complete``),
everything else is work. Off the data path: the sampler is its own thread and holds the GIL only while it copies
a stack (~10-30 µs per sample, so ~0.3% of one core at 100 Hz); the event loop is never paused.

**Heap** (:func:`heap_snapshot`): tracemalloc's view of the live Python allocations, by source line, largest
first. As upstream's jemalloc profiling it must be switched on first (:func:`set_heap_profiling`, upstream's
``/debug/pprof/heap/profiling?activate=true``), because tracing every allocation costs: only allocations made
while it is on are seen. Without it the heap endpoint says so (upstream's message).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import tracemalloc
from dataclasses import dataclass
from types import FrameType

from ztunnel.errors import ZtunnelError

DEFAULT_SECONDS = 10
MAX_SECONDS = 300
DEFAULT_FREQUENCY = 100
MAX_FREQUENCY = 1000
HEAP_TOP = 200  # allocation sites listed in a heap snapshot
HEAP_FRAMES = 8  # frames of traceback tracemalloc keeps per allocation, when profiling is switched on
NOT_ACTIVE = "heap profiling not active; activate with /debug/pprof/heap/profiling?activate=true"


class ProfileError(ZtunnelError, ValueError):
    """A bad parameter (the admin answers 400 with this message), or heap profiling is off."""


@dataclass(frozen=True, slots=True)
class ProfileFailed:
    """A process could not be profiled, and why (e.g. heap profiling is off): a worker's answer, pickled back."""

    error: str


def parse_profile_params(seconds: str | None, frequency: str | None) -> tuple[int, int]:
    """``seconds`` and ``frequency`` as upstream accepts them (1-300 s, 1-1000 Hz; defaults 10 s and 100 Hz)."""
    try:
        s = DEFAULT_SECONDS if seconds is None else int(seconds)
    except ValueError:
        s = -1
    if not 1 <= s <= MAX_SECONDS:
        raise ProfileError("invalid seconds value; expected 1-300")
    try:
        f = DEFAULT_FREQUENCY if frequency is None else int(frequency)
    except ValueError:
        f = -1
    if not 1 <= f <= MAX_FREQUENCY:
        raise ProfileError("invalid frequency value; expected 1-1000")
    return s, f


def _frame_name(frame: FrameType) -> str:
    code = frame.f_code
    module = frame.f_globals.get("__name__", os.path.basename(code.co_filename))
    return f"{module}:{code.co_qualname}"


def cpu_profile(seconds: float, frequency: int, process: str) -> dict[str, int]:
    """Sample every thread but the caller's for ``seconds`` at ``frequency`` Hz; folded stacks to sample counts.
    Blocking: run it on a thread (``asyncio.to_thread``), never on the event loop."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    counts: collections.Counter[str] = collections.Counter()
    period = 1.0 / frequency
    deadline = time.monotonic() + seconds
    next_at = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            stack: list[str] = []
            f: FrameType | None = frame
            while f is not None:
                stack.append(_frame_name(f))
                f = f.f_back
            name = names.get(ident)
            if name is None:
                names = {t.ident: t.name for t in threading.enumerate()}
                name = names.get(ident, f"thread-{ident}")
            stack.append(name.replace(";", ",").replace(" ", "_"))
            stack.append(process)
            counts[";".join(reversed(stack))] += 1
        next_at += period
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_at = time.monotonic()  # fell behind (a busy machine): go on from now, do not burst
    return dict(counts)


def folded(profiles: list[dict[str, int]]) -> str:
    """Folded text of several processes' profiles, most frequent stack first."""
    merged: collections.Counter[str] = collections.Counter()
    for p in profiles:
        merged.update(p)
    return "".join(f"{stack} {n}\n" for stack, n in merged.most_common())


def set_heap_profiling(activate: bool | None) -> bool:
    """Switch tracemalloc on or off (None: leave it); whether it is on now."""
    if activate is True and not tracemalloc.is_tracing():
        tracemalloc.start(HEAP_FRAMES)
    elif activate is False and tracemalloc.is_tracing():
        tracemalloc.stop()
    return tracemalloc.is_tracing()


def heap_snapshot(process: str, top: int = HEAP_TOP) -> str:
    """The live traced allocations by source line (largest first), or :data:`NOT_ACTIVE`'s message as a
    :class:`ProfileError` when heap profiling is off."""
    if not tracemalloc.is_tracing():
        raise ProfileError(NOT_ACTIVE)
    snap = tracemalloc.take_snapshot().filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>"))
    )
    stats = snap.statistics("lineno")
    total = sum(s.size for s in stats)
    _, peak = tracemalloc.get_traced_memory()
    lines = [f"# {process}: {total} bytes in {sum(s.count for s in stats)} live traced blocks (peak {peak})\n"]
    for s in stats[:top]:
        frame = s.traceback[0]
        lines.append(f"{process} {s.size} {s.count} {frame.filename}:{frame.lineno}\n")
    return "".join(lines)

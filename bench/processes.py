"""The ztunnel process models a run compares (``--workers``): worker counts and the inline single process, the
environment that selects each, and what a start of the proxies found (processes, idle memory).

``--workers 1,2`` runs the data-path scenarios once per worker count, with ``ZTUNNEL_WORKER_THREADS`` set for the
ztunnels of that start; ``inline`` runs ztunnel as one process (``ZTUNNEL_INLINE_DATA_PLANE=true``: control plane
and data plane on one loop, as before the process split). The inline process's idle memory is the baseline of the
memory target, so it is measured in every repetition even when ``inline`` is not in the list (start, idle memory,
stop: no scenario runs on it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.procstat import owner, process_tree, pss_bytes, rss_bytes, workers_of

INLINE = "inline"
INLINE_ENV = "ZTUNNEL_INLINE_DATA_PLANE"
WORKERS_ENV = "ZTUNNEL_WORKER_THREADS"


def parse_workers(text: str) -> tuple[str, ...]:
    """``1,2`` / ``inline,1,2``: worker counts (at least 1) and ``inline``, in the order given, each once."""
    out: list[str] = []
    for raw in (x.strip() for x in text.split(",")):
        if not raw:
            continue
        if raw != INLINE and (not raw.isdigit() or int(raw) < 1):
            raise ValueError(f"{raw!r} is neither a worker count (1, 2, ...) nor {INLINE!r}")
        item = raw if raw == INLINE else str(int(raw))
        if item in out:
            raise ValueError(f"{item} given twice")
        out.append(item)
    if not out:
        raise ValueError("no worker count given")
    return tuple(out)


def variant_env(variant: str) -> dict[str, str]:
    """The ztunnels' extra environment for one process model."""
    if variant == INLINE:
        return {INLINE_ENV: "true"}
    return {WORKERS_ENV: variant}


def label(variant: str | None) -> str:
    """How tables name a process model: ``inline``, ``1 worker``, ``2 workers``."""
    if variant is None or variant == INLINE:
        return variant or ""
    return f"{variant} worker" + ("s" if variant != "1" else "")


def short_label(variant: str | None) -> str:
    """For chart legends: ``inline``, ``1w``, ``2w``."""
    if variant is None or variant == INLINE:
        return variant or ""
    return f"{variant}w"


def found(pids: Mapping[str, int], variant: str | None, rep: int) -> dict[str, Any]:
    """What one start of the proxies is made of: per proxy its processes (``control`` and ``w<i>``, or
    ``p<pid>``), how many workers, and their RSS and PSS, summed and per process, right after the start."""
    tree = process_tree(pids)
    proxies: dict[str, Any] = {}
    for proxy in pids:
        names = [n for n in tree if owner(n) == proxy]
        pss = {n: pss_bytes(tree[n]) for n in names}
        rss = {n: rss_bytes(tree[n]) for n in names}
        proxies[proxy] = {
            "pids": {(n.partition("/")[2] or "main"): tree[n] for n in names},
            # What the started process really has of the variables that select the process model.
            "env": environ(pids[proxy], (INLINE_ENV, WORKERS_ENV)),
            "workers": len(workers_of(names, proxy)),
            "pss_bytes": sum(pss.values()),
            "rss_bytes": sum(rss.values()),
            "pss_by_process": {(n.partition("/")[2] or "main"): v for n, v in pss.items()},
        }
    return {"rep": rep + 1, "workers": variant, "proxies": proxies}


def environ(pid: int, names: Sequence[str]) -> dict[str, str]:
    """The variables ``names`` in ``/proc/<pid>/environ`` (those it has; empty if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep and key in names:
            out[key] = value
    return out


def mismatch(record: Mapping[str, Any], ztunnels: Sequence[str]) -> str | None:
    """Why the processes found do not match the process model asked for, or None."""
    variant = record["workers"]
    if variant is None:
        return None
    want = 0 if variant == INLINE else int(variant)
    wrong = [f"{z} has {record['proxies'][z]['workers']}" for z in ztunnels if record["proxies"][z]["workers"] != want]
    if not wrong:
        return None
    return (
        f"{label(variant)} asked for ({variant_env(variant)}), but {', '.join(wrong)} worker process(es) "
        f"(found by `--index N` on the command line of a ztunnel's child processes)"
    )

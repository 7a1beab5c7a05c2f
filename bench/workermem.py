"""A data-plane worker's idle memory, and where it is: ``python -m bench.workermem`` (issue 17).

Starts the ztunnel command (dedicated mode, a one-workload local config, no connection) ``--starts`` times, one
after the other, and reads each process's ``/proc/<pid>/smaps`` right after it is ready and again after ``--idle``
seconds: PSS, USS (private pages), ``Pss_Anon``, and the same split by mapping (the C heap, anonymous mappings,
which hold pymalloc's arenas, the writable data of shared objects, their text, the stacks). Prints the medians.

``--witness`` also forks, at the moment the ztunnel command forks its first worker, a third process that only
sleeps: the pre-fork image untouched. Comparing the page frames (``/proc/<pid>/pagemap``, root only) of the worker,
the control process and that witness at the same addresses tells which of the worker's pre-fork pages are still
shared, which it copied itself (written by the worker) and which it holds privately because the control process
wrote them (the control has a new copy, the worker and the witness still share the original).

``--stages`` (with ``--witness``) also reads them while the control process is stopped right after the fork
(``forked``: before it imports anything of the control plane) and after it imported the app (``imported``): which of
its writes come from its imports and which from starting and running.

``--inline`` runs the inline model (``ZTUNNEL_INLINE_DATA_PLANE=true``): one process, nothing to split.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ztunnel.testing import TwoNodeMesh, ZtunnelProcess

MiB = 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")

# The ztunnel command, but the first fork also forks a witness that sleeps until killed (its pid in argv[1]).
WITNESS = """
import os, sys, time
fork = os.fork
def forking():
    if not os.path.exists(sys.argv[1]):
        pid = fork()
        if pid == 0:
            while True:
                time.sleep(3600)
        with open(sys.argv[1], "w") as f:
            f.write(str(pid))
    return fork()
os.fork = forking
if os.environ.get("WORKERMEM_STAGES"):  # stop (SIGSTOP) right after the fork, and again after the app's imports
    import signal
    from ztunnel.workers import prefork
    start = prefork.Preforked.start
    def stopping(count):
        out = start(count)
        os.kill(os.getpid(), signal.SIGSTOP)
        import ztunnel.app
        os.kill(os.getpid(), signal.SIGSTOP)
        return out
    prefork.Preforked.start = stopping
from ztunnel.__main__ import main
sys.exit(main(["proxy"]))
"""


def kind(name: str, perms: str) -> str:
    """The mapping kind a smaps header names: ``heap``, ``anon`` (pymalloc arenas, mmap'd buffers), ``stack``,
    ``so-data`` (a file mapped writable: a library's data and relocations), ``so-text`` (read-only file pages)."""
    if name == "[heap]":
        return "heap"
    if name.startswith("[stack"):
        return "stack"
    if name.startswith("["):
        return "other"
    if not name or name.startswith("anon_inode") or name == "/dev/zero (deleted)":
        return "anon"
    return "so-data" if "w" in perms else "so-text"


def smaps(pid: int) -> dict[str, dict[str, int]]:
    """{kind: {Pss, Private, Rss, ...: bytes}} of ``pid``, plus ``total``."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    current = "other"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if not first.endswith(":") or "-" in first:
                parts = line.split(None, 5)
                current = kind(parts[5].strip() if len(parts) > 5 else "", parts[1])
                continue
            field = first[:-1]
            if field in ("Pss", "Pss_Anon", "Rss", "Private_Clean", "Private_Dirty"):
                value = int(line.split()[1]) * 1024
                key = "Private" if field.startswith("Private") else field
                out[current][key] += value
                out["total"][key] += value
    with open(f"/proc/{pid}/smaps_rollup") as f:  # Pss_Anon is only in the rollup
        for line in f:
            if line.startswith("Pss_Anon:"):
                out["total"]["Pss_Anon"] = int(line.split()[1]) * 1024
    return {k: dict(v) for k, v in out.items()}


def writable_anon_ranges(pid: int) -> Iterator[tuple[int, int, str]]:
    """(start, end, kind) of ``pid``'s writable private mappings that are not file text."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            name = parts[5].strip() if len(parts) > 5 else ""
            k = kind(name, parts[1])
            if "w" in parts[1] and k in ("heap", "anon", "so-data"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                yield lo, hi, k


def frames(pid: int, lo: int, hi: int) -> list[int]:
    """The page frame of each page of [lo, hi) in ``pid`` (0: not present)."""
    n = (hi - lo) // PAGE
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        f.seek(lo // PAGE * 8)
        raw = f.read(n * 8)
    out = []
    for (entry,) in struct.iter_unpack("<Q", raw):
        out.append(entry & ((1 << 55) - 1) if entry >> 63 else 0)
    return out


def who_wrote(worker: int, control: int, witness: int) -> dict[str, dict[str, int]]:
    """Of the worker's present writable pages, by mapping kind: ``shared`` (all three have the same frame),
    ``worker`` (the worker copied it: the control and the witness still share it), ``control`` (the control copied
    it, the worker kept the original with the witness), ``both``, ``new`` (no pre-fork page: the witness has none
    there)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for lo, hi, k in writable_anon_ranges(worker):
        w = frames(worker, lo, hi)
        try:
            c, x = frames(control, lo, hi), frames(witness, lo, hi)
        except OSError:
            c = x = [0] * len(w)
        for fw, fc, fx in zip(w, c, x, strict=True):
            if not fw:
                continue
            if not fx:
                what = "new"
            elif fw == fx == fc:
                what = "shared"
            elif fw == fx:
                what = "control"
            elif fc == fx:
                what = "worker"
            else:
                what = "both"
            out[k][what] += PAGE
            out["total"][what] += PAGE
    return {k: dict(v) for k, v in out.items()}


def stopped(pid: int, timeout: float = 30.0) -> None:
    """Wait until ``pid`` stopped itself (state ``T``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not stop")


def one_start(
    workdir: Path, idle: float, inline: bool, witness: bool, stages: bool = False, env: dict[str, str] | None = None
) -> dict[str, Any]:
    mesh = TwoNodeMesh(workdir)
    extra = {"ZTUNNEL_WORKER_THREADS": "1", **(env or {})}
    if inline:
        extra["ZTUNNEL_INLINE_DATA_PLANE"] = "true"
    stages = stages and witness and not inline
    if stages:
        extra["WORKERMEM_STAGES"] = "1"
    record = workdir / "witness.pid"
    argv = [sys.executable, "-c", WITNESS, str(record)] if witness and not inline else None
    z = ZtunnelProcess(mesh.env_a(**extra), workdir / "z.log", argv=argv)
    samples: dict[str, Any] = {}
    witness_pid = 0
    if stages:
        z.start(wait_ready=False)
        assert z.proc is not None
        for when in ("forked", "imported"):
            stopped(z.proc.pid)
            witness_pid = int(record.read_text())
            worker = next(p for p in z.children() if p != witness_pid)
            samples[when] = {
                "control": smaps(z.proc.pid),
                "worker": smaps(worker),
                "pages": who_wrote(worker, z.proc.pid, witness_pid),
            }
            os.kill(z.proc.pid, signal.SIGCONT)
        wait_ready(mesh.node_a)
    else:
        z.start()
    try:
        assert z.proc is not None
        control = z.proc.pid
        if witness and not inline:
            witness_pid = int(record.read_text())
        workers = [p for p in z.children() if p != witness_pid]
        for when, wait in (("start", 0.0), ("idle", idle)):
            time.sleep(wait)
            sample: dict[str, Any] = {"control": smaps(control)}
            if workers:
                sample["worker"] = smaps(workers[0])
                if witness_pid:
                    sample["pages"] = who_wrote(workers[0], control, witness_pid)
            samples[when] = sample
        return samples
    finally:
        if witness_pid:
            os.kill(witness_pid, 9)  # a child of the control process, which reaps it as it stops
        z.stop()


def wait_ready(host: str, timeout: float = 30.0) -> None:
    """Until the readiness probe on ``host``:15021 answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, 15021), timeout=1) as s:
                s.sendall(b"GET /healthz/ready HTTP/1.0\r\n\r\n")
                if b" 200 " in s.recv(100):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError("ztunnel did not become ready")


def median_of(runs: list[dict[str, Any]], *path: str) -> float:
    values = []
    for run in runs:
        v: object = run
        for p in path:
            v = v.get(p, {}) if isinstance(v, dict) else {}
        values.append(v if isinstance(v, int) else 0)
    return statistics.median(values) / MiB


def report(runs: list[dict[str, Any]], inline: bool) -> None:
    kinds = ("total", "heap", "anon", "so-data", "so-text", "stack", "other")
    for when in ("forked", "imported", "start", "idle"):
        if not all(when in r for r in runs):
            continue
        print(f"== {when} (medians of {len(runs)} starts, MiB)")
        procs = ("control",) if inline else ("worker", "control")
        for proc in procs:
            print(
                f"  {proc:8} "
                + "  ".join(
                    f"{k}: PSS {median_of(runs, when, proc, k, 'Pss'):.2f} "
                    f"priv {median_of(runs, when, proc, k, 'Private'):.2f}"
                    for k in kinds[:4]
                )
            )
            print(
                f"  {'':8} Pss_Anon {median_of(runs, when, proc, 'total', 'Pss_Anon'):.2f}"
                f"  Rss {median_of(runs, when, proc, 'total', 'Rss'):.2f}"
            )
        if not inline:
            whole = statistics.median(sum(int(r[when][p]["total"]["Pss"]) for p in ("worker", "control")) for r in runs)
            anon = statistics.median(
                sum(int(r[when][p]["total"]["Pss_Anon"]) for p in ("worker", "control")) for r in runs
            )
            # Pss_Anon is the steadier sum: the file pages' share moves with whatever else maps the same libraries
            print(f"  whole ztunnel PSS {whole / MiB:.2f}  Pss_Anon {anon / MiB:.2f}")
            if any("pages" in r[when] for r in runs):
                print("  worker's writable pages by who wrote them since the fork:")
                for k in ("total", "heap", "anon", "so-data"):
                    print(
                        f"    {k:8} "
                        + "  ".join(
                            f"{w} {median_of(runs, when, 'pages', k, w):.2f}"
                            for w in ("shared", "control", "worker", "both", "new")
                        )
                    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.workermem", description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=3, help="ztunnel starts to take the median of (3)")
    ap.add_argument("--idle", type=float, default=30.0, help="seconds between the two readings (30)")
    ap.add_argument("--inline", action="store_true", help="the inline model: one process")
    ap.add_argument("--witness", action="store_true", help="classify the worker's pages by who wrote them (root)")
    ap.add_argument("--stages", action="store_true", help="with --witness: also right after the fork and the imports")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the ztunnel process (repeatable)")
    ap.add_argument("--json", type=Path, help="also write every reading here")
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.starts):
        with tempfile.TemporaryDirectory(prefix="workermem-") as d:
            env = dict(e.split("=", 1) for e in args.env)
            runs.append(one_start(Path(d), args.idle, args.inline, args.witness, args.stages, env))
    report(runs, args.inline)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

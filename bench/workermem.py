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

``--objects`` (with ``--witness``, at the last reading) names what lies on each class of pages: the witness
dumps its objects (the pre-fork image's), and their bytes are summed by type and module per class.

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
def dump_objects(path):
    # The witness's objects (the pre-fork image): (address, size, type, module) of every object the collector
    # knows, the untracked ones they refer to (strings, code, numbers) and the dicts' key tables, as JSON.
    import ctypes, gc, json
    gc.unfreeze()  # the witness's own pages only: the pages were compared before this
    code_type = type(dump_objects.__code__)
    out, seen = [], set()
    def where(o):
        if type(o) is code_type:
            f = o.co_filename
            if "site-packages/" in f:
                return f.split("site-packages/")[1].split("/")[0]
            return "ztunnel" if "/ztunnel/" in f else "stdlib:" + f.rsplit("/", 1)[-1].removesuffix(".py")
        m = getattr(o, "__module__", None) if isinstance(o, type) or callable(o) else None
        return str(m).split(".")[0] if m else ""
    def add(o):
        if id(o) in seen:
            return
        seen.add(id(o))
        size, start = sys.getsizeof(o), id(o) - (16 if gc.is_tracked(o) else 0)
        if type(o) is dict:
            keys = ctypes.c_void_p.from_address(id(o) + 32).value  # PyDictObject.ma_keys (3.11)
            if keys and size > 64:
                out.append((keys, size - 64, "dict keys", ""))
                size = 64
        out.append((start, size, type(o).__name__, where(o)))
    for o in gc.get_objects():
        add(o)
        for r in gc.get_referents(o):
            if not gc.is_tracked(r) and type(r) in (str, bytes, int, float, code_type):
                add(r)
                if type(r) is code_type:
                    for c in r.co_consts + r.co_names + r.co_varnames:
                        if not gc.is_tracked(c):
                            add(c)
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.rename(path + ".tmp", path)
def forking():
    if not os.path.exists(sys.argv[1]):
        pid = fork()
        if pid == 0:
            import signal
            signal.signal(signal.SIGUSR1, lambda *_: dump_objects(sys.argv[1] + ".objects"))
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


def page_class(worker: int, control: int, witness: int) -> str:
    """Who wrote a page of the worker since the fork, from the page frame each process maps at its address (0: none):
    ``shared`` (all three have the same frame), ``worker`` (the worker copied it: the control and the witness still
    share it), ``control`` (the control copied it, the worker kept the original with the witness), ``both``, ``new``
    (no pre-fork page: the witness has none there)."""
    if not witness:
        return "new"
    if worker == witness == control:
        return "shared"
    if worker == witness:
        return "control"
    return "worker" if control == witness else "both"


def page_classes(
    worker: int, control: int, witness: int, ranges: list[tuple[int, int, str]] | None = None
) -> dict[int, tuple[str, str]]:
    """{page number: (:func:`page_class`, mapping kind)} of the worker's present pages in ``ranges`` (default: its
    writable private mappings, :func:`writable_anon_ranges`)."""
    out: dict[int, tuple[str, str]] = {}
    for lo, hi, k in ranges if ranges is not None else writable_anon_ranges(worker):
        w = frames(worker, lo, hi)
        try:
            c, x = frames(control, lo, hi), frames(witness, lo, hi)
        except OSError:
            c = x = [0] * len(w)
        for n, (fw, fc, fx) in enumerate(zip(w, c, x, strict=True)):
            if fw:
                out[lo // PAGE + n] = (page_class(fw, fc, fx), k)
    return out


def who_wrote(worker: int, control: int, witness: int) -> dict[str, dict[str, int]]:
    """Bytes of the worker's present writable pages by :func:`page_class`, per mapping kind and in ``total``."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for what, k in page_classes(worker, control, witness).values():
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


def objects_by_class(classes: dict[int, tuple[str, str]], objects: list[list[Any]]) -> dict[str, dict[str, int]]:
    """Bytes of the witness's objects on each class of pages, by ``type module``, with ``*`` for all found and
    ``* <kind>`` for those in each kind of mapping (``pages <kind>``: the pages' own bytes)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for start, size, tname, module in objects:
        a, end = start, start + size
        while a < end:
            page = a // PAGE
            nxt = min(end, (page + 1) * PAGE)
            ck = classes.get(page)
            if ck is not None:
                c, k = ck
                out[c][f"{tname} {module}".strip()] += nxt - a
                out[c]["*"] += nxt - a
                out[c]["* " + k] += nxt - a
            a = nxt
    for c, k in classes.values():
        if c != "new":
            out[c]["pages " + k] += PAGE
    return {k: dict(v) for k, v in out.items()}


def dumped_objects(record: Path, witness: int, timeout: float = 120.0) -> list[list[Any]]:
    """Ask the witness for its objects (SIGUSR1) and read them."""
    path = Path(str(record) + ".objects")
    os.kill(witness, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the witness did not dump its objects")
        time.sleep(0.1)
    out: list[list[Any]] = json.loads(path.read_text())
    return out


def one_start(
    workdir: Path,
    idle: float,
    inline: bool,
    witness: bool,
    stages: bool = False,
    env: dict[str, str] | None = None,
    objects: bool = False,
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
        if objects and witness_pid and workers:
            classes = page_classes(workers[0], control, witness_pid)
            samples["objects"] = objects_by_class(classes, dumped_objects(record, witness_pid))
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


def report_objects(runs: list[dict[str, Any]]) -> None:
    print("== objects of the pre-fork image on the worker's pages at the last reading (first start, MiB)")
    objects = runs[0]["objects"]
    for c in ("control", "both", "worker", "shared"):
        found = objects.get(c, {})
        top = sorted(((v, k) for k, v in found.items() if not k.startswith(("*", "pages "))), reverse=True)[:16]
        kinds = ", ".join(
            f"{k} {found.get('* ' + k, 0) / MiB:.2f} of {found.get('pages ' + k, 0) / MiB:.2f}"
            for k in ("heap", "anon", "so-data")
        )
        print(f"  {c}: {found.get('*', 0) / MiB:.2f} MiB of objects found (on pages by mapping: {kinds})")
        print("    " + ", ".join(f"{k} {v / MiB:.2f}" for v, k in top))


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
    ap.add_argument("--objects", action="store_true", help="with --witness: what lies on each class of pages")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the ztunnel process (repeatable)")
    ap.add_argument("--json", type=Path, help="also write every reading here")
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.starts):
        with tempfile.TemporaryDirectory(prefix="workermem-") as d:
            env = dict(e.split("=", 1) for e in args.env)
            runs.append(one_start(Path(d), args.idle, args.inline, args.witness, args.stages, env, args.objects))
    report(runs, args.inline)
    if all("objects" in r for r in runs):
        report_objects(runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

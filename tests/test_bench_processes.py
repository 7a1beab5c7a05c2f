"""The benchmark's view of a ztunnel's processes (``bench.procstat``, ``bench.processes``) and the process-model
targets of its report (``bench.report``): real processes for the tree, and the report's arithmetic on samples built
by the scenarios' own helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bench import report
from bench.processes import environ, found, mismatch, parse_workers, variant_env
from bench.procstat import cpu_delta, cpu_snapshot, kernel_delta, process_tree, split_snapshot, worker_index
from bench.scenarios.base import process_split, proxy_cpu, proxy_kernel

# A stand-in for a ztunnel with workers, as the bench sees one: a parent whose children carry `--index N` on their
# command line (the convention of `python -m ztunnel.workers --index N`), one of them busy, and a helper without an
# index. The parent prints {index or "helper": pid} once all are running, then waits.
PARENT = r"""
import json, subprocess, sys
up = "print('up', flush=True)\n"
busy = up + "while True: pass"
idle = up + "import time; time.sleep(60)"
kids = {
    "0": subprocess.Popen([sys.executable, "-c", busy, "-m", "ztunnel.workers", "--index", "0"], stdout=subprocess.PIPE),
    "1": subprocess.Popen([sys.executable, "-c", idle, "-m", "ztunnel.workers", "--index=1"], stdout=subprocess.PIPE),
    "helper": subprocess.Popen([sys.executable, "-c", idle], stdout=subprocess.PIPE),
}
for p in kids.values():  # running: their command lines are in /proc (not yet while exec sets them up)
    p.stdout.readline()
print(json.dumps({k: p.pid for k, p in kids.items()}), flush=True)
try:
    sys.stdin.read()
finally:
    for p in kids.values():
        p.kill()
"""


@pytest.fixture
def ztunnel_like() -> Iterator[tuple[subprocess.Popen[str], dict[str, int]]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "ZTUNNEL_WORKER_THREADS": "2"},
    )
    try:
        assert proc.stdout is not None
        kids = json.loads(proc.stdout.readline())
        yield proc, kids
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.parametrize(
    ("argv", "index"),
    [
        (["python", "-m", "ztunnel.workers", "--index", "3"], 3),
        (["python", "-m", "ztunnel.workers", "--index=12"], 12),
        (["/usr/bin/python3", "-m", "ztunnel.worker", "--log", "x", "--index", "0"], 0),
        (["python", "-m", "ztunnel.workers", "--index"], None),
        (["python", "-m", "ztunnel.workers", "--index", "one"], None),
        (["python", "-m", "ztunnel", "proxy"], None),
        ([], None),
    ],
)
def test_worker_index_from_the_command_line(argv: list[str], index: int | None) -> None:
    assert worker_index(argv) == index


def test_process_tree_names_workers_by_index(ztunnel_like: tuple[subprocess.Popen[str], dict[str, int]]) -> None:
    parent, kids = ztunnel_like
    tree = process_tree({"ztunnel-a": parent.pid})
    assert tree == {
        "ztunnel-a": parent.pid,
        "ztunnel-a/w0": kids["0"],
        "ztunnel-a/w1": kids["1"],
        f"ztunnel-a/p{kids['helper']}": kids["helper"],
    }
    # CPU per process over a window: the busy worker carries the proxy's worker CPU, the idle one nearly none.
    before = cpu_snapshot(tree)
    time.sleep(0.3)
    cpu = cpu_delta(before, cpu_snapshot(tree))
    split = process_split("tcp", cpu, 0.3)
    assert split["workers_found"] == {"ztunnel-a": 2}
    assert set(split["worker_cpu_s"]["ztunnel-a"]) == {"w0", "w1"}
    assert cpu["ztunnel-a/w0"] > 10 * cpu["ztunnel-a/w1"]
    assert split["worker_share_max"] == round(cpu["ztunnel-a/w0"] / (cpu["ztunnel-a/w0"] + cpu["ztunnel-a/w1"]), 3)
    assert proxy_cpu("tcp", cpu) == pytest.approx(sum(cpu.values()))  # every process of the proxy is its cost
    assert proxy_cpu("envoy", cpu) == 0

    record = found({"ztunnel-a": parent.pid}, "2", 0)
    proxy = record["proxies"]["ztunnel-a"]
    assert proxy["workers"] == 2 and proxy["pids"]["w1"] == kids["1"]
    assert proxy["pss_bytes"] == sum(proxy["pss_by_process"].values()) > 0
    assert proxy["env"] == {"ZTUNNEL_WORKER_THREADS": "2"}
    assert mismatch(record, ["ztunnel-a"]) is None
    assert "ztunnel-a has 2" in str(mismatch({**record, "workers": "3"}, ["ztunnel-a"]))


# One process computing in Python (user space), one making system calls that do work in the kernel (copying 1 MiB of
# /dev/zero per read), each until its stdin closes.
_SPIN = "import sys, select\nwhile not select.select([sys.stdin], [], [], 0)[0]: sum(range(1000))"
_SYSCALLS = (
    "import os, sys, select\nfd = os.open('/dev/zero', os.O_RDONLY)\n"
    "while not select.select([sys.stdin], [], [], 0)[0]: os.read(fd, 1 << 20)"
)


def test_kernel_part_of_the_cpu_is_told_from_user_space() -> None:
    procs = {
        name: subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        for name, code in (("spin", _SPIN), ("syscalls", _SYSCALLS))
    }
    try:
        pids = {name: p.pid for name, p in procs.items()}
        time.sleep(0.2)  # past the interpreter's start (imports are user time and file reads)
        split0, cpu0 = split_snapshot(pids), cpu_snapshot(pids)
        deadline = time.monotonic() + 20
        # Enough clock ticks (10 ms each) that the split means something: the window ends on CPU used, not on time.
        while min(cpu_delta(cpu0, cpu_snapshot(pids)).values()) < 0.5:
            assert time.monotonic() < deadline, "the two processes did not get 0.5 s of CPU each"
            time.sleep(0.05)
        cpu, split1 = cpu_delta(cpu0, cpu_snapshot(pids)), split_snapshot(pids)
    finally:
        for p in procs.values():
            p.communicate(b"x")
    kernel = kernel_delta(cpu, split0, split1)
    assert kernel["spin"] < 0.2 * cpu["spin"], (kernel, cpu)
    assert kernel["syscalls"] > 0.5 * cpu["syscalls"], (kernel, cpu)
    # A process that gave no tick in the window (or is not in the snapshots) has no kernel part.
    assert kernel_delta({"gone": 0.0}, {}, {}) == {"gone": 0.0}
    # A scenario's proxies sum their processes' kernel part as proxy_cpu sums their CPU; no split, no figure.
    assert proxy_kernel("tcp", {"cpu_kernel": {"ztunnel-a": 0.25, "ztunnel-a/w0": 0.5, "client": 9.0}}) == 0.75
    assert proxy_kernel("tcp", {"cpu": {"ztunnel-a": 1.0}}) is None


def test_environ_reads_the_started_process() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **variant_env("inline"), "OTHER": "x"},
    )
    try:
        # Running (Popen returns when exec closed the error pipe, before the kernel has set up the new environment).
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        assert environ(proc.pid, ("ZTUNNEL_INLINE_DATA_PLANE", "ZTUNNEL_WORKER_THREADS")) == {
            "ZTUNNEL_INLINE_DATA_PLANE": "true"
        }
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.parametrize(
    ("text", "parsed"), [("1,2", ("1", "2")), (" inline, 02 ,4", ("inline", "2", "4")), ("2,", ("2",))]
)
def test_parse_workers(text: str, parsed: tuple[str, ...]) -> None:
    assert parse_workers(text) == parsed


@pytest.mark.parametrize(
    ("text", "error"), [("0", "'0' is neither"), ("1,x", "'x'"), ("2,2", "2 given twice"), ("", "no")]
)
def test_parse_workers_refuses(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_workers(text)


# -- the report's process-model targets ------------------------------------------------------------------------------


def sample(scenario: str, case: str, mode: str, rep: int, workers: str, metrics: dict[str, Any]) -> dict[str, Any]:
    return {"scenario": scenario, "case": case, "mode": mode, "rep": rep, "workers": workers, "metrics": metrics}


def run_of(worker_cpu: dict[str, tuple[float, ...]], pss: dict[str, float], found_workers: int = 2) -> dict[str, Any]:
    """Samples of two repetitions of ``hbone`` with 1 and 2 workers, as the scenarios write them, from CPU seconds per
    process ({variant: (w0, w1, ...)} per ztunnel, over a 1 s window), and process records with idle PSS."""
    samples, processes = [], []
    for rep in (1, 2):
        for w, per_worker in worker_cpu.items():
            cpu = {"client": 0.5}
            for z in ("ztunnel-a", "ztunnel-b"):
                cpu[z] = 0.01  # the control process
                for i, c in enumerate(per_worker):
                    cpu[f"{z}/w{i}"] = c
            total = proxy_cpu("hbone", cpu)
            split = process_split("hbone", cpu, 1.0)
            samples.append(
                sample(
                    "connrate", "8 concurrent", "hbone", rep, w, {"proxy_cpu_us_per_conn": total / 1000 * 1e6, **split}
                )
            )
            samples.append(
                sample("throughput", "8 streams", "hbone", rep, w, {"proxy_cpu_s_per_gbit": total / 10, **split})
            )
        for w, mib in pss.items():
            n = 0 if w == "inline" else found_workers if w == "2" else int(w)
            proxies = {z: {"workers": n, "pss_bytes": int(mib * 2**20)} for z in ("ztunnel-a", "ztunnel-b")}
            processes.append({"rep": rep, "workers": w, "proxies": proxies})
    summary = report.summarize(samples)
    variants = report.variant_ratios(samples, processes)
    return {"targets": report.targets(report.ratios(samples), summary, variants, processes), "variants": variants}


def by_name(targets: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["target"]: t for t in targets}


def test_worker_targets_from_the_samples() -> None:
    run = run_of({"1": (0.9,), "2": (0.5, 0.45)}, {"inline": 40.0, "1": 50.0, "2": 62.0})
    t = by_name(run["targets"])
    split = t["CPU split between workers, 8 concurrent connections, hbone (2 workers): smallest share"]
    assert split["value"] == round(0.45 / 0.95, 3) and split["met"] is True
    cores = t["proxy cores used, 8 streams, hbone (2 workers)"]
    assert cores["value"] == pytest.approx(2 * (0.01 + 0.95)) and cores["met"] is True
    per_conn = t["proxy CPU per connection, hbone, 2 workers ÷ 1 worker"]
    assert per_conn["value"] == pytest.approx((0.01 + 0.95) / (0.01 + 0.9), abs=1e-3) and per_conn["met"] is True
    assert t["proxy CPU per Gbit, 8 streams, hbone, 2 workers ÷ 1 worker"]["value"] == per_conn["value"]
    pss = t["idle PSS of a ztunnel (control + workers), 2 workers ÷ inline process"]
    assert pss["value"] == pytest.approx(62 / 40, abs=1e-3) and pss["met"] is False


def test_worker_targets_fail_on_an_uneven_split_and_a_costly_second_worker() -> None:
    t = by_name(run_of({"1": (0.5,), "2": (0.7, 0.1)}, {"inline": 40.0, "2": 50.0})["targets"])
    split = t["CPU split between workers, 8 concurrent connections, hbone (2 workers): smallest share"]
    assert split["value"] == 0.125 and split["met"] is False
    assert t["proxy CPU per connection, hbone, 2 workers ÷ 1 worker"]["met"] is False  # 0.81 / 0.51
    assert t["proxy cores used, 8 streams, hbone (2 workers)"]["met"] is True  # 1.62 cores
    assert t["idle PSS of a ztunnel (control + workers), 2 workers ÷ inline process"]["met"] is True


def test_worker_targets_are_not_measurable_without_worker_processes() -> None:
    """A ztunnel that ignores ZTUNNEL_WORKER_THREADS (before the process split) runs no workers: the targets say
    so instead of judging numbers of something else."""
    targets = run_of({"1": (), "2": ()}, {"inline": 40.0, "2": 40.0}, found_workers=0)["targets"]
    assert targets and all(t["met"] is None and "worker process(es)" in t["limit"] for t in targets)
    text = report.markdown(
        {
            "environment": {
                "cpu_model": "x",
                "cores": 2,
                "usable_cores": 2,
                "mem_total_mib": 1,
                "kernel": "k",
                "python": "3",
                "packages": {},
                "openssl": "o",
                "envoy": None,
                "git_commit": "c",
                "git_dirty_files": 0,
            },
            "meta": {
                "started": "now",
                "profile": "smoke",
                "topology": "loopback",
                "repetitions": 2,
                "duration_s": 1,
                "workers": ["1", "2"],
                "workers_idle_only": ["inline"],
            },
            "samples": [],
            "summary": [],
            "ratios": [],
            "targets": targets,
        },
        {},
    )
    assert "| n/a |  | not measurable: the ztunnels ran with" in text

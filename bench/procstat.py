"""What the kernel says a process used: CPU seconds and resident memory, read from ``/proc``.

The proxies are measured by their own accounting, not by timing from outside: the CPU time of the whole process
(every thread, Envoy's main and worker threads alike; user + system), and ``VmRSS`` from ``/proc/<pid>/status``.
CPU time is read from the process's CPU-time clock (``clock_gettime`` on the clock id ``clock_getcpuclockid(pid)``
returns), which has nanosecond resolution; ``utime + stime`` from ``/proc/<pid>/stat`` (10 ms ticks) is the
fallback. Reading either costs a few microseconds, so samples can be taken right at the edges of a measurement
window.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable, Mapping

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _process_cpu_clock(pid: int) -> int:
    # glibc's clock_getcpuclockid(): MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED).
    return (~pid << 3) | 2


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), in seconds; 0.0 if it is gone."""
    try:
        return time.clock_gettime(_process_cpu_clock(pid))
    except OSError:
        pass
    return cpu_seconds_stat(pid)


def cpu_seconds_stat(pid: int) -> float:
    """``utime + stime`` from ``/proc/<pid>/stat`` (clock-tick resolution); 0.0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0
    # The command name (field 2) may contain spaces and parentheses: split after its closing parenthesis.
    fields = raw.rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (``VmRSS``); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_snapshot(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of each named process now."""
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds used by each named process between two snapshots."""
    return {name: round(after[name] - before.get(name, 0.0), 6) for name in after}


def rss_snapshot(pids: Mapping[str, int]) -> dict[str, int]:
    return {name: rss_bytes(pid) for name, pid in pids.items()}


def total(values: Mapping[str, float], names: Iterable[str]) -> float:
    """Sum of ``values`` over ``names`` (missing names count 0)."""
    return sum(values.get(n, 0.0) for n in names)


def uss_bytes(pid: int) -> int:
    """Private (unshared) resident memory of ``pid``: ``Private_Clean + Private_Dirty`` from ``smaps_rollup``."""
    total_kib = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    total_kib += int(line.split()[1])
    except OSError:
        return 0
    return total_kib * 1024


def time_wait_sockets() -> int:
    """TCP sockets in TIME_WAIT on this machine (IPv4 and IPv6), from ``/proc/net/tcp{,6}``.

    Recorded with each repetition: a port held in TIME_WAIT by a socket that was bound explicitly (``bind(ip, 0)``
    before ``connect``) cannot be picked by anyone's ``connect()`` until it expires, so a high count slows down or
    fails new connections on the whole machine.
    """
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path, "rb") as f:
                next(f, None)
                for line in f:
                    if line.split(None, 4)[3] == b"06":
                        count += 1
        except OSError:
            continue
    return count


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, over all cores, from ``/proc/stat``.

    ``busy`` counts user, nice, system, irq, softirq and steal time; ``steal`` is time the hypervisor gave to
    someone else while this machine wanted to run.
    """
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return 0.0, 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK, steal / _CLK_TCK


def kernel_threads_cpu() -> float:
    """CPU seconds used so far by kernel threads (children of kthreadd: ksoftirqd, kworkers, ...).

    Loopback traffic is partly processed there (softirqs deferred to ksoftirqd), so it is no sign of other load.
    """
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == b"2" or entry.name == "2":  # ppid 2 (kthreadd) or kthreadd itself
            total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def children_cpu() -> float:
    """CPU seconds of this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# A load snapshot: (wall clock, machine busy CPU, machine steal, CPU of the run's own processes and kernel threads).
LoadSnapshot = tuple[float, float, float, float]


def load_share(a: LoadSnapshot, b: LoadSnapshot) -> dict[str, float]:
    """How much of the machine others took between two snapshots: CPU used by processes that are neither this
    run's nor kernel threads, and hypervisor steal, each as a share of all cores' time. (Softirq time spent
    in an idle CPU's context is counted as foreign: the estimate errs towards flagging.)"""
    wall = max(1e-9, b[0] - a[0]) * (os.cpu_count() or 1)
    ours = b[3] - a[3]
    foreign = max(0.0, (b[1] - a[1]) - ours - (b[2] - a[2]))
    return {
        "foreign_cpu_share": round(foreign / wall, 3),
        "steal_share": round((b[2] - a[2]) / wall, 3),
        "loadavg_1m": os.getloadavg()[0],
    }

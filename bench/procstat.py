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
from collections.abc import Iterable, Iterator, Mapping, Sequence

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
    user, system = user_system_seconds(pid)
    return user + system


def user_system_seconds(pid: int) -> tuple[float, float]:
    """``(utime, stime)`` of process ``pid`` (all its threads) from ``/proc/<pid>/stat``, in seconds: the CPU time
    spent in user space and in the kernel on its behalf (system calls, and the softirq work the kernel runs in
    them: on loopback, most of the peer's TCP receive). Clock-tick resolution (10 ms), and the kernel splits its
    precise runtime between the two by tick samples, so read the split of a window of many ticks; (0.0, 0.0) if
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0, 0.0
    # The command name (field 2) may contain spaces and parentheses: split after its closing parenthesis.
    fields = raw.rsplit(b")", 1)[1].split()
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK


def _kib_field(path: str, name: bytes) -> int:
    """The ``name`` line of a /proc file that counts in kB, in bytes; 0 if the file is gone or has no such line."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (``VmRSS``); 0 if it is gone."""
    return _kib_field(f"/proc/{pid}/status", b"VmRSS:")


def pss_bytes(pid: int) -> int:
    """Proportional set size of ``pid`` (``Pss`` from ``smaps_rollup``): its private pages plus its share of the
    pages it shares with other processes, so the PSS of processes that share code adds up to what they hold
    together (a sum of RSS counts shared pages once per process); 0 if it is gone."""
    return _kib_field(f"/proc/{pid}/smaps_rollup", b"Pss:")


# -- a proxy's processes: the control process and its data-plane workers -------------------------------------------
#
# A ztunnel with ZTUNNEL_WORKER_THREADS=N runs N worker processes beside its control process, each started as
# ``python -m ztunnel.workers --index I`` (the convention agreed with the process model's implementation; see
# docs/process-model.md). A proxy's processes are found as the descendants of the process the harness started, and
# a worker is named by the ``--index`` on its command line, whatever the module ("ztunnel-a/w0"); a descendant
# without one (a helper) is named by its pid ("ztunnel-a/p1234"), so its CPU is still counted.


def worker_index(argv: Sequence[str]) -> int | None:
    """The ``--index I`` (or ``--index=I``) of a worker's command line; None when there is none or it is not a
    number."""
    for i, arg in enumerate(argv):
        value: str | None = None
        if arg == "--index" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--index="):
            value = arg.partition("=")[2]
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def cmdline(pid: int) -> list[str]:
    """``/proc/<pid>/cmdline`` split at its NULs (empty if the process is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else []


def _all_stats() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name) of every process now; gone ones are skipped."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        yield int(entry.name), fields


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process now."""
    return {pid: int(fields[1]) for pid, fields in _all_stats()}


def descendants(pid: int, parents: Mapping[int, int] | None = None) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), in pid order."""
    parents = _parents() if parents is None else parents
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return sorted(out)


def process_tree(pids: Mapping[str, int]) -> dict[str, int]:
    """``pids`` and, for each, its descendants as ``<name>/w<index>`` (workers) or ``<name>/p<pid>``."""
    parents = _parents()
    out: dict[str, int] = {}
    for name, pid in pids.items():
        out[name] = pid
        for child in descendants(pid, parents):
            index = worker_index(cmdline(child))
            key = f"{name}/w{index}" if index is not None else f"{name}/p{child}"
            if key in out:  # two live processes claim one index (a restart caught mid-way): keep both
                key = f"{name}/p{child}"
            out[key] = child
    return out


def owner(name: str) -> str:
    """The proxy a process name of :func:`process_tree` belongs to (``ztunnel-a/w1`` -> ``ztunnel-a``)."""
    return name.partition("/")[0]


def per_proxy(values: Mapping[str, float], proxies: Iterable[str]) -> dict[str, float]:
    """``values`` of :func:`process_tree` names summed per proxy (a proxy's processes together)."""
    out = dict.fromkeys(proxies, 0.0)
    for name, v in values.items():
        p = owner(name)
        if p in out:
            out[p] += v
    return out


def workers_of(names: Iterable[str], proxy: str) -> list[str]:
    """The worker processes of ``proxy`` among ``names`` (``<proxy>/w<index>``), by index."""
    found = [n for n in names if n.startswith(proxy + "/w") and n[len(proxy) + 2 :].isdigit()]
    return sorted(found, key=lambda n: int(n[len(proxy) + 2 :]))


def cpu_snapshot(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of each named process now."""
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds used by each named process between two snapshots."""
    return {name: round(after[name] - before.get(name, 0.0), 6) for name in after}


def split_snapshot(pids: Mapping[str, int]) -> dict[str, tuple[float, float]]:
    """``(user, system)`` CPU seconds of each named process now (:func:`user_system_seconds`)."""
    return {name: user_system_seconds(pid) for name, pid in pids.items()}


def kernel_delta(
    cpu: Mapping[str, float],
    before: Mapping[str, tuple[float, float]],
    after: Mapping[str, tuple[float, float]],
) -> dict[str, float]:
    """The kernel's part of each process's CPU seconds ``cpu`` (a :func:`cpu_delta`) over the window two
    :func:`split_snapshot` calls bound: ``cpu`` times the share of system time in the window's ticks (the clock
    gives the precise total, the ticks the split); 0.0 for a process whose window saw no tick."""
    out: dict[str, float] = {}
    for name, seconds in cpu.items():
        user0, sys0 = before.get(name, (0.0, 0.0))
        user1, sys1 = after.get(name, (user0, sys0))
        ticks = (user1 - user0) + (sys1 - sys0)
        out[name] = round(seconds * (sys1 - sys0) / ticks, 6) if ticks > 0 else 0.0
    return out


def rss_snapshot(pids: Mapping[str, int]) -> dict[str, int]:
    return {name: rss_bytes(pid) for name, pid in pids.items()}


def uss_snapshot(pids: Mapping[str, int]) -> dict[str, int]:
    return {name: uss_bytes(pid) for name, pid in pids.items()}


def pss_snapshot(pids: Mapping[str, int]) -> dict[str, int]:
    return {name: pss_bytes(pid) for name, pid in pids.items()}


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
    for pid, fields in _all_stats():
        if fields[1] == b"2" or pid == 2:  # ppid 2 (kthreadd) or kthreadd itself
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

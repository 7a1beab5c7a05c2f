"""The run profiles: sizes, durations and repetitions of ``smoke`` (what `make test` runs), ``quick`` and ``full``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    reps: int
    tput_seconds: float
    latency_count: int
    latency_warmup: int
    connrate_seconds: float
    memory_counts: tuple[int, ...]
    settle: float
    xds_sizes: tuple[int, ...]
    xds_reps: int
    rbac_policies: int
    rbac_seconds: float
    stall_timeout: float = 5.0  # a client send/receive without progress for this long fails the sample
    latency_slices: int = 4  # latency rounds are taken in this many turns per mode, modes alternating
    tput_streams: tuple[int, ...] = (1, 2, 8)
    latency_sizes: tuple[int, ...] = (64, 1024)
    connrate_concurrency: int = 8


PROFILES = {
    # `make test`: proves every mode and scenario runs end to end; the numbers mean little.
    "smoke": Profile(
        name="smoke",
        reps=1,
        tput_seconds=0.25,
        latency_count=100,
        latency_warmup=20,
        latency_slices=1,
        connrate_seconds=0.25,
        memory_counts=(20, 100),
        settle=0.2,
        xds_sizes=(100, 300),
        xds_reps=1,
        rbac_policies=1000,
        rbac_seconds=0.02,
        stall_timeout=2.0,
    ),
    # Under 3 minutes; 3 repetitions so medians and ranges exist.
    "quick": Profile(
        name="quick",
        reps=3,
        tput_seconds=0.7,
        latency_count=2000,
        latency_warmup=200,
        connrate_seconds=0.7,
        memory_counts=(1000, 10000),
        settle=0.4,
        xds_sizes=(1000, 10000),
        xds_reps=3,
        rbac_policies=10000,
        rbac_seconds=0.2,
        stall_timeout=2.0,
    ),
    # `make bench`, under 20 minutes: long enough for p99.9 (10,000 round trips) and stable throughput.
    "full": Profile(
        name="full",
        reps=5,
        tput_seconds=3.0,
        latency_count=10000,
        latency_warmup=500,
        connrate_seconds=3.0,
        memory_counts=(1000, 10000),
        settle=1.0,
        xds_sizes=(1000, 10000),
        xds_reps=3,
        rbac_policies=10000,
        rbac_seconds=0.5,
    ),
}

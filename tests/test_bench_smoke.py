"""The benchmark harness, once, in its tiny smoke configuration: ``python -m bench --smoke`` as a user runs it.

Proves the harness works end to end (every process starts, every mode and scenario produces samples, the JSON,
Markdown and charts are written), not that the numbers are good: the smoke profile's sizes are too small to mean
anything. Envoy is skipped (visibly, with the reason) when its binary is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.report import METRICS
from bench.scenarios import SCENARIOS
from bench.topologies import envoy_skip_reason
from bench.topology import LOOPBACK_MODES

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Upstream's comparison (bench.node_pairs) has its own test: tests/test_bench_upstream.py.
MODES_HERE = [m for m in LOOPBACK_MODES if m != "envoy" or envoy_skip_reason() is None]


@dataclass
class SmokeRun:
    out: Path
    stderr: str
    modes: list[str]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> SmokeRun:
    out = tmp_path_factory.mktemp("bench") / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(out), "--modes", ",".join(MODES_HERE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert proc.returncode == 0, f"python -m bench --smoke failed:\n{proc.stderr[-4000:]}"
    return SmokeRun(out, proc.stderr, MODES_HERE)


@pytest.mark.timeout(90)
def test_bench_smoke(smoke: SmokeRun) -> None:
    out, modes = smoke.out, smoke.modes
    assert "done in" in smoke.stderr  # progress is shown while running
    doc = json.loads((out / "results.json").read_text())
    env = doc["environment"]
    for key in ("python", "openssl", "cpu_model", "kernel", "cores"):
        assert env[key], key
    assert {"uvloop", "h2"} <= env["packages"].keys()
    assert doc["meta"]["modes"] == modes

    measured = {(s["scenario"], s["mode"]) for s in doc["samples"] if not s["metrics"].get("failed")}
    attempted = {(s["scenario"], s["mode"]) for s in doc["samples"]}
    for scenario in ("throughput", "latency", "connrate"):
        for mode in modes:
            assert (scenario, mode) in attempted, f"no {scenario} sample for {mode}"
    for mode in modes:
        if mode != "direct":
            assert ("memory", mode) in attempted, f"no memory sample for {mode}"
    assert ("controlplane", "ztunnel") in measured
    # The paths through ztunnel must carry traffic: their small-message scenarios cannot fail.
    for scenario in ("latency", "connrate"):
        for mode in modes:
            assert (scenario, mode) in measured, f"{scenario} failed for {mode}"
    # Every scenario has a summary row per mode, and ratios are computed against each reference present.
    summarized = {(r["scenario"], r["mode"]) for r in doc["summary"]}
    assert {(sc, m) for sc, m in measured if sc in METRICS} <= summarized
    assert any(r["vs"] == "direct" for r in doc["ratios"])

    md = (out / "results.md").read_text()
    for title in ("Throughput", "Latency", "Connection rate", "Memory", "Control plane"):
        assert f"## {title}" in md, title
    for scenario in SCENARIOS:
        png = out / f"{scenario}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, png
        assert f"]({scenario}.png)" in md


@pytest.mark.timeout(90)
def test_bench_smoke_envoy(smoke: SmokeRun) -> None:
    """The Envoy pair ran too, and the run compared ztunnel with it."""
    reason = envoy_skip_reason()
    if reason is not None:
        pytest.skip(f"envoy mode not run: {reason}")
    doc = json.loads((smoke.out / "results.json").read_text())
    assert any(s["mode"] == "envoy" and not s["metrics"].get("failed") for s in doc["samples"])
    assert any(r["vs"] == "envoy" and r["mode"] == "hbone" for r in doc["ratios"])
    assert doc["targets"], "the issue's targets are checked when hbone and envoy both ran"


@pytest.fixture(scope="module")
def smoke_workers(tmp_path_factory: pytest.TempPathFactory) -> SmokeRun:
    out = tmp_path_factory.mktemp("bench-workers") / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--smoke",
            "--out",
            str(out),
            "--workers",
            "1,2",
            "--modes",
            "tcp",
            "--scenarios",
            "throughput,latency,connrate",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert proc.returncode == 0, f"python -m bench --smoke --workers 1,2 failed:\n{proc.stderr[-4000:]}"
    return SmokeRun(out, proc.stderr, ["tcp"])


@pytest.mark.timeout(90)
def test_bench_smoke_workers(smoke_workers: SmokeRun) -> None:
    """``--workers 1,2``: every scenario ran with each worker count, each ztunnel start had the variable that
    selects it (read from the started process), the inline baseline's idle memory was taken, and the process-model
    targets are either judged on worker processes that really ran or reported as not measurable, with why."""
    doc = json.loads((smoke_workers.out / "results.json").read_text())
    assert doc["meta"]["workers"] == ["1", "2"] and doc["meta"]["workers_idle_only"] == ["inline"]
    for scenario in ("throughput", "latency", "connrate"):
        ran = {s["workers"] for s in doc["samples"] if s["scenario"] == scenario and not s["metrics"].get("failed")}
        assert ran == {"1", "2"}, scenario
    records = doc["processes"]
    assert {r["workers"] for r in records} == {"1", "2", "inline"}
    for r in records:
        env = (
            {"ZTUNNEL_INLINE_DATA_PLANE": "true"}
            if r["workers"] == "inline"
            else {"ZTUNNEL_WORKER_THREADS": r["workers"]}
        )
        for name in ("ztunnel-a", "ztunnel-b"):
            assert r["proxies"][name]["env"] == env, (r["workers"], name)
            assert r["proxies"][name]["pss_bytes"] > 0
    connrate = [s for s in doc["samples"] if s["scenario"] == "connrate" and s["mode"] == "tcp"]
    assert all(s["metrics"]["proxy_cpu_us_per_conn"] > 0 and s["metrics"]["proxy_cores"] > 0 for s in connrate)
    # The CPU per connection split into the kernel's part and the rest, which add up to it.
    for s in connrate:
        m = s["metrics"]
        assert m["proxy_kernel_us_per_conn"] >= 0 and m["proxy_user_us_per_conn"] >= 0, m
        assert m["proxy_kernel_us_per_conn"] + m["proxy_user_us_per_conn"] == pytest.approx(m["proxy_cpu_us_per_conn"])
    workers_found = {r["proxies"]["ztunnel-a"]["workers"] for r in records if r["workers"] == "2"}
    worker_targets = [t for t in doc["targets"] if "2 workers" in t["target"]]
    assert worker_targets
    if workers_found == {2}:
        assert all(t["value"] is not None for t in worker_targets)
        assert any(s["metrics"].get("worker_share_min") is not None for s in connrate if s["workers"] == "2")
    else:
        assert all(t["met"] is None and "worker process(es)" in t["limit"] for t in worker_targets)
    md = (smoke_workers.out / "results.md").read_text()
    assert "## Process models (`--workers`)" in md and "### 2 workers" in md

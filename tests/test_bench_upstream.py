"""Upstream ztunnel as a benchmark mode (``bench.node_pairs``): ``python -m bench --smoke`` with the modes
``upstream``, ``upstream-loop`` and their partners ``hbone-ns`` and ``loop``, as a user runs it.

Proves the comparison works end to end: both implementations start in their namespaced node pairs, every scenario
measures every mode, the "vs upstream" targets are computed pair by pair and written; and without the binary the
modes are skipped with the reason, printed and recorded. Not that the numbers are good (the smoke profile is too
small to mean anything): no thresholds on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import report
from bench.node_pairs import PAIR_MODES
from ztunnel.testing import interop

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("throughput", "latency", "connrate", "memory")


def _bench(out: Path, modes: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(out), "--modes", modes, *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


@pytest.mark.timeout(120)
def test_upstream_modes_are_skipped_with_the_reason_without_the_binary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != interop.UPSTREAM_BIN_ENV}
    proc = _bench(tmp_path / "out", "direct,upstream,hbone-ns,upstream-loop,loop", env, "--scenarios", "connrate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipped mode upstream: {interop.UPSTREAM_BIN_ENV} is not set" in proc.stderr
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    skipped = {s["what"]: s["reason"] for s in doc["skipped"]}
    assert set(skipped) == {f"mode {m}" for m in PAIR_MODES}
    assert interop.UPSTREAM_BIN_ENV in skipped["mode upstream-loop"]
    assert skipped["mode hbone-ns"].startswith("only measured beside upstream")
    assert doc["meta"]["modes"] == ["direct"]  # the rest of the run goes on
    assert {s["mode"] for s in doc["samples"]} == {"direct"}
    assert doc["targets_upstream"] == []
    md = (tmp_path / "out" / "results.md").read_text()
    assert "mode upstream: " in md and "Targets vs upstream" not in md


@pytest.fixture(scope="module")
def upstream_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    interop.require_upstream()
    out = tmp_path_factory.mktemp("bench-upstream") / "results"
    modes = ",".join(PAIR_MODES)
    proc = _bench(out, modes, dict(os.environ), "--scenarios", ",".join(SCENARIOS), "--workers", "1")
    assert proc.returncode == 0, f"python -m bench failed:\n{proc.stderr[-4000:]}"
    doc: dict[str, Any] = json.loads((out / "results.json").read_text())
    doc["_md"] = (out / "results.md").read_text()
    return doc


@pytest.mark.timeout(180)
def test_every_scenario_measures_upstream_and_this_ztunnel_side_by_side(upstream_run: dict[str, Any]) -> None:
    doc = upstream_run
    assert doc["meta"]["modes"] == list(PAIR_MODES)
    assert not doc["skipped"]
    ok = {(s["scenario"], s["mode"]) for s in doc["samples"] if not s["metrics"].get("failed")}
    for scenario in SCENARIOS:
        for mode in PAIR_MODES:
            assert (scenario, mode) in ok, (scenario, mode, doc["failures"])
    for s in doc["samples"]:
        if s["scenario"] == "connrate":
            assert s["metrics"]["proxy_cpu_us_per_conn"] > 0, s["mode"]  # each mode's own proxies were sampled
            # ... and its CPU split into the kernel's part and the rest (each implementation's own processes)
            m = s["metrics"]
            assert m["proxy_kernel_us_per_conn"] + m["proxy_user_us_per_conn"] == pytest.approx(
                m["proxy_cpu_us_per_conn"]
            )
            assert not s["metrics"]["errors"], s


@pytest.mark.timeout(180)
def test_one_worker_each_and_the_processes_found(upstream_run: dict[str, Any]) -> None:
    """``--workers 1``: upstream started with ZTUNNEL_WORKER_THREADS=1 (its Tokio workers), this ztunnel with one
    worker process; upstream is one process, this ztunnel a control process and a worker."""
    starts = [rec for rec in upstream_run["processes"] if rec["workers"] == "1"]  # not the inline baseline's
    assert starts
    for rec in starts:
        proxies = rec["proxies"]
        assert {"upstream-a", "upstream-b", "ztunnel-ns-a", "ztunnel-ns-b"} <= proxies.keys()
        for name in ("upstream-a", "upstream-b"):
            assert proxies[name]["env"].get("ZTUNNEL_WORKER_THREADS") == "1"
            assert list(proxies[name]["pids"]) == ["main"]
            assert proxies[name]["pss_bytes"] > 0
        for name in ("ztunnel-ns-a", "ztunnel-ns-b"):
            assert proxies[name]["workers"] == 1
    assert not [n for n in upstream_run["notes"] if "asked for" in n]


@pytest.mark.timeout(180)
def test_the_vs_upstream_targets_pair_each_shape_with_its_partner(upstream_run: dict[str, Any]) -> None:
    doc = upstream_run
    vs = {(r["mode"], r["vs"]) for r in doc["ratios"] if r["vs"] in ("upstream", "upstream-loop")}
    assert vs == {("hbone-ns", "upstream"), ("loop", "upstream-loop")}  # never across shapes
    # Each target is the median of per-repetition ratios, recomputed here from the samples.
    rows = report.ratios(doc["samples"])
    names = [t["target"] for t in doc["targets_upstream"]]
    for shape in ("two nodes", "self-loop"):
        for name, *_ in report.UPSTREAM_TARGETS:
            assert f"{name} ({shape}, 1 worker)" in names
    cpu = next(
        t for t in doc["targets_upstream"] if t["target"] == f"{report.UPSTREAM_TARGETS[0][0]} (two nodes, 1 worker)"
    )
    row = next(
        r for r in rows if r["metric"] == "proxy_cpu_us_per_conn" and r["mode"] == "hbone-ns" and r["vs"] == "upstream"
    )
    assert cpu["value"] == round(row["median"], 3) and cpu["met"] == (row["median"] <= 1.5)
    pss = next(t for t in doc["targets_upstream"] if t["target"].startswith("idle PSS of one data-plane worker"))
    assert pss["value"] is not None and pss["value"] > 0
    assert "## Targets vs upstream ztunnel" in doc["_md"]
    assert "hbone-ns ÷ upstream" in doc["_md"] and "loop ÷ upstream-loop" in doc["_md"]
    # Where a CPU ratio comes from: the kernel's part and user space's, each compared with upstream's.
    assert any(
        r["metric"] == "proxy_kernel_us_per_conn" and r["mode"] == "hbone-ns" and r["vs"] == "upstream" for r in rows
    )
    assert "proxy CPU µs per connection in the kernel" in doc["_md"]

"""``python -m ztunnel.standins.istiod serve``: starts, serves over TLS with its CA, stops on SIGTERM; bad input exits 1 with a message."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from ztunnel.testing import TWO_NODE


def test_serve_starts_and_stops(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "ztunnel.standins.istiod", "serve", "--config", str(TWO_NODE), "--ca-dir", str(tmp_path / "ca"),
            "--listen", "127.0.0.1:0", "--token", "t", "--token", "u=spiffe://cluster.local/ns/default/sa/client",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("serving on https://127.0.0.1:"), line
        assert line.rstrip().endswith(f"clients trust {tmp_path / 'ca' / 'root-cert.pem'}")
        assert (tmp_path / "ca" / "root-cert.pem").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err


def test_bad_config_exits_1_naming_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("workloads: [{namespace: ns, workloadIps: ['10.0.0.300']}]")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ztunnel.standins.istiod",
            "serve",
            "--config",
            str(bad),
            "--ca-dir",
            str(tmp_path / "ca"),
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert r.returncode == 1
    assert f"error: {bad}: workloads[0].workloadIps[0]: '10.0.0.300' is not an IP address" in r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ztunnel.standins.istiod",
            "serve",
            "--ca-dir",
            str(tmp_path / "ca"),
            "--token",
            "t=not-spiffe",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert r.returncode == 1 and "invalid SPIFFE identity 'not-spiffe'" in r.stderr

"""``python -m bench.micro.tls_io`` (issue 17's gate: memory BIOs vs TLS on the socket), once, at tiny sizes.

Proves every design completes both workloads over a real loopback TCP pair with real TLS (all bytes delivered,
every echo equal to what was sent: the script checks and exits non-zero otherwise) and reports a number for each,
not that the numbers mean anything at these sizes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.micro.tls_io import DESIGNS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(90)
def test_tls_io_runs_every_design() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.micro.tls_io", "--gib", "0.01", "--pings", "50", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = proc.stdout.split("against bio:", 1)[1]
    for design in DESIGNS:
        # design, then CPU-s per GiB (median, min, paired ratio), then us per round trip (the same three)
        line = re.search(
            rf"^\s+{re.escape(design)}\s+([0-9.]+)\s+([0-9.]+)\s+\S+%\s+([0-9.]+)\s+([0-9.]+)\s", summary, re.M
        )
        assert line is not None, f"no summary line for {design}:\n{proc.stdout}"
        assert all(float(v) > 0 for v in line.groups())

"""``make demo`` as a user runs it: ``python -m ztunnel.demo`` in a subprocess, in both modes, exit status 0 and
the lines that say what happened, each read back from the ztunnels (access records, /metrics, config dump).

Both runs pass ``--relocate``: the example moved to a random block of 127/8, as every other test does, so they
never collide with a demo or benchmark holding the example's fixed addresses (the topology is the only
difference from the default).
"""

from __future__ import annotations

import re
import subprocess
import sys

SERVER = "spiffe://cluster.local/ns/default/sa/server"
CLIENT = "spiffe://cluster.local/ns/default/sa/client"


def run_demo(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "ztunnel.demo", "--relocate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"demo exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def check_connection(out: str) -> None:
    """The lines every mode prints about the one connection."""
    # The path, from node A's outbound access record: endpoint "server", HBONE to its :15008.
    m = re.search(r"node-a picked endpoint server at (\S+) and opened HBONE to (\S+) with :authority (\S+)", out)
    assert m is not None, out
    endpoint, hbone, authority = m.groups()
    assert hbone == f"{endpoint}:15008" and authority == f"{endpoint}:8080"
    assert f"identities: {CLIENT} -> {SERVER}" in out
    assert f"(peer identity {CLIENT}) and connected to the app at {endpoint}:8080" in out
    assert "echoed back: 'hello from the client, through HBONE'" in out
    assert re.search(r"then 8 MiB each way in \d+ ms", out)
    # Both access-log lines, verbatim JSON, with the bytes of the 8 MiB plus the greeting each way.
    access = re.findall(r"^  (node-[ab]): (\{.*\"connection complete\".*\})$", out, re.M)
    assert [n for n, _ in access] == ["node-a", "node-b"], out
    for _, line in access:
        assert '"bytes_sent": 8388644' in line and '"bytes_recv": 8388644' in line
        assert f'"src.identity": "{CLIENT}"' in line and f'"dst.identity": "{SERVER}"' in line
    # The metric lines of the connection from each reporter, scraped from port 15020 before the ztunnels stopped.
    for node, reporter in (("node-a", "source"), ("node-b", "destination")):
        for name, value in (
            ("istio_tcp_connections_opened_total", "1"),
            ("istio_tcp_sent_bytes_total", "8388644"),
            ("istio_tcp_received_bytes_total", "8388644"),
        ):
            pattern = (
                rf'^  {node}: {name}\{{reporter="{reporter}",.*connection_security_policy="mutual_tls".*\}} {value}$'
            )
            assert re.search(pattern, out, re.M), f"no {name} line for {node}\n{out}"
    assert "Both ztunnels drained on SIGTERM and exited with status [0, 0]." in out


def test_demo_embedded_default() -> None:
    out = run_demo()
    assert "certificates from a local CA in each ztunnel" in out
    check_connection(out)
    assert "Control plane" not in out


def test_demo_against_the_local_control_plane() -> None:
    out = run_demo("--control-plane")
    assert "certificates from the local control plane over gRPC" in out
    assert re.search(r"control  xDS \(delta ADS\) and CA \(CreateCertificate\) on https://127\.0\.0\.1:\d+, TLS", out)
    check_connection(out)
    # Both ztunnels held a delta ADS stream and ACKed; each certificate came from CreateCertificate and chains to
    # the control plane's root (serials read from each ztunnel's admin config dump).
    m = re.search(
        r"2 delta ADS streams \(node-a, node-b\), (\d+) responses ACKed, 0 NACKed; (\d+) CreateCertificate", out
    )
    assert m is not None and int(m[1]) >= 4 and int(m[2]) >= 2, out
    for node, identity in (("node-a", CLIENT), ("node-b", SERVER)):
        assert re.search(
            rf"  {node} certificate for {identity} \(admin config_dump\): serial [0-9a-f]+, issued by the control "
            r"plane's CA$",
            out,
            re.M,
        ), out

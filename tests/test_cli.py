from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parent.parent


def ztunnel(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ztunnel", *args],
        env={"PATH": os.environ["PATH"], **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        **kw,
    )


def test_version_and_help() -> None:
    out = ztunnel("version")
    assert out.returncode == 0 and out.stdout.startswith("ztunnel ")
    out = ztunnel("help")
    assert out.returncode == 0 and "usage: ztunnel" in out.stdout
    out = ztunnel("frobnicate")
    assert out.returncode == 2 and "unknown command 'frobnicate'" in out.stderr


# The config dump schema's "config" object, on its own.
CONFIG_SCHEMA = {"$defs": json.loads((ROOT / "tests" / "config_dump.schema.json").read_text())["$defs"]}
CONFIG_SCHEMA["$ref"] = "#/$defs/config"


def test_config_prints_effective_configuration() -> None:
    out = ztunnel("config", env={"CLUSTER_ID": "c9", "SECRET_TTL": "1h"})
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    jsonschema.validate(cfg, CONFIG_SCHEMA)  # every key upstream's /config_dump has, in upstream's shape
    assert cfg["clusterId"] == "c9" and cfg["secretTtl"] == {"secs": 3600, "nanos": 0}
    assert cfg["proxyArgs"] == "config"


def test_config_uses_upstream_names_and_shapes(tmp_path: Path) -> None:
    root = tmp_path / "root-cert.pem"
    root.write_text("-----BEGIN CERTIFICATE-----\n")
    env = {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": "ns1/app/sa1",
        "HTTP2_STREAM_WINDOW_SIZE": "65536",
        "HTTP2_CONNECTION_WINDOW_SIZE": "262144",
        "HTTP2_FRAME_SIZE": "32768",
        "POOL_MAX_STREAMS_PER_CONNECTION": "7",
        "POOL_UNUSED_RELEASE_TIMEOUT": "1m30s",
        "CONNECTION_TERMINATION_DEADLINE": "2500ms",
        "ENABLE_ORIG_SRC": "false",
        "KEEPALIVE_TIME": "20s",
        "NODE_NAME": "n1",
        "POD_NAME": "zt-1",
        "POD_NAMESPACE": "istio-system",
        "SERVICE_ACCOUNT": "ztunnel",
        "XDS_HEADER_TENANT": "t1",
        "XDS_ROOT_CA": "SYSTEM",
        "CA_ROOT_CA": str(root),
        "ENABLE_RESPONSE_BAGGAGE": "false",
        "UNSTABLE_ENABLE_SOCKS5": "true",
        "ISTIO_META_DNS_PROXY_ADDR": "127.0.0.1:15053",
        "AUTH_TOKEN": "s3cret-token-value",
    }
    out = ztunnel("config", env=env)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    jsonschema.validate(cfg, CONFIG_SCHEMA)
    assert "s3cret-token-value" not in out.stdout  # secrets never leave the process
    expected = {
        "proxy": True,
        "proxyMode": "Dedicated",
        "proxyWorkloadInformation": {"name": "app", "namespace": "ns1", "serviceAccount": "sa1"},
        "windowSize": 65536,
        "connectionWindowSize": 262144,
        "frameSize": 32768,
        "poolMaxStreamsPerConn": 7,
        "poolUnusedReleaseTimeout": {"secs": 90, "nanos": 0},
        "selfTerminationDeadline": {"secs": 2, "nanos": 500_000_000},
        "requireOriginalSource": False,
        "localNode": "n1",
        "ztunnelIdentity": "spiffe://cluster.local/ns/istio-system/sa/ztunnel",
        "ztunnelWorkload": {"name": "zt-1", "namespace": "istio-system", "serviceAccount": "ztunnel"},
        "xdsHeaders": [["tenant", "t1"]],
        "caHeaders": [],
        "xdsRootCert": "Default",
        "caRootCert": {"File": str(root)},
        "enableEnhancedBaggage": False,
        "socks5Addr": "127.0.0.1:15080",
        "adminAddr": {"Localhost": [True, 15000]},
        "statsAddr": {"SocketAddr": "[::]:15020"},
        "dnsProxyAddr": {"SocketAddr": "127.0.0.1:15053"},
        "fakeSelfInbound": False,
    }
    assert {k: cfg[k] for k in expected} == expected
    sc = cfg["socketConfig"]
    assert sc["keepaliveTime"] == {"secs": 20, "nanos": 0} and sc["keepaliveRetries"] == 9
    assert sorted(cfg["illegalPorts"]) == [15001, 15006, 15008, 15080]
    # Inline PEM is shown as upstream shows it, without its content.
    inline = json.loads(ztunnel("config", env={"CA_ROOT_CA": "-----BEGIN CERTIFICATE-----"}).stdout)
    assert inline["caRootCert"] == "Static"


def test_bad_env_exits_nonzero_with_message() -> None:
    out = ztunnel("proxy", env={"POOL_MAX_STREAMS_PER_CONNECTION": "lots"})
    assert out.returncode == 1
    assert "invalid value for POOL_MAX_STREAMS_PER_CONNECTION: 'lots'" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_local_config_exits_nonzero_with_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("workloads: [{namespace: a, workloadIps: [nope]}]")
    out = ztunnel("proxy", env={"XDS_ADDRESS": "", "FAKE_CA": "true", "LOCAL_XDS_PATH": str(bad)})
    assert out.returncode == 1
    assert f"{bad}: workloads[0].workloadIps[0]: 'nope' is not an IP address" in out.stderr
    assert "Traceback" not in out.stderr


def test_proxy_runs_on_local_config_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    env = {
        "PATH": os.environ["PATH"],
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "LOCAL_XDS_PATH": str(ROOT / "examples" / "localhost.yaml"),
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": "default/local/default",
        "ZTUNNEL_CA_DIR": str(tmp_path / "ca"),
        "LOG_FORMAT": "json",
    }
    # Every listener on an address of its own, so the test never collides with anything on the default ports.
    ip = f"127.{random.randrange(64, 250)}.{random.randrange(0, 250)}.1"
    for var, port in (
        ("ZTUNNEL_OUTBOUND_ADDR", 15001),
        ("ZTUNNEL_INBOUND_ADDR", 15008),
        ("ZTUNNEL_INBOUND_PLAINTEXT_ADDR", 15006),
        ("ZTUNNEL_ADMIN_ADDR", 15000),
        ("ZTUNNEL_STATS_ADDR", 15020),
        ("ZTUNNEL_READINESS_ADDR", 15021),
        ("ISTIO_META_DNS_PROXY_ADDR", 15053),
    ):
        env[var] = f"{ip}:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ztunnel", "proxy", "ztunnel"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(json.loads(line))
            if lines[-1]["message"].startswith("ztunnel started"):
                break
        assert any(r["message"].startswith("loaded local config: 2 workloads") for r in lines), (lines, proc.poll())
        # The third-party patches are applied at start by the app (this process has none of the test session's):
        # garbage on 15021 gets hyper's HTTP/1.1 400, not aiohttp's HTTP/1.0 (ztunnel/thirdparty.py).
        with socket.create_connection((ip, 15021), timeout=5) as s:
            s.sendall(b"hello world\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 400 ")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "shutdown complete" in out


def test_proxy_raises_the_open_files_limit_at_start(tmp_path: Path) -> None:
    """As upstream, ztunnel lifts its soft RLIMIT_NOFILE to the hard limit before serving (a node's pods need
    thousands of sockets): started with a soft limit of 256, it runs with the hard limit, and process_max_fds
    reports it."""
    import resource
    import urllib.request

    import pytest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from ztunnel.testing import TwoNodeMesh

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard open-files limit ({hard}) leaves no room to start below it")

    m = TwoNodeMesh(tmp_path)
    # The child lowers its own soft limit, then runs `ztunnel proxy` as `python -m ztunnel` would.
    start = (
        "import resource, runpy, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard}))\n"
        "sys.argv = ['ztunnel', 'proxy']\n"
        "runpy.run_module('ztunnel', run_name='__main__', alter_sys=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", start],
        env={"PATH": os.environ["PATH"], **m.env_a()},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "ztunnel did not become ready"
            try:
                with urllib.request.urlopen(f"http://{m.node_a}:15021/healthz/ready", timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
        (line,) = [x for x in Path(f"/proc/{proc.pid}/limits").read_text().splitlines() if "Max open files" in x]
        want = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        assert line.split()[3:5] == [want, want], line  # soft and hard
        with urllib.request.urlopen(f"http://{m.node_a}:15020/metrics", timeout=5) as r:
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        if hard != resource.RLIM_INFINITY:
            assert fams["process_max_fds"].samples[0].value == hard
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0

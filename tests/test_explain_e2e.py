"""``ztunnel explain`` against real connections: for each case, in-process ztunnels on loopback (examples/two-node.yaml
on addresses of its own, edited per case) carry a real connection, and explain, reading node A's live
``/config_dump`` over its admin port, must have predicted what happened: connected or refused, by which policy, where
the bytes went.

The cases: allowed (the example's ALLOW matches), denied by DENY (port 9999), no ALLOW match (the ALLOW names another
principal), dry-run (a dry-run DENY that matches but is not enforced: the proxy logs it, the connection goes
through), passthrough (an address outside the mesh: plain TCP to it) and waypoint (a service with a waypoint: HBONE
to the waypoint's ztunnel with the original destination as ``:authority``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.proxy.test_inbound_e2e import Relay, inbound_lines, with_waypoint
from ztunnel.explain import explain, fetch_dump
from ztunnel.rbac import NOT_ALLOWED
from ztunnel.testing import (
    EchoServer,
    TwoNodeMesh,
    access_fields,
    eventually,
    node_env,
    running_app,
    socks5_connect,
)

CLIENT_SA = "spiffe://cluster.local/ns/default/sa/client"
SERVER_SA = "spiffe://cluster.local/ns/default/sa/server"
WAYPOINT_SA = "spiffe://cluster.local/ns/default/sa/waypoint"

DRY_RUN_DENY = """
- name: dry-deny-8080
  namespace: default
  scope: Namespace
  action: Deny
  dryRun: true
  rules:
  - - - destinationPorts: [8080]
"""


def _no_allow_match(text: str) -> str:
    old = "principals: [{Exact: cluster.local/ns/default/sa/client}]"
    assert old in text
    return text.replace(old, "principals: [{Exact: cluster.local/ns/default/sa/someone-else}]")


def _dry_run(text: str) -> str:
    return text.rstrip("\n") + "\n" + DRY_RUN_DENY


@dataclass(frozen=True)
class Case:
    edit: Callable[[str], str] | None
    # (host, port) the client dials, from the mesh: the service VIP, the server's 9999, an address outside the mesh
    target: Callable[[TwoNodeMesh], tuple[str, int]]
    verdict: str  # explain's: allow / deny
    outbound: str  # explain's outbound result: hbone / passthrough


def _outside(m: TwoNodeMesh) -> tuple[str, int]:
    return m.plain.rsplit(".", 1)[0] + ".7", 8080  # in the mesh's block, but no workload or service has it


CASES = {
    "allowed": Case(None, lambda m: m.vip, "allow", "hbone"),
    "denied-by-deny": Case(None, lambda m: (m.node_b, 9999), "deny", "hbone"),
    "no-allow-match": Case(_no_allow_match, lambda m: m.vip, "deny", "hbone"),
    "dry-run": Case(_dry_run, lambda m: m.vip, "allow", "hbone"),
    "passthrough": Case(None, _outside, "allow", "passthrough"),
}


async def _connect(m: TwoNodeMesh, host: str, port: int) -> str:
    """``connected`` if the bytes came back through the path, else how it failed."""
    try:
        reader, writer = await asyncio.wait_for(socks5_connect((m.node_a, 15080), host, port), 10)
    except ConnectionError as e:
        return f"refused: {e}"
    payload = os.urandom(64 * 1024)
    writer.write(payload)
    writer.write_eof()
    got = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return "connected" if got == payload else f"got {len(got)} of {len(payload)} bytes"


@pytest.mark.parametrize("name", list(CASES))
async def test_explain_predicts_the_real_connection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    case = CASES[name]
    m = TwoNodeMesh(tmp_path, case.edit)
    host, port = case.target(m)
    caplog.set_level(logging.INFO, logger="access")
    caplog.set_level(logging.DEBUG, logger="ztunnel.rbac")  # last: the capture handler takes this level
    app = await EchoServer().start(host if name == "passthrough" else m.node_b, port if port != 80 else 8080)
    try:
        async with running_app(m.env_a()), running_app(m.env_b()):
            dump = await asyncio.to_thread(fetch_dump, f"{m.node_a}:15000")
            report = explain(dump, m.node_a, f"{host}:{port}")
            outcome = await _connect(m, host, port)
    finally:
        await app.stop()
    out, inbound = report["outbound"], report["inbound"]
    assert report["verdict"] == case.verdict, report
    assert out["result"] == case.outbound, out
    # What explain predicted is what happened.
    if case.verdict == "allow":
        assert outcome == "connected", outcome
        assert app.connections == 1
        if case.outbound == "hbone":
            # The destination_service node B logged is the one explain says its ztunnel guesses.
            (b_line,) = await eventually(lambda: inbound_lines(caplog, m.node_b))
            assert b_line.get("dst.service") == inbound["destination_service"], (b_line, inbound)
    else:
        assert outcome == "refused: SOCKS5 reply 2", outcome
        assert app.connections == 0  # the destination's ztunnel refused it before the app
        assert inbound["status"] == 401 and inbound["response_flag"] == "DENY"
        # The reasons explain gives are the ones the proxies logged: the destination's policy reason, the source's
        # failure.
        (b_line,) = await eventually(lambda: inbound_lines(caplog, m.node_b))
        assert b_line["error"] == f"connection closed due to policy rejection: {inbound['reason']}"
        a_errors = [f.get("error") for f in access_fields(caplog.records, "outbound")]
        assert a_errors == [report["source_error"]["error"]] == ["http status: 401 Unauthorized"]
    if case.outbound == "hbone":
        assert out["next_hop"] == f"{m.node_b}:15008"
        assert out["authority"] == f"{m.node_b}:{8080 if port == 80 else port}"
        assert out["expected_identities"] == [SERVER_SA]
        assert inbound["local_workload"]["name"] == "default/server"
        assert inbound["connection"]["identity"] == CLIENT_SA
    decided = [p["policy"] for p in inbound.get("policies", ()) if p.get("decided")]
    dry_logged = [
        r.__dict__.get("fields", {}).get("policy") for r in caplog.records if r.getMessage().startswith("dry-run")
    ]
    if name == "allowed":
        assert decided == ["default/allow-client"] and out["service"] == "default/echo.default.svc.cluster.local"
        assert [s["step"] for s in out["steps"]][:2] == ["service", "waypoint"]
    elif name == "denied-by-deny":
        assert decided == ["default/deny-9999"] and inbound["reason"] == "explicitly denied by: default/deny-9999"
        deny = next(p for p in inbound["policies"] if p["policy"] == "default/deny-9999")
        assert deny["matched"] and deny["rules"][0]["held"]
    elif name == "no-allow-match":
        assert decided == [] and inbound["reason"] == NOT_ALLOWED
        allow = next(p for p in inbound["policies"] if p["policy"] == "default/allow-client")
        (match,) = allow["rules"][0]["clauses"][0]["matches"]
        assert match["failed"] == "principals" and "cluster.local/ns/default/sa/client" in match["why"]
    elif name == "dry-run":
        # Explain and the proxy (its debug log at node B) both saw the dry-run DENY match; neither enforced it.
        assert inbound["dry_run"] == ["deny policy match (default/dry-deny-8080)"]
        assert "default/dry-deny-8080" in dry_logged
        assert decided == ["default/allow-client"]
    elif name == "passthrough":
        assert out["next_hop"] == f"{host}:{port}" and out["authority"] is None
        assert not inbound["applies"] and out["expected_identities"] == []


async def test_explain_predicts_the_waypoint_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A service with a waypoint: explain says HBONE to the waypoint's address with the VIP as ``:authority`` and the
    waypoint's identity expected; the waypoint's ztunnel (W) really receives it so, from the client."""
    m = TwoNodeMesh(tmp_path)
    w_ip, _ = with_waypoint(m, "service-vip")
    caplog.set_level(logging.INFO, logger="access")
    echo = await EchoServer().start(*m.server_app)
    relay = await Relay((w_ip, 15080), m.server_app, w_ip).start(w_ip, m.vip[1])
    env_w = node_env("node-w", w_ip, "default/waypoint/waypoint", m.ca_dir, m.config)
    try:
        async with running_app(m.env_a()), running_app(env_w), running_app(m.env_b()):
            dump = await asyncio.to_thread(fetch_dump, f"{m.node_a}:15000")
            report = explain(dump, "default/client", f"{m.vip[0]}:{m.vip[1]}")
            outcome = await _connect(m, *m.vip)
            w_lines: list[dict[str, Any]] = await eventually(lambda: inbound_lines(caplog, w_ip))
    finally:
        await relay.stop()
        await echo.stop()
    out = report["outbound"]
    assert report["verdict"] == "allow" and outcome == "connected"
    assert out["result"] == "hbone" and out["waypoint"] is not None and "default/waypoint" in out["waypoint"]
    assert out["next_hop"] == f"{w_ip}:15008" and out["authority"] == f"{m.vip[0]}:{m.vip[1]}"
    assert out["expected_identities"] == [WAYPOINT_SA]
    assert report["inbound"]["local_workload"]["name"] == "default/waypoint"
    # W authorizes the stream to its own address on the authority's port (its inbound's upstream), from the client.
    assert report["inbound"]["connection"]["destination"] == f"{w_ip}:{m.vip[1]}"
    assert report["inbound"]["connection"]["identity"] == CLIENT_SA
    # What W saw matches: the original destination as :authority, from the client, to the waypoint workload.
    assert len(w_lines) == 1, w_lines
    assert w_lines[0]["dst.hbone_addr"] == out["authority"]
    assert w_lines[0]["src.identity"] == CLIENT_SA and w_lines[0]["dst.workload"] == "waypoint"

"""``ztunnel explain`` against real captured traffic: the in-pod cluster of the namespaced tests (tests/inpod/cluster.py:
real namespaces, istio-cni's iptables rules, two ztunnel processes), with a policy on server-b that denies the
uncaptured pod "plain". Explain, reading node1's ``/config_dump`` from its admin port inside the node, must predict:

* plain (outside the mesh) -> server-b: not captured at the source; server-b's ztunnel (15006, no identity) closes it;
* plain -> server-a: not captured; no policy for server-a: it reaches the app;
* client (captured) -> server-b: HBONE; the policy names plain's address only: it reaches the app.
"""

from __future__ import annotations

import asyncio
import errno
import re
from pathlib import Path

import pytest

from tests.inpod.cluster import Cluster, peer_and_body, running_cluster, topology
from ztunnel.explain import explain, fetch_dump
from ztunnel.testing import netns as tn

__all__ = ["topology"]  # fixture

pytestmark = pytest.mark.root

POLICY = """
policies:
- {{name: deny-plain, namespace: default, scope: WorkloadSelector, action: Deny,
   rules: [[[{{sourceIps: ["{plain}/32"]}}]]]}}
"""


def with_policy(mesh: str, node_ips: dict[str, str]) -> str:
    """server-b names the WorkloadSelector policy deny-plain, which denies the address of the pod "plain"."""
    found = re.search(r'name: plain,.*?workloadIps: \["([^"]+)"\]', mesh, re.S)
    assert found is not None, mesh
    anchor = "node: node2, canonicalName: echo"  # server-b's entry
    assert mesh.count(anchor) == 1
    mesh = mesh.replace(anchor, "node: node2, authorizationPolicies: [default/deny-plain], canonicalName: echo")
    return mesh.rstrip("\n") + "\n" + POLICY.format(plain=found.group(1))


def _attempt(c: Cluster, pod: str, host: str) -> str:
    try:
        reply = c.call(pod, host, 8080, b"hello", timeout=5)
    except OSError as e:
        # A denied connection is closed by the destination's ztunnel right after accept; whether the client then
        # sees an orderly end, a reset or "not connected" (its shutdown after the reset) is a race of the kernel.
        if e.errno in (errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE):
            return "closed"
        return f"failed: {e}"
    if not reply:
        return "closed"
    _, body = peer_and_body(reply)
    return "connected" if body == b"hello" else f"got {reply!r}"


async def test_explain_predicts_captured_and_uncaptured_traffic(topology: tn.Topology, tmp_path: Path) -> None:
    async with running_cluster(topology, tmp_path, dns=False, mesh_edit=with_policy) as c:
        plain_ip = c.pods["plain"].ip
        dump = await asyncio.to_thread(c.nodes["node1"].run, fetch_dump, "127.0.0.1:15000")
        server_a, server_b = c.pods["server-a"].ip, c.pods["server-b"].ip
        cases = {
            ("plain", server_b): ("deny", "not-captured"),
            ("plain", server_a): ("allow", "not-captured"),
            ("client", server_b): ("allow", "hbone"),
        }
        for (pod, host), (verdict, result) in cases.items():
            report = explain(dump, c.pods[pod].ip, f"{host}:8080")
            assert (report["verdict"], report["outbound"]["result"]) == (verdict, result), (pod, host, report)
            outcome = await asyncio.to_thread(_attempt, c, pod, host)
            assert outcome == ("connected" if verdict == "allow" else "closed"), (pod, host, outcome)
        denied = explain(dump, plain_ip, f"{server_b}:8080")["inbound"]
        assert denied["listener"] == "inbound plaintext (15006)" and denied["connection"]["identity"] is None
        assert denied["reason"] == "explicitly denied by: default/deny-plain" and denied["response_flag"] == "DENY"
        # The destination's ztunnel logged the same reason.
        records = [r for r in c.access("node2") if r.get("direction") == "inbound" and "error" in r]
        assert any(r["error"].endswith(denied["reason"]) for r in records), records

"""``ztunnel explain`` on upstream Rust ztunnel's ``/config_dump``: upstream runs in a network namespace of its own
(dedicated mode, a local config, its fake CA), its dump is fetched from its admin port there, and explain must give
the same answers on it as on this project's ztunnel's dump of the same mesh.

Skipped, with the reason, unless ``ZTUNNEL_UPSTREAM_BIN`` names an upstream build and namespaces can be made here
(``make interop-upstream`` runs it, and fails it instead).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from ztunnel.explain import Dump, explain, fetch_dump
from ztunnel.testing import ZtunnelProcess, node_env, running_app
from ztunnel.testing import netns as tn
from ztunnel.testing.interop import require_upstream

pytestmark = pytest.mark.root

# Upstream's local config needs every field serde has no default for (services, dryRun) and writes string matches as
# YAML tags; this project's reader takes upstream's JSON form. {exact}/{prefix}/{presence} are filled per reader.
MESH = """\
workloads:
- uid: Kubernetes//v1/Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  workloadIps: ["{client}"]
  protocol: HBONE
  node: node-a
  services: {{}}
- uid: Kubernetes//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  workloadIps: ["{server}"]
  protocol: HBONE
  node: node-b
  services:
    "default/echo.default.svc.cluster.local":
      80: 8080
- uid: Kubernetes//v1/Pod/default/server2
  name: server2
  namespace: default
  serviceAccount: server
  workloadIps: ["{server2}"]
  protocol: HBONE
  node: node-b
  capacity: 3
  services:
    "default/echo.default.svc.cluster.local":
      80: 8080
- uid: Kubernetes//v1/Pod/default/plain
  name: plain
  namespace: default
  serviceAccount: plain
  workloadIps: ["{plain}"]
  protocol: TCP
  node: node-c
  services: {{}}
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/{vip}"]
  ports:
    80: 8080
  subjectAltNames: ["spiffe://cluster.local/ns/default/sa/server"]
policies:
- name: allow-client
  namespace: default
  scope: Namespace
  action: Allow
  dryRun: false
  rules:
  - - - principals: [{exact}]
- name: deny-9999
  namespace: default
  scope: Namespace
  action: Deny
  dryRun: false
  rules:
  - - - destinationPorts: [9999]
- name: dry-deny
  namespace: default
  scope: Namespace
  action: Deny
  dryRun: true
  rules:
  - - - notPrincipals: [{prefix}]
        sourceIps: ["{client}/32"]
      - namespaces:
        - {presence}
"""


def _mesh(addrs: dict[str, str], upstream: bool) -> str:
    if upstream:
        forms = {"exact": "!Exact cluster.local/ns/default/sa/client", "prefix": "!Prefix cluster.local/ns/x"}
        forms["presence"] = "!Presence"
    else:
        forms = {"exact": "{Exact: cluster.local/ns/default/sa/client}", "prefix": "{Prefix: cluster.local/ns/x}"}
        forms["presence"] = "Presence"
    return MESH.format(**addrs, **forms)


def _essentials(report: dict[str, Any]) -> dict[str, Any]:
    """What must agree: every decision and reason, not where the dump came from."""
    out, inbound = report["outbound"], report["inbound"]
    return {
        "verdict": report["verdict"],
        "outbound": {k: v for k, v in out.items() if k not in ("source",)},
        "inbound": inbound,
    }


def _upstream_dump(binary: str, mesh: Path, workdir: Path) -> Dump:
    with tn.topology() as topo:
        node = topo.node("node1")
        env = {
            "XDS_ADDRESS": "",
            "CA_ADDRESS": "",
            "FAKE_CA": "true",
            "LOCAL_XDS_PATH": str(mesh),
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": "default/client/client",
            "NODE_NAME": "node-a",
            "ISTIO_META_DNS_CAPTURE": "false",
        }
        proc = ZtunnelProcess(
            env, workdir / "upstream.log", argv=[binary, "proxy", "ztunnel"], netns=node, kill_with_parent=True
        )
        proc.start(timeout=30)
        try:
            return node.run(fetch_dump, "127.0.0.1:15000")
        finally:
            proc.stop()


async def test_explain_reads_upstreams_dump_as_ours(tmp_path: Path) -> None:
    binary = require_upstream()  # a visible skip without ZTUNNEL_UPSTREAM_BIN (a failure in make interop-upstream)
    n = random.randrange(64, 250)
    addrs = {
        "client": f"127.{n}.1.1",
        "server": f"127.{n}.2.1",
        "server2": f"127.{n}.2.2",
        "plain": f"127.{n}.3.1",
        "vip": f"127.{n}.4.10",
    }
    up_mesh, our_mesh = tmp_path / "upstream.yaml", tmp_path / "ours.yaml"
    up_mesh.write_text(_mesh(addrs, upstream=True))
    our_mesh.write_text(_mesh(addrs, upstream=False))
    up = _upstream_dump(binary, up_mesh, tmp_path)
    assert up.version, "upstream's version block was not read from its dump"
    assert len(up.state.workloads) == 4 and len(up.state.policies) == 3
    (echo,) = up.state.services
    assert set(echo.endpoints) == {"Kubernetes//v1/Pod/default/server", "Kubernetes//v1/Pod/default/server2"}
    env = node_env("node-a", addrs["client"], "default/client/client", tmp_path / "ca", our_mesh)
    async with running_app(env):
        ours = await asyncio.to_thread(fetch_dump, f"{addrs['client']}:15000")
    targets = [
        f"{addrs['vip']}:80",
        "echo.default.svc.cluster.local:80",
        f"{addrs['server']}:9999",
        f"{addrs['plain']}:80",
        f"127.{n}.9.9:80",
    ]
    for target in targets:
        theirs_report, ours_report = explain(up, "default/client", target), explain(ours, "default/client", target)
        assert _essentials(theirs_report) == _essentials(ours_report), target
    # And the answers are the expected ones (not merely equal): the weighted pick, the DENY, the dry-run.
    vip = explain(up, addrs["client"], f"{addrs['vip']}:80")
    pick = next(s for s in vip["outbound"]["steps"] if s["step"] == "pick")
    assert pick["chances"] == {"Kubernetes//v1/Pod/default/server": 0.25, "Kubernetes//v1/Pod/default/server2": 0.75}
    assert vip["verdict"] == "allow" and vip["inbound"]["dry_run"] == ["deny policy match (default/dry-deny)"]
    assert explain(up, addrs["client"], f"{addrs['server']}:9999")["verdict"] == "deny"

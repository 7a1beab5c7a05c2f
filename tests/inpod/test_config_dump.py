"""``/config_dump`` of an in-pod ztunnel in real namespaces: ``workloadState`` in upstream's shape
(``inpod/admin.rs`` + ``connection_manager.rs``), validated against the schema, with live connections in it."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema

from tests.inpod.cluster import Cluster, cluster, topology

__all__ = ["cluster", "topology"]  # fixtures

SCHEMA = json.loads((Path(__file__).parent.parent / "config_dump.schema.json").read_text())


def config_dump(c: Cluster, node: str) -> dict[str, Any]:
    def get() -> dict[str, Any]:
        # The admin API listens on localhost:15000 inside the node's namespace.
        with urllib.request.urlopen("http://127.0.0.1:15000/config_dump", timeout=5) as r:
            return dict(json.loads(r.read()))

    return c.nodes[node].run(get)


def open_conversation(c: Cluster, pod: str, host: str) -> socket.socket:
    """A connection from ``pod`` that stays open (captured by the pod's rules, so it goes through ztunnel)."""
    sock = c.pods[pod].new_socket()
    sock.setblocking(True)
    sock.settimeout(10)
    sock.connect((host, 8080))
    line = b""
    while not line.endswith(b"\n"):
        line += sock.recv(1)  # the app's "peer=..." greeting: the tunnel is up
    return sock


async def test_workload_state_lists_pods_and_their_connections(cluster: Cluster) -> None:
    c = cluster
    client, server_b = c.pods["client"].ip, c.pods["server-b"].ip
    sock = await asyncio.to_thread(open_conversation, c, "client", server_b)
    try:
        await asyncio.sleep(0.2)  # the server side registers its end after answering 200
        node1 = await asyncio.to_thread(config_dump, c, "node1")
        node2 = await asyncio.to_thread(config_dump, c, "node2")
    finally:
        sock.close()
    for dump in (node1, node2):
        jsonschema.validate(dump, SCHEMA)

    state1 = node1["workloadState"]
    assert set(state1) == {"Kubernetes//Pod/default/client", "Kubernetes//Pod/default/server-a"}
    pod = state1["Kubernetes//Pod/default/client"]
    assert pod["state"] == "Up"
    assert pod["info"] == {"name": "client", "namespace": "default", "serviceAccount": "client"}
    # The client's one connection: captured on its way to server-b:8080, sent over HBONE to server-b's 15008.
    assert pod["connections"]["inbound"] == []
    (out,) = pod["connections"]["outbound"]
    assert out["src"].startswith(f"{client}:")
    assert out == {
        "src": out["src"],
        "originalDst": f"{server_b}:8080",
        "actualDst": f"{server_b}:15008",
        "protocol": "HBONE",
    }
    assert state1["Kubernetes//Pod/default/server-a"]["connections"] == {"inbound": [], "outbound": []}

    state2 = node2["workloadState"]
    assert set(state2) == {"Kubernetes//Pod/default/server-b"}
    server = state2["Kubernetes//Pod/default/server-b"]
    assert server["state"] == "Up" and server["info"]["serviceAccount"] == "server"
    # The far end: what policy saw (the client's address, the app's ip:port), HBONE since the peer had an identity.
    (inb,) = server["connections"]["inbound"]
    assert inb["src"].startswith(f"{client}:")
    assert inb["actualDst"] == f"{server_b}:8080" and inb["protocol"] == "HBONE"
    assert server["connections"]["outbound"] == []

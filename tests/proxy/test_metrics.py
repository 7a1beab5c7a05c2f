"""The per-connection label cache of ``ztunnel.proxy.metrics``: fast on repeats, never stale."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

from ztunnel.baggage import Baggage
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.common import ResponseFlag
from ztunnel.proxy.metrics import (
    _LABEL_CACHE,
    MAX_LABEL_CHARS,
    MAX_PRINCIPAL_CHARS,
    DerivedWorkload,
    _build_traffic_labels,
    traffic_labels,
)
from ztunnel.state.workload import Workload
from ztunnel.testing import EchoServer, TwoNodeMesh, hbone_dial, hbone_request, running_app

SRC = Workload(uid="u1", name="client-1", namespace="default", workload_name="client", canonical_name="client")
DST = Workload(uid="u2", name="server-1", namespace="default", workload_name="server", service_account="server")
SVC = ("echo.default.svc.cluster.local", "echo", "default")


def test_repeat_connections_share_one_label_tuple() -> None:
    first = traffic_labels("source", SRC, None, DST, SVC, True, ResponseFlag.NONE)
    again = traffic_labels("source", SRC, None, DST, SVC, True, ResponseFlag.NONE)
    assert again is first
    assert first == _build_traffic_labels("source", SRC, None, DST, SVC, True, ResponseFlag.NONE)


def test_an_updated_workload_is_a_new_key() -> None:
    """xDS replaces a workload object when it changes: the labels follow, even for an equal-looking key."""
    before = traffic_labels("destination", SRC, None, DST, SVC, True, ResponseFlag.NONE)
    renamed = dataclasses.replace(DST, workload_name="server-v2")
    after = traffic_labels("destination", SRC, None, renamed, SVC, True, ResponseFlag.NONE)
    assert dict(before)["destination_workload"] == "server"
    assert dict(after)["destination_workload"] == "server-v2"


def test_every_argument_is_part_of_the_key() -> None:
    base = ("source", SRC, None, DST, SVC, True, ResponseFlag.NONE)
    variants = [
        ("destination", SRC, None, DST, SVC, True, ResponseFlag.NONE),
        ("source", None, None, DST, SVC, True, ResponseFlag.NONE),
        ("source", SRC, None, None, SVC, True, ResponseFlag.NONE),
        ("source", SRC, None, DST, None, True, ResponseFlag.NONE),
        ("source", SRC, None, DST, SVC, False, ResponseFlag.NONE),
        ("source", SRC, None, DST, SVC, True, ResponseFlag.DENY),
    ]
    for v in variants:
        assert traffic_labels(*v) == _build_traffic_labels(*v) != _build_traffic_labels(*base)


def test_the_cache_is_bounded() -> None:
    for i in range(5000):
        w = dataclasses.replace(DST, uid=f"u{i}")
        traffic_labels("source", SRC, None, w, SVC, True, ResponseFlag.NONE)
    assert len(_LABEL_CACHE) <= 4096


# -- label values from peers are bounded ----------------------------------------------------------------------------

HUGE = "x" * 100_000


def test_peer_supplied_label_values_are_bounded() -> None:
    """Baggage (every derived-source label) comes from the peer: one request must not make a 100 KB series. Values
    (any label, the destination service too) are cut to MAX_LABEL_CHARS (253, the longest Kubernetes name or DNS
    hostname); principals, which are CA-issued SPIFFE identities up to 586 characters, to MAX_PRINCIPAL_CHARS."""
    bag = Baggage(HUGE, HUGE, HUGE, HUGE, HUGE, HUGE, HUGE)
    derived = DerivedWorkload.from_baggage(bag, Identity("t" * 253, "n" * 63, "s" * 5000))
    labels = dict(_build_traffic_labels("destination", None, derived, DST, (HUGE, HUGE, HUGE), True, ResponseFlag.NONE))
    for name, value in labels.items():
        limit = MAX_PRINCIPAL_CHARS if name.endswith("_principal") else MAX_LABEL_CHARS
        assert len(value) <= limit, (name, len(value))
    assert labels["source_workload"] == "x" * (MAX_LABEL_CHARS - 3) + "..."
    assert labels["destination_service"] == "x" * (MAX_LABEL_CHARS - 3) + "..."
    assert labels["source_principal"].endswith("...") and len(labels["source_principal"]) == MAX_PRINCIPAL_CHARS
    # The derived workload itself is bounded: the label cache keys on it, and the access log prints it.
    assert all(len(v or "") <= MAX_LABEL_CHARS for v in dataclasses.astuple(derived)[:-1] if isinstance(v, str))


def test_legitimate_values_are_untouched() -> None:
    longest_name = "a" * 253
    identity = Identity("t" * 253, "n" * 63, "s" * 253)  # 586 characters: the longest SPIFFE identity
    derived = DerivedWorkload.from_baggage(Baggage(workload_name=longest_name, namespace="n" * 63), identity)
    labels = dict(_build_traffic_labels("destination", None, derived, DST, SVC, True, ResponseFlag.NONE))
    assert labels["source_workload"] == longest_name
    assert labels["source_principal"] == str(identity) and len(str(identity)) == 586
    assert labels["destination_service"] == SVC[0]


async def test_one_peer_cannot_make_a_megabyte_series(tmp_path: Path) -> None:
    """A raw HBONE client (not a known workload by IP) sends 60 KB of baggage: node B's /metrics stays small."""
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    try:
        async with running_app(m.env_a()), running_app(m.env_b()):
            ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
            cert = ca.issue(Identity("cluster.local", "default", "client"), timedelta(hours=1))
            conn: Any = await hbone_dial((m.node_b, 15008), cert)
            baggage = f"k8s.deployment.name={'w' * 30_000},k8s.namespace.name={'n' * 30_000}"
            status, _ = await hbone_request(
                conn, f"{m.server_app[0]}:{m.server_app[1]}", headers=[("baggage", baggage)]
            )
            assert status == 200
            conn.close("test done")

            def scrape() -> bytes:
                with urllib.request.urlopen(f"http://{m.node_b}:15020/metrics", timeout=5) as resp:
                    return bytes(resp.read())

            body = (await asyncio.to_thread(scrape)).decode()
    finally:
        await echo.stop()
    workloads = set(re.findall(r'source_workload="([^"]*)"', body))
    assert "w" * (MAX_LABEL_CHARS - 3) + "..." in workloads, sorted(map(len, workloads))
    assert max(map(len, workloads)) <= MAX_LABEL_CHARS
    assert len(body) < 100_000, len(body)  # before: every series carried 60 KB

"""The per-connection label cache of ``ztunnel.proxy.metrics``: fast on repeats, never stale."""

from __future__ import annotations

import dataclasses

from ztunnel.proxy.common import ResponseFlag
from ztunnel.proxy.metrics import _LABEL_CACHE, _build_traffic_labels, traffic_labels
from ztunnel.state.workload import Workload

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

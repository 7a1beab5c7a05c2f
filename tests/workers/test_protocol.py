"""The control <-> worker codec without sockets: every message survives a round trip, frames split anywhere decode
the same, fds are handed to the frame that announced them, and broken input is a ChannelError naming what broke."""

from __future__ import annotations

import dataclasses
import os
import pickle
from datetime import timedelta
from pathlib import Path

import pytest

from ztunnel.config import WorkloadInfo, from_env
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.inpod.netns import NetnsId
from ztunnel.localconfig import load_local_config
from ztunnel.profiling import ProfileFailed
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import Endpoint
from ztunnel.state.workload import NamespacedHostname
from ztunnel.testing import TWO_NODE
from ztunnel.workers import protocol as p

IDENTITY = Identity("cluster.local", "default", "client")


def two_node_state() -> ProxyState:
    state = ProxyState("node-a")
    state.apply(load_local_config(TWO_NODE, "cluster.local").update)
    return state


def sample_messages() -> list[p.Message]:
    """One of each message type, with real content (a real config, state and certificate)."""
    cert = LocalCA.generate("cluster.local").issue(IDENTITY, timedelta(hours=1))
    data = p.CertificateData.of(cert)
    update = load_local_config(TWO_NODE, "cluster.local").update
    info = WorkloadInfo("client", "default", "client")
    return [
        p.Start(1, from_env({"PROXY_CONFIG": '{"concurrency": 3}'}), on_demand=True, load_board=True),
        p.snapshot_of(two_node_state()),
        p.Serve(),
        p.Delta(7, update),
        p.CertificatePush(IDENTITY, data),
        p.CertificatePush(IDENTITY, None),
        p.AddPod("uid-1", info, request_id=3),
        p.DelPod("uid-1", request_id=4),
        p.Drain(graceful=True, deadline=5.0),
        p.Query("metrics", request_id=5),
        p.Profile("cpu", seconds=2, frequency=100, request_id=16),
        p.Profile("heap-profiling", activate=True, request_id=17),
        p.SetLogLevel(False, "access=debug,info"),
        p.CertificateReply(6, IDENTITY, data),
        p.CertificateReply(6, IDENTITY, None, "no certificate for x: CA down", "CA down"),
        p.OnDemandDone(8),
        p.Ready(12),
        p.Failed("outbound 127.0.0.1:15001: address in use"),
        p.Resync(3, 5),
        p.CertificateRequest(IDENTITY, request_id=9),
        p.OnDemandRequest("/10.0.0.1", request_id=10),
        p.OnDemandRequest("istio-system/waypoint.istio-system.svc.cluster.local", request_id=16),
        p.HandOff(1, None, request_id=13),
        p.HandOff(0, ("Kubernetes//Pod/default/a", NetnsId(3, 4026532300)), request_id=14),
        p.HandIn(("Kubernetes//Pod/default/a", NetnsId(3, 4026532300)), 1, request_id=15),
        p.Ack(11),
        p.Ack(11, "failed to start proxy"),
        p.Reply(12, [{"worker": 1, "id": 3}]),
        p.Reply(16, {"worker-0;MainThread;ztunnel.proxy.relay:PlainConnection.buffer_updated": 3}),
        p.Reply(17, ProfileFailed("heap profiling not active")),
    ]


def all_message_types() -> set[type]:
    out: set[type] = set()
    todo: list[type] = [p.Message]
    while todo:
        cls = todo.pop()
        sub: type
        for sub in cls.__subclasses__():
            todo.append(sub)
            # dataclass(slots=True) replaces the class it decorates; the replaced one stays a subclass until the
            # garbage collector takes it, so only the classes the module exports count.
            if dataclasses.is_dataclass(sub) and getattr(p, sub.__name__, None) is sub:
                out.add(sub)
    return out


def test_every_message_type_round_trips() -> None:
    messages = sample_messages()
    assert {type(m) for m in messages} == all_message_types()  # a new message type needs a sample here
    stream = b"".join(p.encode(m) for m in messages)
    decoded = p.Decoder().feed(stream)
    assert [fds for _, fds in decoded] == [[]] * len(messages)
    for sent, (got, _) in zip(messages, decoded, strict=True):
        assert type(got) is type(sent) and got == sent, type(sent)
        if isinstance(got, p.CertificatePush) and got.data is not None:
            cert = got.data.certificate()  # the key and chain come back as a usable certificate
            assert cert.identity == IDENTITY and cert.key_pem() == got.data.key


def test_a_snapshot_rebuilds_the_same_state_with_staged_endpoints() -> None:
    state = two_node_state()
    # An endpoint for a service nobody has described yet is staged; it must survive the copy.
    key = NamespacedHostname("default", "later.default.svc.cluster.local")
    state.services.insert_endpoint(key, Endpoint("Kubernetes//Pod/default/x", {80: 8080}))
    ((msg, _),) = p.Decoder().feed(p.encode(p.snapshot_of(state)))
    assert isinstance(msg, p.Snapshot) and msg.generation == state.version
    copy = ProxyState("node-a")
    changes: list[object] = []
    copy.subscribe(changes.append)
    p.apply_snapshot(copy, msg)
    assert len(changes) == 1  # one batch
    assert {w.uid: w for w in copy.workloads} == {w.uid: w for w in state.workloads}
    assert {s.key: s for s in copy.services} == {s.key: s for s in state.services}
    assert [pol.key for pol in copy.policies] == [pol.key for pol in state.policies]
    assert copy.services.staged == state.services.staged and key in copy.services.staged


def test_a_snapshot_replaces_what_the_worker_had() -> None:
    stale = two_node_state()
    empty = ProxyState("node-a")
    p.apply_snapshot(stale, p.snapshot_of(empty))
    assert len(stale.workloads) == 0 and len(stale.services) == 0


def test_frames_split_anywhere_decode_the_same() -> None:
    messages = sample_messages()
    stream = b"".join(p.encode(m) for m in messages)
    for size in (1, 5, 6, 7, 1000):
        dec = p.Decoder()
        got = []
        for i in range(0, len(stream), size):
            got += [m for m, _ in dec.feed(stream[i : i + size])]
        assert len(got) == len(messages) and dec.pending == 0, size
        assert [type(m) for m in got] == [type(m) for m in messages]
    dec = p.Decoder()
    assert dec.feed(stream[:-1]) != [] and dec.pending > 0  # the last frame waits for its last byte


def test_fds_go_to_the_frame_that_announced_them(tmp_path: Path) -> None:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    try:
        first = p.encode(p.AddPod("a", WorkloadInfo("a", "ns", "sa"), request_id=1), fds=1)
        plain = p.encode(p.Ready(1))
        second = p.encode(p.AddPod("b", WorkloadInfo("b", "ns", "sa"), request_id=2), fds=1)
        dec = p.Decoder()
        # Both fds arrive with the first bytes (Linux may deliver them early, never late).
        out = dec.feed(first[:3], [r1, r2])
        assert out == []
        out = dec.feed(first[3:] + plain + second)
        assert [(type(m).__name__, fds) for m, fds in out] == [("AddPod", [r1]), ("Ready", []), ("AddPod", [r2])]
    finally:
        for fd in (r1, w1, r2, w2):
            os.close(fd)


def test_missing_fds_break_the_channel() -> None:
    frame = p.encode(p.AddPod("a", WorkloadInfo("a", "ns", "sa")), fds=1)
    with pytest.raises(p.ChannelError, match="announced 1 fds but 0 arrived"):
        p.Decoder().feed(frame)


def test_bad_input_is_a_channel_error() -> None:
    with pytest.raises(p.ChannelError, match="bad frame header"):
        p.Decoder().feed(p.HEADER.pack(p.MAX_FRAME + 1, 0))
    with pytest.raises(p.ChannelError, match="bad frame header"):
        p.Decoder().feed(p.HEADER.pack(1, p.MAX_FDS + 1))
    with pytest.raises(p.ChannelError, match="does not decode"):
        p.Decoder().feed(p.HEADER.pack(3, 0) + b"xyz")
    payload = pickle.dumps({"not": "a message"})
    with pytest.raises(p.ChannelError, match="not a channel message"):
        p.Decoder().feed(p.HEADER.pack(len(payload), 0) + payload)
    with pytest.raises(p.ChannelError, match="at most"):
        p.encode(p.Ready(1), fds=p.MAX_FDS + 1)


def test_closing_the_decoder_closes_fds_nobody_took() -> None:
    r, w = os.pipe()
    dec = p.Decoder()
    dec.feed(b"", [r])
    dec.close()
    with pytest.raises(OSError):
        os.fstat(r)
    os.close(w)


def test_request_ids_count_up() -> None:
    ids = p.RequestIds()
    assert [ids.next() for _ in range(3)] == [1, 2, 3]


def test_empty_update_round_trips() -> None:
    ((msg, _),) = p.Decoder().feed(p.encode(p.Delta(1, StateUpdate())))
    assert msg == p.Delta(1, StateUpdate())

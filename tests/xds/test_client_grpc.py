"""The delta ADS client against the local control plane over real gRPC and TLS on loopback.

Initial sync and readiness, pushes (add, update, remove) within 1 s, NACKs with the last good state kept, reconnect
with initial_resource_versions after a server restart, backoff, auth headers and TLS verification.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from xds.istio.workload import workload_pb2 as wl
from ztunnel.config import from_env
from ztunnel.identity.spiffe import Identity
from ztunnel.readiness import Readiness
from ztunnel.standins.istiod.server import XdsServer
from ztunnel.state import ProxyState
from ztunnel.state.workload import NamespacedHostname, NetworkAddress
from ztunnel.tasks import TaskGroup
from ztunnel.testing.control_plane import control_plane, wait_until, ztunnel_env
from ztunnel.xds.client import AdsClient, ConnectionTerminationReason, _FirstStatus, _is_reconnect
from ztunnel.xds.types import ADDRESS_TYPE
from ztunnel.xds.updater import AddressHandler, AuthorizationHandler

CONFIG = """
workloads:
- uid: c1//v1/Pod/ns/a
  name: a
  namespace: ns
  serviceAccount: a
  workloadIps: ["10.0.0.1"]
  protocol: HBONE
  services: {"ns/svc.ns.svc.cluster.local": {80: 8080}}
- uid: c1//v1/Pod/ns/b
  name: b
  namespace: ns
  workloadIps: ["10.0.0.2"]
services:
- name: svc
  namespace: ns
  hostname: svc.ns.svc.cluster.local
  vips: ["/10.96.0.1"]
  ports: {80: 8080}
policies:
- name: deny-9999
  namespace: ns
  scope: Namespace
  action: Deny
  rules: [[[{destinationPorts: [9999]}]]]
"""

CLIENT_ID = Identity("cluster.local", "ns", "a")


def addr(ip: str) -> NetworkAddress:
    return NetworkAddress("", ipaddress.ip_address(ip))


class Node:
    """One xDS client feeding a ProxyState, like a ztunnel's."""

    def __init__(self, env: dict[str, str]) -> None:
        self.config = from_env({"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "ns/a/a", **env})
        self.state = ProxyState()
        self.readiness = Readiness()
        self.client = AdsClient(
            self.config,
            [AddressHandler(self.state), AuthorizationHandler(self.state)],
            self.readiness.register("state manager"),
        )


@contextlib.asynccontextmanager
async def running(env: dict[str, str]) -> AsyncIterator[Node]:
    node = Node(env)
    tasks = TaskGroup("test")
    tasks.spawn(node.client.run(), "xds client")
    try:
        yield node
    finally:
        await tasks.cancel_all(timeout=2)


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[XdsServer]:
    async with control_plane(tmp_path, CONFIG) as server:
        yield server


@pytest.mark.both_loops
async def test_initial_sync_and_readiness(cp: XdsServer) -> None:
    async with running(ztunnel_env(cp, POD_NAME="zt", POD_NAMESPACE="istio-system")) as node:
        assert not node.readiness.ready
        await wait_until(lambda: node.readiness.ready, 5)
        assert {w.uid for w in node.state.workloads} == {"c1//v1/Pod/ns/a", "c1//v1/Pod/ns/b"}
        svc = node.state.services.get(NamespacedHostname("ns", "svc.ns.svc.cluster.local"))
        assert svc is not None and set(svc.endpoints) == {"c1//v1/Pod/ns/a"}
        assert node.state.policies.get("ns/deny-9999") is not None
        (session,) = cp.sessions
        assert session.node_id == "ztunnel~1.1.1.1~zt.istio-system~istio-system.svc.cluster.local"
        await wait_until(lambda: len(session.acks) == 2, 1)
        assert cp.nacks == []


async def test_add_update_remove_within_one_second(cp: XdsServer) -> None:
    async with running(ztunnel_env(cp)) as node:
        await wait_until(lambda: node.readiness.ready, 5)
        added = CONFIG.replace(
            "services:\n",
            '- uid: c1//v1/Pod/ns/c\n  name: c\n  namespace: ns\n  workloadIps: ["10.0.0.3"]\nservices:\n',
            1,
        )
        cp.set_config(added)
        took = await wait_until(lambda: node.state.workloads.find_address(addr("10.0.0.3")) is not None, 1)
        assert took < 1

        cp.set_config(added.replace("10.0.0.3", "10.0.0.4"))
        await wait_until(lambda: node.state.workloads.find_address(addr("10.0.0.4")) is not None, 1)
        assert node.state.workloads.find_address(addr("10.0.0.3")) is None

        # Remove a workload, the service and the policy in one push.
        cp.set_config("workloads: [{uid: c1//v1/Pod/ns/b, name: b, namespace: ns, workloadIps: ['10.0.0.2']}]")
        await wait_until(lambda: len(node.state.workloads) == 1 and len(node.state.policies) == 0, 1)
        assert len(node.state.services) == 0
        assert node.state.workloads.find_uid("c1//v1/Pod/ns/b") is not None


async def test_file_changes_are_pushed(tmp_path: Path) -> None:
    path = tmp_path / "mesh.yaml"
    path.write_text(CONFIG)
    async with control_plane(tmp_path, config_paths=(path,)) as server, running(ztunnel_env(server)) as node:
        await wait_until(lambda: node.readiness.ready, 5)
        path.write_text(CONFIG.replace("10.0.0.2", "10.0.0.22"))
        took = await wait_until(lambda: node.state.workloads.find_address(addr("10.0.0.22")) is not None, 1)
        assert took < 1
        # A broken file is reported and the last good config stays served.
        path.write_text(CONFIG.replace("10.0.0.2", "not-an-ip"))
        await wait_until(lambda: server.last_error is not None, 1)
        assert "workloadIps[0]: 'not-an-ip' is not an IP address" in (server.last_error or "")
        assert node.state.workloads.find_address(addr("10.0.0.22")) is not None


async def test_nack_names_the_resource_and_keeps_the_last_good_state(cp: XdsServer) -> None:
    async with running(ztunnel_env(cp)) as node:
        await wait_until(lambda: node.readiness.ready, 5)
        # A new resource with a 5-byte IP, and a bad update of an existing one: two pushes (each set is a config
        # version), each NACKed; waiting for the first NACK alone raced the second (failed once in CI).
        bad_new = wl.Address(
            workload=wl.Workload(uid="bad", name="bad", namespace="ns", addresses=[b"\x01\x02\x03\x04\x05"])
        )
        bad_update = wl.Address(
            workload=wl.Workload(uid="c1//v1/Pod/ns/b", name="b", namespace="ns", tunnel_protocol=wl.LEGACY_ISTIO_MTLS)
        )
        cp.set_raw_resource(ADDRESS_TYPE, "bad", bad_new)
        cp.set_raw_resource(ADDRESS_TYPE, "c1//v1/Pod/ns/b", bad_update)
        await wait_until(lambda: len(cp.nacks) >= 2, 1)
        messages = " ".join(n.message for n in cp.nacks)
        assert "bad: workload.addresses[0]: IP address must be 4 or 16 bytes, got 5" in messages
        assert "c1//v1/Pod/ns/b: workload.tunnel_protocol: unsupported tunnel protocol: legacy istio mtls" in messages
        b = node.state.workloads.find_uid("c1//v1/Pod/ns/b")
        assert b is not None and b.workload_ips == (ipaddress.ip_address("10.0.0.2"),)  # the last good version
        assert node.state.workloads.find_uid("bad") is None
        assert "bad" not in node.client.core.known_resources[ADDRESS_TYPE]
        # Undecodable bytes are NACKed too; the stream carries on and good pushes still apply.
        cp.set_raw_resource(ADDRESS_TYPE, "junk", b"\xff\xff")
        await wait_until(lambda: any(n.message.startswith("junk: decode") for n in cp.nacks), 1)
        cp.set_raw_resource(ADDRESS_TYPE, "c1//v1/Pod/ns/b", None)
        cp.set_config(CONFIG.replace("10.0.0.2", "10.0.0.5"))
        await wait_until(lambda: node.state.workloads.find_address(addr("10.0.0.5")) is not None, 1)


async def test_reconnect_after_restart_echoes_versions_and_keeps_state(cp: XdsServer) -> None:
    async with running(ztunnel_env(cp)) as node:
        await wait_until(lambda: node.readiness.ready, 5)
        held = dict(node.client.core.known_resources[ADDRESS_TYPE])
        assert len(held) == 3
        await cp.stop()
        await wait_until(lambda: node.client.terminations[ConnectionTerminationReason.RECONNECT] >= 1, 2)
        # During the outage the last state keeps being served, and readiness stays (as upstream).
        await asyncio.sleep(0.2)
        assert len(node.state.workloads) == 2 and node.readiness.ready
        assert node.client.terminations[ConnectionTerminationReason.CONNECTION_ERROR] >= 1
        # While down, the config changed: one workload gone, one moved.
        cp.set_config(CONFIG.replace("10.0.0.2", "10.0.0.9").replace("c1//v1/Pod/ns/a", "c1//v1/Pod/ns/a2"))
        t0 = time.monotonic()
        await cp.start()
        await wait_until(lambda: len(cp.sessions) == 2 and len(cp.sessions[1].acks) == 2, 5)
        reconnect = time.monotonic() - t0
        assert cp.sessions[1].initial_versions[ADDRESS_TYPE] == held
        await wait_until(lambda: node.state.workloads.find_address(addr("10.0.0.9")) is not None, 1)
        assert node.state.workloads.find_uid("c1//v1/Pod/ns/a") is None
        assert node.state.workloads.find_uid("c1//v1/Pod/ns/a2") is not None
        # Backoff after connection errors is at most a few hundred ms this early in the outage.
        assert reconnect < 2.0


async def test_a_demand_made_while_disconnected_is_subscribed_once_on_the_next_stream(cp: XdsServer) -> None:
    """As upstream: a name demanded while no stream is up is recorded with no version and listed in the next stream's
    initial_resource_versions, which subscribes it (istiod's deltaWatchedResources); it is not also sent as an
    explicit subscribe, a request that changes no subscription (istiod checks for those)."""
    env = ztunnel_env(cp, XDS_ON_DEMAND="true", ISTIO_META_DNS_CAPTURE="false")
    async with running(env) as node:
        await wait_until(lambda: node.readiness.ready, 5)
        await cp.stop()
        await wait_until(lambda: sum(node.client.terminations.values()) >= 1, 5)
        demand = asyncio.ensure_future(node.client.demand(ADDRESS_TYPE, "c1//v1/Pod/ns/b"))  # noqa: TID251
        await asyncio.sleep(0.05)
        assert not demand.done()
        await cp.start()
        await asyncio.wait_for(demand, 5)
        assert node.state.workloads.find_uid("c1//v1/Pod/ns/b") is not None
        session = cp.sessions[-1]
        assert session.initial_versions[ADDRESS_TYPE] == {"c1//v1/Pod/ns/b": ""}
        await asyncio.sleep(0.2)  # anything the client would still send after its initial requests
        assert session.unchanged_requests == []


@pytest.mark.parametrize(
    ("code", "details", "reconnect"),
    [
        # The wordings gRPC core gave when a control plane stopped under a healthy stream (seen in these tests).
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (sendmsg: Broken pipe (32))", True),
        (grpc.StatusCode.UNAVAILABLE, "Socket closed", True),
        (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls", True),
        (grpc.StatusCode.UNAVAILABLE, "received prior goaway: code: NO_ERROR", True),
        (grpc.StatusCode.UNKNOWN, "anything", True),
        (grpc.StatusCode.CANCELLED, None, True),
        # A server that answers with an error is not a transport going away: it backs off.
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", False),
        (grpc.StatusCode.PERMISSION_DENIED, "authentication failure", False),
        (grpc.StatusCode.INTERNAL, "stream removed", False),
        # A GOAWAY that pushes back (ENHANCE_YOUR_CALM) is an Error with backoff, as tonic's RESOURCE_EXHAUSTED.
        (grpc.StatusCode.UNAVAILABLE, "GOAWAY received; Error code: 11; Debug data: too_many_pings", False),
        (grpc.StatusCode.UNAVAILABLE, "GOAWAY received; Error code: 0; Debug data: max_age", True),
    ],
)
def test_transport_closed_is_a_reconnect(code: grpc.StatusCode, details: str | None, reconnect: bool) -> None:
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
    assert _is_reconnect(error) is reconnect


async def test_connection_errors_back_off_doubling() -> None:
    accepts: list[float] = []

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepts.append(time.monotonic())
        writer.close()

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        env = {"XDS_ADDRESS": f"https://127.0.0.1:{port}", "XDS_ROOT_CA": "SYSTEM"}
        async with running(env) as node:
            await wait_until(lambda: node.client.terminations[ConnectionTerminationReason.CONNECTION_ERROR] >= 6, 5)
            assert not node.readiness.ready
            assert node.client.terminations[ConnectionTerminationReason.RECONNECT] == 0
    finally:
        server.close()
    # One TCP connection per attempt; attempts spaced 20, 40, 80, 160, 320 ms apart (10 ms doubling).
    starts = [accepts[0]]
    for t in accepts[1:]:
        if t - starts[-1] > 0.01:  # gRPC may open a second socket within one attempt
            starts.append(t)
    gaps = [b - a for a, b in itertools.pairwise(starts)][:5]
    assert len(gaps) >= 4, accepts
    for i, gap in enumerate(gaps):
        expected = 0.02 * 2**i
        assert expected * 0.8 <= gap <= expected + 0.1, (i, gaps)


async def test_auth_headers_and_token_reread_per_call(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("old\n")
    async with control_plane(tmp_path, CONFIG, tokens={"new": CLIENT_ID}) as server:
        env = ztunnel_env(server, token=str(token_file), ISTIO_META_CLUSTER_ID="c9", XDS_HEADER_X_EXTRA="hello")
        async with running(env) as node:
            await wait_until(lambda: node.client.terminations[ConnectionTerminationReason.CONNECTION_ERROR] >= 1, 5)
            assert "status: Unauthenticated, message: " in (node.client.last_error or "")  # upstream's wording
            assert "authentication failure: unknown token" in (node.client.last_error or "")
            assert not node.readiness.ready
            token_file.write_text("new")  # rotated in place: the next attempt reads it
            await wait_until(lambda: node.readiness.ready, 5)
        md = server.stream_metadata
        assert md[0]["authorization"] == "Bearer old"
        assert md[-1]["authorization"] == "Bearer new"
        assert md[-1]["clusterid"] == "c9"
        assert md[-1]["x_extra"] == "hello"


async def test_refusal_status_survives_a_write_in_flight() -> None:
    """A server refusing the stream at its headers races the client's first requests; grpc aio then reports
    INTERNAL "Internal error from Core" for most calls (189/200 measured). The refusal must still be what is logged."""

    async def refuse(request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authentication failure: unknown token")

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(refuse)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Refuse", {"Stream": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    raced = 0
    try:
        for _ in range(40):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_stream("/t.Refuse/Stream")()
                first = _FirstStatus(call)

                async def write(call: Any = call) -> None:
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        for _ in range(20):
                            await call.write(b"x" * 1000)

                writer = TaskGroup("test").spawn(write(), "writer")
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await call.read()
                await writer
                raced += raised.value.code() == grpc.StatusCode.INTERNAL
                assert first.explain(raised.value) == (
                    grpc.StatusCode.UNAUTHENTICATED,
                    "authentication failure: unknown token",
                )
    finally:
        await server.stop(None)
    assert raced > 0, "the race did not happen: this test no longer covers what it is for"


@pytest.mark.parametrize(
    ("extra", "ok"),
    [
        ({"ALT_XDS_HOSTNAME": "istiod.istio-system.svc"}, True),
        ({"ALT_XDS_HOSTNAME": "wrong.example"}, False),
        ({"XDS_ROOT_CA": "SYSTEM"}, False),
    ],
)
async def test_tls_verification(cp: XdsServer, extra: dict[str, str], ok: bool) -> None:
    async with running({**ztunnel_env(cp), **extra}) as node:
        if ok:
            await wait_until(lambda: node.readiness.ready, 5)
        else:
            await wait_until(lambda: node.client.terminations[ConnectionTerminationReason.CONNECTION_ERROR] >= 1, 5)
            assert not node.readiness.ready
            assert cp.sessions == []


async def test_bad_root_file_is_an_error(cp: XdsServer, tmp_path: Path) -> None:
    """A root certificate that does not load is upstream's Error (its fetch_cert fails before any connection), not
    a ConnectionError."""
    async with running({**ztunnel_env(cp), "XDS_ROOT_CA": str(tmp_path / "missing.pem")}) as node:
        await wait_until(lambda: node.client.last_error is not None, 2)
        assert node.client.terminations[ConnectionTerminationReason.ERROR] >= 1
        assert node.client.terminations[ConnectionTerminationReason.CONNECTION_ERROR] == 0
        assert "XDS_ROOT_CA=" in (node.client.last_error or "") and "no such file and not inline PEM" in (
            node.client.last_error or ""
        )
    inline = cp.root_cert_path.read_text() if cp.root_cert_path else ""
    async with running({**ztunnel_env(cp), "XDS_ROOT_CA": inline}) as node:  # inline PEM works too
        await wait_until(lambda: node.readiness.ready, 5)


async def test_on_demand(cp: XdsServer) -> None:
    env = ztunnel_env(cp, XDS_ON_DEMAND="true", ISTIO_META_DNS_CAPTURE="false")
    async with running(env) as node:
        # Only Authorization blocks readiness; no Address resources arrive unasked.
        await wait_until(lambda: node.readiness.ready, 5)
        assert len(node.state.workloads) == 0 and len(node.state.policies) == 1
        await asyncio.wait_for(node.client.demand(ADDRESS_TYPE, "c1//v1/Pod/ns/b"), 2)
        assert node.state.workloads.find_uid("c1//v1/Pod/ns/b") is not None
        await asyncio.wait_for(node.client.demand(ADDRESS_TYPE, "missing"), 2)  # answered as removed
        assert len(node.state.workloads) == 1

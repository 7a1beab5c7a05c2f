"""The admin API on a running ztunnel: config_dump (schema, certificate rotation), logging, connections, quit."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from cryptography import x509

from ztunnel.config import from_env
from ztunnel.dns.forwarder import ResolvConf
from ztunnel.tasks import spawn
from ztunnel.testing import EchoServer, TwoNodeMesh, ZtunnelProcess, running_app, socks5_connect

SCHEMA = json.loads((Path(__file__).parent / "config_dump.schema.json").read_text())


def call(host: str, path: str, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(f"http://{host}:15000{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def acall(host: str, path: str, method: str = "GET") -> tuple[int, str]:
    return await asyncio.to_thread(call, host, path, method)


async def test_config_dump_schema_and_certificate_rotation(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    # A 62 s TTL: the local CA backdates by 60 s, so the half-life (the refresh point) comes after ~1 s.
    async with running_app(m.env_a(SECRET_TTL="62s")), running_app(m.env_b(SECRET_TTL="62s")):
        reader, writer = await m.socks5()
        writer.write(b"1")
        await reader.readexactly(1)
        status, body = await acall(m.node_a, "/config_dump")
        assert status == 200
        dump = json.loads(body)
        jsonschema.validate(dump, SCHEMA)
        assert {w["name"] for w in dump["workloads"]} == {"client", "server", "plain"}
        assert [s["hostname"] for s in dump["services"]] == ["echo.default.svc.cluster.local"]
        assert {p["name"] for p in dump["policies"]} == {"allow-client", "deny-9999"}
        # staticConfig is the local config as parsed, in upstream's shape: defaults filled in (status, capacity,
        # networkMode were not in the file), each workload's services mapped to their port maps.
        static = dump["staticConfig"]
        assert [w["name"] for w in static["workloads"]] == ["client", "server", "plain"]
        server = static["workloads"][1]
        assert server["services"] == {"default/echo.default.svc.cluster.local": {"80": 8080}}
        assert (server["status"], server["capacity"], server["networkMode"]) == ("Healthy", 1, "Standard")
        assert static["workloads"][0]["services"] == {}
        assert [s["hostname"] for s in static["services"]] == ["echo.default.svc.cluster.local"]
        assert [p["name"] for p in static["policies"]] == ["allow-client", "deny-9999"]
        # The effective config, as upstream names and shapes it.
        cfg = dump["config"]
        assert cfg["secretTtl"] == {"secs": 62, "nanos": 0}
        assert cfg["proxyMode"] == "Dedicated" and cfg["inboundAddr"] == f"{m.node_a}:15008"
        assert cfg["adminAddr"] == {"SocketAddr": f"{m.node_a}:15000"}
        assert cfg["proxyWorkloadInformation"] == {"name": "client", "namespace": "default", "serviceAccount": "client"}
        (cert,) = dump["certificates"]
        assert cert["identity"] == "spiffe://cluster.local/ns/default/sa/client"
        assert cert["state"] == "Available"
        assert b"BEGIN CERTIFICATE" in base64.b64decode(cert["certChain"][0]["pem"])
        first_serial = cert["certChain"][0]["serialNumber"]
        leaf = x509.load_pem_x509_certificate(base64.b64decode(cert["certChain"][0]["pem"]))
        assert first_serial == str(leaf.serial_number)  # decimal, as upstream's dump writes it
        await asyncio.sleep(1.5)
        # The established connection keeps working across the rotation; a new one uses the new certificate.
        writer.write(b"2")
        assert await reader.readexactly(1) == b"2"
        r2, w2 = await m.socks5()
        w2.write(b"3")
        assert await r2.readexactly(1) == b"3"
        w2.close()
        dump = json.loads((await acall(m.node_a, "/config_dump"))[1])
        jsonschema.validate(dump, SCHEMA)
        (cert,) = dump["certificates"]
        assert cert["certChain"][0]["serialNumber"] != first_serial
        writer.close()
    await echo.stop()


async def test_logging_endpoint(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_a()):
        assert (await acall(m.node_a, "/logging"))[0] == 405
        status, body = await acall(m.node_a, "/logging", "POST")
        assert status == 200 and body.startswith("current log level is")
        status, body = await acall(m.node_a, "/logging?level=ztunnel::proxy=debug", "POST")
        assert status == 200 and "ztunnel::proxy=debug" in body
        assert logging.getLogger("ztunnel.proxy").getEffectiveLevel() == logging.DEBUG
        status, body = await acall(m.node_a, "/logging?level=ztunnel::proxy=loud", "POST")
        assert status == 400 and "loud" in body
        status, body = await acall(m.node_a, "/logging?reset", "POST")
        assert status == 200 and "ztunnel::proxy=debug" not in body
        assert (await acall(m.node_a, "/nope"))[0] == 404


def folded_lines(body: str) -> list[tuple[list[str], int]]:
    """A folded-stack profile: (frames root first, samples) per line; comment lines (``#``) skipped."""
    out = []
    for line in body.splitlines():
        if line.startswith("#"):
            continue
        stack, _, count = line.rpartition(" ")
        out.append((stack.split(";"), int(count)))
    return out


async def test_profile_of_every_process_while_traffic_runs(tmp_path: Path) -> None:
    """/debug/pprof/profile of a ztunnel with two worker processes, while tunnels carry bytes through it: stacks of
    the control process and of both workers (asked over their channel), the workers' showing the data path; and
    the traffic went on throughout (every transfer complete and intact)."""
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    a = ZtunnelProcess(m.env_a(ZTUNNEL_WORKER_THREADS="2"), tmp_path / "a.log").start()
    stop = asyncio.Event()
    done = 0

    async def traffic() -> None:
        nonlocal done
        while not stop.is_set():
            reader, writer = await m.socks5()
            for _ in range(20):
                writer.write(b"z" * 65536)
                assert len(await asyncio.wait_for(reader.readexactly(65536), 10)) == 65536
            writer.close()
            done += 1

    try:
        async with running_app(m.env_b()):
            task = spawn(traffic(), "test traffic")
            while done < 1:
                await asyncio.sleep(0.05)
            status, body = await acall(m.node_a, "/debug/pprof/profile?seconds=2&frequency=200")
            during = done
            while done < during + 1:  # still flowing after the profile
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.wait_for(task, 30)
        # The heap of every process too: switched on in each, over the same channel.
        toggled = await acall(m.node_a, "/debug/pprof/heap/profiling?activate=true")
        heap = await acall(m.node_a, "/debug/pprof/heap")
        off = await acall(m.node_a, "/debug/pprof/heap/profiling?activate=false")
    finally:
        a.stop()
        await echo.stop()
    assert toggled == (200, "".join(f"{p}: heap profiling active: true\n" for p in ("control", "worker-0", "worker-1")))
    assert heap[0] == 200 and {
        line.split()[1].rstrip(":") for line in heap[1].splitlines() if line.startswith("#")
    } == {
        "control",
        "worker-0",
        "worker-1",
    }
    assert off[1].count("heap profiling active: false") == 3
    assert status == 200, body
    stacks = folded_lines(body)
    assert {s[0] for s, _ in stacks} == {"control", "worker-0", "worker-1"}
    # ~2 s at 200 Hz of each process's main thread: samples, not a handful.
    for process in ("control", "worker-0", "worker-1"):
        assert sum(n for s, n in stacks if s[0] == process and s[1] == "MainThread") > 100, process
    data_path = [s for s, _ in stacks if s[0].startswith("worker-") and any(f.startswith("ztunnel.proxy") for f in s)]
    assert data_path, "no sample of the workers' data path"


async def test_profile_parameters_are_bounded(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_a()):
        for query, why in (
            ("seconds=0", "invalid seconds value; expected 1-300"),
            ("seconds=301", "invalid seconds value; expected 1-300"),
            ("seconds=x", "invalid seconds value; expected 1-300"),
            ("seconds=1&frequency=1001", "invalid frequency value; expected 1-1000"),
        ):
            assert await acall(m.node_a, f"/debug/pprof/profile?{query}") == (400, why + "\n"), query
        # The inline data plane is this process: there is no worker to profile.
        status, _ = await acall(m.node_a, "/debug/pprof/profile?seconds=1&process=worker-0")
        assert status == 404
        status, body = await acall(m.node_a, "/debug/pprof/profile?seconds=1&frequency=50")
        assert status == 200 and {s[0] for s, _ in folded_lines(body)} == {"control"}


async def test_heap_snapshot_after_activation(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_a()):
        assert await acall(m.node_a, "/debug/pprof/heap") == (
            500,
            "heap profiling not active; activate with /debug/pprof/heap/profiling?activate=true\n",
        )
        assert await acall(m.node_a, "/debug/pprof/heap/profiling?activate=maybe") == (
            400,
            "invalid activate value 'maybe'; expected true or false\n",
        )
        try:
            assert await acall(m.node_a, "/debug/pprof/heap/profiling?activate=true") == (
                200,
                "control: heap profiling active: true\n",
            )
            kept = [bytearray(1000) for _ in range(2000)]  # 2 MB allocated here, while tracing
            status, body = await acall(m.node_a, "/debug/pprof/heap")
            assert status == 200
            here = [line for line in body.splitlines() if "test_admin.py" in line]
            assert here and int(here[0].split()[1]) >= 2_000_000, body[:2000]
            del kept
        finally:
            assert await acall(m.node_a, "/debug/pprof/heap/profiling?activate=false") == (
                200,
                "control: heap profiling active: false\n",
            )


async def test_connections_endpoint(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    echo = await EchoServer().start(*m.server_app)
    async with running_app(m.env_a()), running_app(m.env_b()):
        reader, writer = await m.socks5()
        writer.write(b"abc")
        await reader.readexactly(3)
        (conn,) = json.loads((await acall(m.node_a, "/connections"))[1])
        assert conn["direction"] == "outbound"
        assert conn["dstIdentity"] == "spiffe://cluster.local/ns/default/sa/server"
        assert conn["securityPolicy"] == "mutual_tls" and conn["bytesReceived"] == 3
        (inbound,) = json.loads((await acall(m.node_b, "/connections"))[1])
        assert inbound["direction"] == "inbound" and inbound["policyChecked"] is True
        assert inbound["srcIdentity"] == "spiffe://cluster.local/ns/default/sa/client"
        writer.close()
    await echo.stop()


async def test_quitquitquit_drains_and_stops(tmp_path: Path) -> None:
    m = TwoNodeMesh(tmp_path)
    async with running_app(m.env_a(CONNECTION_TERMINATION_DEADLINE="1s")) as app:
        a: Any = app
        running = asyncio.ensure_future(a.wait())  # noqa: TID251 - what `ztunnel proxy` does after start
        assert (await acall(m.node_a, "/quitquitquit"))[0] == 405
        assert not a.drain.draining
        # A tunnel stays open, so the drain takes its whole deadline (1 s); the POST is answered at once, as
        # upstream's (it only triggers the shutdown), and the drain carries on after the answer.
        echo = await EchoServer().start("127.0.0.1")
        reader, writer = await socks5_connect((m.node_a, 15080), *echo.address)
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"
        status, body = await acall(m.node_a, "/quitquitquit", "POST")
        assert (status, body) == (200, "shutdown now\n")
        assert a.drain.draining and not a.stopped.is_set()  # answered while the drain still holds the tunnel
        await asyncio.wait_for(running, 5)  # the drain ends at its deadline, then this admin server stops
        try:  # the tunnel was closed at the deadline (forced: a reset, or an end of file if it came first)
            rest = await asyncio.wait_for(reader.read(), 5)
        except ConnectionResetError:
            rest = b""
        assert rest == b""
        writer.close()
        await echo.stop()


async def test_config_dump_without_local_config(tmp_path: Path) -> None:
    # No local config (and no xDS): upstream shows an empty LocalConfig, not null.
    m = TwoNodeMesh(tmp_path)
    env = m.env_a()
    del env["LOCAL_XDS_PATH"]
    async with running_app(env):
        dump = json.loads((await acall(m.node_a, "/config_dump"))[1])
    jsonschema.validate(dump, SCHEMA)
    assert dump["staticConfig"] == {"workloads": [], "policies": [], "services": []}


def test_schema_rejects_a_broken_dump() -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"workloads": [{"uid": 1}]}, SCHEMA)


def _dump_with(workload_state: dict[str, Any]) -> dict[str, Any]:
    empty: dict[str, Any] = {"workloads": [], "services": [], "policies": [], "stagedServices": {}}
    static: dict[str, list[Any]] = {"workloads": [], "policies": [], "services": []}
    config = from_env({}).to_json(ResolvConf.load().to_json())
    return {**empty, "staticConfig": static, "version": {}, "config": config, "certificates": [], **workload_state}


INFO = {"name": "name", "namespace": "ns", "serviceAccount": "sa"}
UP: dict[str, Any] = {
    "state": "Up",
    "info": INFO,
    "connections": {
        "inbound": [{"src": "10.0.1.2:40000", "originalDst": None, "actualDst": "10.0.2.2:8080", "protocol": "TCP"}],
        "outbound": [
            {
                "src": "[fd00::2]:40001",
                "originalDst": "[fd00::9]:80",
                "actualDst": "[fd00::3]:15008",
                "protocol": "HBONE",
            }
        ],
    },
}


@pytest.mark.parametrize(
    "state",
    [
        {},
        # upstream inpod/admin.rs test_proxy_state, verbatim: a pending proxy has no connections yet
        json.loads('{"uid1":{"info":{"name":"name","namespace":"ns","serviceAccount":"sa"},"state":"Pending"}}'),
        {"uid1": UP},
    ],
)
def test_schema_accepts_upstreams_workload_state(state: dict[str, Any]) -> None:
    jsonschema.validate(_dump_with({"workloadState": state}), SCHEMA)


@pytest.mark.parametrize(
    "entry",
    [
        {**UP, "state": "Running"},
        {"state": "Pending", "info": INFO, "connections": {"inbound": [], "outbound": []}},
        {"state": "Up", "info": INFO},  # an Up proxy shows its connection manager
        {**UP, "info": {"name": "name", "namespace": "ns"}},
        {**UP, "connections": {"inbound": ["10.0.1.2:40000->10.0.2.2:8080"], "outbound": []}},
        {**UP, "connections": {"inbound": [], "outbound": [{**UP["connections"]["outbound"][0], "protocol": "h2"}]}},
    ],
)
def test_schema_rejects_a_malformed_workload_state(entry: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_dump_with({"workloadState": {"uid1": entry}}), SCHEMA)

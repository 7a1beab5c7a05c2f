"""The node agent (ztunnel/inpod/nodeagent.py): istio-cni's in-pod rule set, applied to and removed from real pod
namespaces with the redirection it causes, and the CNI side of ZDS against a hand-written ztunnel client.

The rule-text, codec and ZDS tests run anywhere (the "netns" files sent over ZDS are plain files then, which is
all the server cares about); the iptables and redirection tests need root and skip visibly otherwise.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from xds.istio.workload.zds import zds_pb2
from ztunnel.inpod import nodeagent
from ztunnel.inpod.nodeagent import (
    InpodRulesError,
    PodInfo,
    ZdsError,
    ZdsNotConnected,
    ZdsServer,
    apply_inpod_rules,
    build_inpod_rules,
    build_removal,
    remove_inpod_rules,
    render_restore,
)
from ztunnel.sockets import original_dst
from ztunnel.testing import netns
from ztunnel.testing.netns import Pod, Topology

# istio-cni's in-pod rules with DNS capture, as ztunnel-facts §8.3 lists them (istio:cni/pkg/iptables/testdata/
# default.golden), with the COMMIT that ends each table in iptables-restore input.
GOLDEN_DNS = """\
* mangle
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
* nat
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A OUTPUT -j ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A ISTIO_PRERT -s 169.254.7.127 -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -d 169.254.7.127 -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-port 15053
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
COMMIT
* raw
-N ISTIO_OUTPUT
-N ISTIO_PRERT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1
-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1
COMMIT
"""

# Without DNS capture: no redirects to 15053 and no raw table.
GOLDEN = "".join(line + "\n" for line in GOLDEN_DNS.split("* raw\n", maxsplit=1)[0].splitlines() if "15053" not in line)

# How iptables-save prints the applied v4 rules (it normalises addresses to /32 and adds the implicit -m tcp).
SAVED_V4 = {
    "mangle": [
        "-A PREROUTING -j ISTIO_PRERT",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
        "-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
    ],
    "nat": [
        "-A PREROUTING -j ISTIO_PRERT",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A ISTIO_OUTPUT -d 169.254.7.127/32 -p tcp -m tcp -j ACCEPT",
        "-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001",
        "-A ISTIO_PRERT -s 169.254.7.127/32 -p tcp -m tcp -j ACCEPT",
        "-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp -m tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006",
    ],
}
SAVED_V4_DNS = {
    "nat": [
        "-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-ports 15053",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053",
    ],
    "raw": [
        "-A PREROUTING -j ISTIO_PRERT",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1",
        "-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1",
    ],
}


# -- rule text -------------------------------------------------------------------------------------------------------


def test_rules_match_istio_cni_golden() -> None:
    assert render_restore(build_inpod_rules(dns_capture=True)) == GOLDEN_DNS
    assert render_restore(build_inpod_rules()) == GOLDEN


def test_ipv6_rules_differ_only_in_addresses() -> None:
    v6 = render_restore(build_inpod_rules(ipv6=True, dns_capture=True))
    expected = GOLDEN_DNS.replace("127.0.0.1/32", "::1/128").replace(
        "169.254.7.127", "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
    )
    assert v6 == expected


def test_rules_show_command_prints_the_rules() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ztunnel.inpod.nodeagent", "rules", "show", "--dns-capture"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == GOLDEN_DNS


SAVE_SAMPLE = """\
# Generated by iptables-save
*mangle
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
:OTHER - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A PREROUTING -j OTHER
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
COMMIT
*filter
:INPUT ACCEPT [0:0]
-A INPUT -p tcp -j ACCEPT
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:ISTIO_PRERT - [0:0]
COMMIT
"""


def test_removal_takes_out_only_our_jumps_and_chains() -> None:
    assert build_removal(SAVE_SAMPLE) == (
        "* mangle\n"
        "-D PREROUTING -j ISTIO_PRERT\n"
        "-D OUTPUT -j ISTIO_OUTPUT\n"
        "-F ISTIO_OUTPUT\n-F ISTIO_PRERT\n-X ISTIO_OUTPUT\n-X ISTIO_PRERT\n"
        "COMMIT\n"
        "* nat\n-F ISTIO_PRERT\n-X ISTIO_PRERT\nCOMMIT\n"  # a chain left without its jump (partial apply)
    )
    assert build_removal("*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n") == ""
    assert build_removal("") == ""


# -- pods ------------------------------------------------------------------------------------------------------------


def test_pod_spec_parsing() -> None:
    assert PodInfo.parse("u1:default/client/sleep:/run/netns/x") == PodInfo(
        "u1", "default", "client", "sleep", "/run/netns/x"
    )
    assert PodInfo.parse("u1:ns/name:podns").service_account == "default"
    assert PodInfo.parse("u1:ns/name:podns").netns_path == Path("/run/netns/podns")
    for bad in ("u1", "u1:ns/name", "u1:ns:x", ":ns/n:x", "u1:a/b/c/d:x", "u1:ns//sa:x"):
        with pytest.raises(ValueError, match="pod"):
            PodInfo.parse(bad)


# -- ZDS server against a hand-written ztunnel -----------------------------------------------------------------------


class Ztunnel:
    """The ztunnel end of ZDS, by hand: a blocking SOCK_SEQPACKET client driven from worker threads."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(5)
        self.sock.connect(str(path))

    async def send(self, data: bytes) -> None:
        await asyncio.to_thread(self.sock.send, data)

    async def hello(self) -> None:
        await self.send(zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString())

    async def recv(self) -> tuple[zds_pb2.WorkloadRequest, list[int]]:
        data, fds, flags, _ = await asyncio.to_thread(socket.recv_fds, self.sock, 1024, 4)
        assert data, "the node agent closed the connection"
        assert not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)
        return zds_pb2.WorkloadRequest.FromString(data), fds

    async def ack(self, error: str = "") -> None:
        await self.send(zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=error)).SerializeToString())

    async def expect(self, kind: str, uid: str = "", error: str = "") -> list[int]:
        """Receive one request of ``kind`` for ``uid``, ack it (NACK with ``error``); the inodes of its fds."""
        req, fds = await self.recv()
        inodes = [_ino(fd) for fd in fds]
        assert req.WhichOneof("payload") == kind, req
        if kind != "snapshot_sent":
            assert getattr(req, kind).uid == uid
        assert len(fds) == (1 if kind == "add" else 0)
        await self.ack(error)
        return inodes

    async def eof(self) -> bool:
        data = await asyncio.to_thread(self.sock.recv, 1024)
        return data == b""

    def close(self) -> None:
        self.sock.close()


def _ino(fd: int) -> int:
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


@pytest.fixture
def netns_files(tmp_path: Path) -> dict[str, Path]:
    """Stand-ins for pod namespaces: the server opens and sends whatever file the pod names."""
    files = {}
    for name in ("a", "b", "c"):
        files[name] = tmp_path / f"netns-{name}"
        files[name].write_text(name)
    return files


@pytest.fixture
def clients() -> Iterator[list[Ztunnel]]:
    made: list[Ztunnel] = []
    yield made
    for c in made:
        c.close()


def _pod(uid: str, netns_file: Path | str) -> PodInfo:
    return PodInfo(uid=uid, namespace="default", name=f"pod-{uid}", service_account=f"sa-{uid}", netns=str(netns_file))


@pytest.mark.both_loops
async def test_snapshot_adds_with_netns_fds_keep_for_missing_then_snapshot_sent(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    pods = [_pod("a", netns_files["a"]), _pod("b", netns_files["b"]), _pod("gone", tmp_path / "no-such-netns")]
    async with ZdsServer(tmp_path / "zds.sock", pods) as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        req, fds = await zt.recv()
        assert req.WhichOneof("payload") == "add"
        assert (req.add.uid, req.add.workload_info.name, req.add.workload_info.namespace) == ("a", "pod-a", "default")
        assert req.add.workload_info.service_account == "sa-a"
        assert len(fds) == 1 and _ino(fds[0]) == netns_files["a"].stat().st_ino
        assert server.snapshots == 0  # waits for each ack before going on
        await zt.ack()
        assert await zt.expect("add", "b") == [netns_files["b"].stat().st_ino]
        await zt.expect("keep", "gone")
        await zt.expect("snapshot_sent")
        await server.wait_snapshot(1, timeout=5)
        assert server.connected == 1
        kinds = [(e.kind, e.uid, e.error) for e in server.history]
        assert kinds == [("add", "a", ""), ("add", "b", ""), ("keep", "gone", ""), ("snapshot_sent", "", "")]


@pytest.mark.both_loops
async def test_add_and_del_after_snapshot_return_ack_or_nack(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock", ack_timeout=2) as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        await zt.expect("snapshot_sent")
        await server.wait_snapshot()

        error, inodes = await asyncio.gather(server.add_pod(_pod("c", netns_files["c"])), zt.expect("add", "c"))
        assert error == "" and inodes == [netns_files["c"].stat().st_ino]
        assert "c" in server.pods

        error, _ = await asyncio.gather(
            server.add_pod(_pod("a", netns_files["a"])), zt.expect("add", "a", error="failed to start proxy")
        )
        assert error == "failed to start proxy"  # a NACK goes back to the caller; the connection stays
        assert server.connected == 1

        error, _ = await asyncio.gather(server.del_pod("c"), zt.expect("del", "c"))
        assert error == "" and "c" not in server.pods
        error, _ = await asyncio.gather(server.del_pod("a"), zt.expect("del", "a", error="unknown uid"))
        assert error == "unknown uid"
        assert [(e.kind, e.uid, e.error) for e in server.history[1:]] == [
            ("add", "c", ""),
            ("add", "a", "failed to start proxy"),
            ("del", "c", ""),
            ("del", "a", "unknown uid"),
        ]


async def test_without_ztunnel_add_is_recorded_for_the_next_snapshot(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock") as server:
        with pytest.raises(ZdsNotConnected, match="no ztunnel is connected"):
            await server.add_pod(_pod("a", netns_files["a"]))
        assert await server.del_pod("nothing") == ""  # deletes need no connection
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        await zt.expect("add", "a")
        await zt.expect("snapshot_sent")
        await server.wait_snapshot()


@pytest.mark.both_loops
async def test_adds_go_to_the_newest_connection_and_deletes_to_all(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock", [_pod("a", netns_files["a"])]) as server:
        old, new = Ztunnel(server.path), Ztunnel(server.path)
        clients += [old, new]
        for zt in (old, new):
            await zt.hello()
            await zt.expect("add", "a")
            await zt.expect("snapshot_sent")
        await server.wait_snapshot(2)
        assert server.connected == 2
        error, _ = await asyncio.gather(server.add_pod(_pod("b", netns_files["b"])), new.expect("add", "b"))
        assert error == ""
        results = await asyncio.gather(server.del_pod("a"), old.expect("del", "a"), new.expect("del", "a", "x"))
        assert results[0] == "x"
        # The old connection got no add: the next thing it sees is the delete it already answered; nothing pending.
        assert [e.connection for e in server.history if e.kind == "add" and e.uid == "b"] == [2]


@pytest.mark.both_loops
async def test_missing_ack_closes_the_connection(
    tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock", ack_timeout=0.3) as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        await zt.expect("snapshot_sent")
        await server.wait_snapshot()
        add = server.add_pod(_pod("a", netns_files["a"]))
        error, received = await asyncio.gather(add, zt.recv(), return_exceptions=True)
        assert not isinstance(received, BaseException)
        for fd in received[1]:
            os.close(fd)
        assert isinstance(error, ZdsError) and "within 0.3 s" in str(error)
        assert await zt.eof()
        await server.wait_disconnected(2)
        with pytest.raises(ZdsNotConnected):
            await server.add_pod(_pod("b", netns_files["b"]))


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(b"\x08\x00", id="version-0"),
        pytest.param(b"\xff\xff\xff", id="garbage"),
        pytest.param(None, id="silence"),
    ],
)
async def test_bad_or_missing_hello_closes_the_connection(
    tmp_path: Path, first: bytes | None, clients: list[Ztunnel]
) -> None:
    async with ZdsServer(tmp_path / "zds.sock", ack_timeout=0.3) as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        if first is not None:
            await zt.send(first)
        assert await zt.eof()
        await server.wait_disconnected(2)
        assert server.snapshots == 0


async def test_unsolicited_message_and_non_ack_close_the_connection(tmp_path: Path, clients: list[Ztunnel]) -> None:
    async with ZdsServer(tmp_path / "zds.sock") as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        await zt.recv()
        await zt.send(b"\x12\x00")  # a WorkloadResponse with no ack in it (an unknown field only)
        assert await zt.eof()
        zt2 = Ztunnel(server.path)
        clients.append(zt2)
        await zt2.hello()
        await zt2.expect("snapshot_sent")
        await server.wait_snapshot()
        await zt2.ack()  # nobody asked
        assert await zt2.eof()
        await server.wait_disconnected(2)


async def test_fds_sent_by_ztunnel_are_closed(tmp_path: Path, clients: list[Ztunnel]) -> None:
    async with ZdsServer(tmp_path / "zds.sock") as server:
        zt = Ztunnel(server.path)
        clients.append(zt)
        r, w = os.pipe()
        try:
            await asyncio.to_thread(
                zt.sock.sendmsg,
                [zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString()],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))],
            )
            await zt.expect("snapshot_sent")
            os.close(r)
            # The server's copy was closed: with no reader left, writing fails.
            with pytest.raises(BrokenPipeError):
                os.write(w, b"x")
        finally:
            os.close(w)


async def test_stop_closes_connections_and_removes_the_socket(tmp_path: Path, clients: list[Ztunnel]) -> None:
    server = await ZdsServer(tmp_path / "sub" / "zds.sock").start()
    zt = Ztunnel(server.path)
    clients.append(zt)
    await zt.hello()
    await zt.expect("snapshot_sent")
    await server.wait_snapshot()
    await server.stop()
    assert await zt.eof()
    assert not server.path.exists()
    # A restarted agent binds the same path again, over a stale socket file if one was left.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
        stale.bind(str(server.path))
    async with ZdsServer(server.path) as again:
        zt2 = Ztunnel(again.path)
        clients.append(zt2)
        await zt2.hello()
        await zt2.expect("snapshot_sent")


async def test_serve_command(tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]) -> None:
    path = tmp_path / "zds.sock"
    p = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "ztunnel.inpod.nodeagent", "serve", "--socket", str(path)],
        *["--pod", f"u1:default/client/sleep:{netns_files['a']}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdin is not None and p.stdout is not None

    async def command(line: str) -> None:
        assert p.stdin is not None
        p.stdin.write(line.encode() + b"\n")
        await p.stdin.drain()

    async def answer() -> str:
        assert p.stdout is not None
        return (await asyncio.wait_for(p.stdout.readline(), 10)).decode().strip()

    try:
        assert await answer() == f"listening {path}"
        zt = Ztunnel(path)
        clients.append(zt)
        await zt.hello()
        assert await zt.expect("add", "u1") == [netns_files["a"].stat().st_ino]
        await zt.expect("snapshot_sent")

        await command(f"add u2:other/server/srv:{netns_files['b']}")
        await zt.expect("add", "u2")
        assert await answer() == "ok"
        await command("del u1")
        await zt.expect("del", "u1", error="no such workload")
        assert await answer() == "nack no such workload"
        await command("frobnicate")
        assert (await answer()).startswith("error unknown command")
    finally:
        p.terminate()
        _, err = await asyncio.wait_for(p.communicate(), 10)
    assert p.returncode == 0, err
    assert await zt.eof()


def test_serve_command_rejects_bad_pod_spec(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "ztunnel.inpod.nodeagent", "serve", "--socket", str(tmp_path / "s"), "--pod", "x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 2 and "UID:NAMESPACE/NAME/SERVICE_ACCOUNT:NETNS" in p.stderr


# -- root: real namespaces -------------------------------------------------------------------------------------------


@pytest.fixture
def topo() -> Iterator[Topology]:
    with netns.topology(iptables=True) as t:
        yield t


def _saved(pod: Pod, binary: str = "iptables-save") -> dict[str, list[str]]:
    tables: dict[str, list[str]] = {}
    table = ""
    for line in pod.exec([binary]).stdout.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(("-A", ":ISTIO")):
            tables.setdefault(table, []).append(line)
    return tables


def _routing(pod: Pod, family: str = "-4") -> tuple[str, str]:
    rules = pod.exec(["ip", family, "rule", "show", "pref", "32764"]).stdout.strip()
    routes = pod.exec(["ip", family, "route", "show", "table", "100"], check=False).stdout.strip()
    return rules, routes


@pytest.mark.root
@pytest.mark.parametrize("dns_capture", [False, True], ids=["plain", "dns-capture"])
def test_apply_then_remove(topo: Topology, dns_capture: bool) -> None:
    pod = topo.pod("node1", "a")
    apply_inpod_rules(pod.name, dns_capture=dns_capture)
    apply_inpod_rules(pod.path, dns_capture=dns_capture)  # again, by path: still exactly one copy
    saved = _saved(pod)
    for table in ("mangle", "nat", "raw"):
        expected = SAVED_V4.get(table, []) + (SAVED_V4_DNS.get(table, []) if dns_capture else [])
        assert sorted(line for line in saved.get(table, []) if line.startswith("-A")) == sorted(expected), table
    assert _routing(pod) == ("32764:\tfrom all fwmark 0x111/0xfff lookup 100", "local default dev lo scope host")
    if nodeagent._ipv6_usable(True):
        v6 = _saved(pod, "ip6tables-save")
        assert (
            "-A ISTIO_OUTPUT ! -d ::1/128 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001" in v6["nat"]
        )
        rules, routes = _routing(pod, "-6")
        assert "fwmark 0x111/0xfff lookup 100" in rules and routes.startswith("local default dev lo")

    remove_inpod_rules(pod.name)
    assert _saved(pod) == {}
    assert _saved(pod, "ip6tables-save") == {}
    assert _routing(pod) == ("", "")
    assert _routing(pod, "-6") == ("", "")
    remove_inpod_rules(pod.name)  # nothing left to remove: no error


@pytest.mark.root
def test_errors_name_the_command_and_namespace(topo: Topology) -> None:
    with pytest.raises(InpodRulesError, match="network namespace /run/netns/ztt-nope does not exist"):
        apply_inpod_rules("ztt-nope")
    pod = topo.pod("node1", "a")
    apply_inpod_rules(pod.name)
    # Someone else's chain jumps into ours: our chain cannot be deleted, and the error says where and why.
    pod.exec(["iptables", "-t", "nat", "-N", "USER"])
    pod.exec(["iptables", "-t", "nat", "-A", "USER", "-j", "ISTIO_OUTPUT"])
    with pytest.raises(InpodRulesError) as e:
        remove_inpod_rules(pod.name)
    assert f"`iptables-restore --noflush --wait 10` failed in netns {pod.path} (exit " in str(e.value)
    assert "-X ISTIO_OUTPUT" in str(e.value)  # the input is shown
    pod.exec(["iptables", "-t", "nat", "-F", "USER"])
    remove_inpod_rules(pod.name)
    assert _saved(pod) == {}  # ours are gone; USER (not ours) stays


@pytest.mark.root
def test_failed_apply_is_rolled_back(topo: Topology) -> None:
    if not nodeagent._ipv6_usable(True):
        pytest.skip("needs IPv6 and ip6tables-restore")
    pod = topo.pod("node1", "a")
    pod.exec(["ip", "link", "set", "lo", "down"])  # the v6 local route needs lo up; v4 goes in first
    with pytest.raises(InpodRulesError) as e:
        apply_inpod_rules(pod.name)
    assert f"`ip -6 route add local ::/0 dev lo table 100` failed in netns {pod.path}" in str(e.value)
    assert "(is the pod's lo interface up?)" in str(e.value)
    assert _saved(pod) == {} and _saved(pod, "ip6tables-save") == {}
    assert _routing(pod) == ("", "") and _routing(pod, "-6") == ("", "")


class Listener:
    """A plain TCP listener in a namespace, standing in for one of ztunnel's ports: it records where each accepted
    connection was originally headed (SO_ORIGINAL_DST) and answers with its own name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.accepted: asyncio.Queue[tuple[str, int] | None] = asyncio.Queue()
        self.server: asyncio.Server | None = None

    async def start(self, ns: netns.Netns, port: int) -> Listener:
        self.server = await ns.start_server(self._handle, "0.0.0.0", port)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dst = original_dst(writer.get_extra_info("socket"))
        self.accepted.put_nowait(None if dst is None else (str(dst[0]), dst[1]))
        writer.write(self.name.encode())
        await writer.drain()
        writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def _hit(src: netns.Netns, host: str, port: int, mark: int | None = None) -> bytes:
    reader, writer = await src.open_connection(host, port, mark=mark)
    try:
        return await asyncio.wait_for(reader.read(100), 5)
    finally:
        writer.close()


@pytest.mark.root
async def test_redirection_to_ztunnel_ports(topo: Topology) -> None:
    client = topo.pod("node1", "client")
    server = topo.pod("node2", "server")
    apply_inpod_rules(client.name, dns_capture=True)
    outbound, inbound_plain, inbound = Listener("15001"), Listener("15006"), Listener("15008")
    app = Listener("server-app")
    listeners = [
        await outbound.start(client, 15001),
        await inbound_plain.start(client, 15006),
        await inbound.start(client, 15008),
        await app.start(server, 8080),
    ]
    dns = client.new_socket(socket.AF_INET, socket.SOCK_DGRAM)
    query = client.new_socket(socket.AF_INET, socket.SOCK_DGRAM)
    loop = asyncio.get_running_loop()
    try:
        # Outbound from the pod: redirected to 15001, which learns the original destination.
        assert await _hit(client, server.ip, 8080) == b"15001"
        assert await outbound.accepted.get() == (server.ip, 8080)
        # ztunnel's own traffic (SO_MARK 1337) goes where it was sent.
        assert await _hit(client, server.ip, 8080, mark=1337) == b"server-app"
        # Inbound to the pod: redirected to 15006, except HBONE on 15008, which arrives as is.
        assert await _hit(server, client.ip, 9000) == b"15006"
        assert await inbound_plain.accepted.get() == (client.ip, 9000)
        assert await _hit(server, client.ip, 15008) == b"15008"
        # DNS capture: UDP to any :53 lands on 15053 in the pod.
        dns.bind(("0.0.0.0", 15053))
        query.sendto(b"q", (server.ip, 53))  # a datagram never blocks here
        assert await asyncio.wait_for(loop.sock_recv(dns, 100), 5) == b"q"
        # Loopback inside the pod is never redirected.
        assert await _hit(client, "127.0.0.1", 15006) == b"15006"
        assert await inbound_plain.accepted.get() == ("127.0.0.1", 15006)
        # Nothing else was redirected (every accepted connection was accounted for above).
        assert outbound.accepted.empty() and inbound_plain.accepted.empty()
    finally:
        dns.close()
        query.close()
        for listener in listeners:
            listener.close()


@pytest.mark.root
async def test_zds_sends_real_netns_fds(topo: Topology, tmp_path: Path, clients: list[Ztunnel]) -> None:
    pod = topo.pod("node1", "a")
    async with ZdsServer(tmp_path / "zds.sock", [_pod("a", pod.name)], apply_rules=True, ipv6=False) as server:
        assert _routing(pod)[0]  # --apply-rules applied them before announcing the pod
        zt = Ztunnel(server.path)
        clients.append(zt)
        await zt.hello()
        req, (fd,) = await zt.recv()
        try:
            assert req.add.uid == "a" and os.fstat(fd).st_ino == pod.inode
            ns_get_nstype = 0xB703  # <linux/nsfs.h>: what ztunnel checks the fd with
            assert fcntl.ioctl(fd, ns_get_nstype) == netns.CLONE_NEWNET
        finally:
            os.close(fd)
        await zt.ack()
        await zt.expect("snapshot_sent")
        error, _ = await asyncio.gather(server.del_pod("a"), zt.expect("del", "a"))
        assert error == ""
        assert _routing(pod)[0] == ""  # and removed them after the delete

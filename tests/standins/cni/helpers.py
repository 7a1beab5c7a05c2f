"""Shared by the node agent's tests: istio-cni's golden rule text, a hand-written ztunnel end of ZDS (independent of
the codec under test), and readers of a pod's rules and policy routing."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from xds.istio.workload.zds import zds_pb2
from ztunnel.standins.cni.server import PodInfo
from ztunnel.testing.netns import Pod

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
        inodes = [ino(fd) for fd in fds]
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


def ino(fd: int) -> int:
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def pod_info(uid: str, netns_file: Path | str) -> PodInfo:
    return PodInfo(uid=uid, namespace="default", name=f"pod-{uid}", service_account=f"sa-{uid}", netns=str(netns_file))


def saved_rules(pod: Pod, binary: str = "iptables-save") -> dict[str, list[str]]:
    tables: dict[str, list[str]] = {}
    table = ""
    for line in pod.exec([binary]).stdout.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(("-A", ":ISTIO")):
            tables.setdefault(table, []).append(line)
    return tables


def routing(pod: Pod, family: str = "-4") -> tuple[str, str]:
    rules = pod.exec(["ip", family, "rule", "show", "pref", "32764"]).stdout.strip()
    routes = pod.exec(["ip", family, "route", "show", "table", "100"], check=False).stdout.strip()
    return rules, routes

"""The node agent: istio-cni's part of in-pod mode, for tests, the demo and clusters without istio-cni.

istio-cni does two things for ztunnel on each node, and so does this module:

1. **Redirection.** It applies the in-pod rule set to every captured pod's network namespace
   (``istio:cni/pkg/iptables/iptables.go::AppendInpodRules``): nat REDIRECTs of the pod's outbound TCP to 15001
   and inbound TCP to 15006 (15008 excepted), optional DNS capture to 15053, all skipping packets that carry
   ztunnel's mark 0x539; and, for replies to connections ztunnel opened with a spoofed source, a connmark 0x111
   plus ``ip rule fwmark 0x111/0xfff lookup 100`` with a local default route in table 100.
   :func:`build_inpod_rules` is the pure rule builder; :func:`apply_inpod_rules` / :func:`remove_inpod_rules`
   run ``iptables-restore --noflush`` (and ``ip6tables-restore``) and ``ip rule``/``ip route`` inside the pod's
   namespace through ``nsenter``.

2. **ZDS.** It is the *server* of the ZDS protocol (``proto/zds.proto``): ztunnel connects to a SOCK_SEQPACKET
   unix socket, says ``ZdsHello{V1}``, gets a snapshot (one ``add`` per known pod, carrying the pod's netns fd in
   ``SCM_RIGHTS``, or ``keep`` when the netns is gone), then ``SnapshotSent``; afterwards ``add``/``del`` as pods
   come and go. Every message waits for ztunnel's ``WorkloadResponse{ack}`` (5 s, as the CNI); a non-empty
   ``ack.error`` is a NACK. As the CNI, adds go to the newest connection and deletes to all of them, so during a
   rolling restart the old ztunnel still hears about deleted pods. :class:`ZdsServer` is that server.

Run it as a command::

    python -m ztunnel.inpod.nodeagent serve --socket /var/run/ztunnel/ztunnel.sock \\
        --pod 1234:default/client/sleep:/run/netns/client --apply-rules
    python -m ztunnel.inpod.nodeagent rules apply --netns client
    python -m ztunnel.inpod.nodeagent rules show --dns-capture
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ztunnel.config import WorkloadInfo
from ztunnel.inpod.protocol import (
    ZdsMessageError,
    decode_ack,
    decode_hello,
    encode_add,
    encode_del,
    encode_keep,
    encode_snapshot_sent,
)
from ztunnel.tasks import TaskGroup

log = logging.getLogger("ztunnel.inpod.nodeagent")

# istio-cni's constants (cni/pkg/config/config.go).
INPOD_MARK = 0x539  # 1337: ztunnel's SO_MARK; its own packets are never redirected
INPOD_MASK = 0xFFF
INPOD_TPROXY_MARK = 0x111  # connmark of connections ztunnel accepted, restored on their replies
INPOD_TPROXY_MASK = 0xFFF
INPOD_RESTORE_MASK = 0xFFFFFFFF
ROUTE_TABLE_INBOUND = 100
RULE_PRIORITY = 32764
OUTBOUND_PORT = 15001
INBOUND_PLAINTEXT_PORT = 15006
INBOUND_PORT = 15008
DNS_PORT = 15053
# Kubelet probes are SNATed to this address on the node, so the pod rules can let them in unredirected.
PROBE_SNAT_V4 = "169.254.7.127"
PROBE_SNAT_V6 = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"

DEFAULT_SOCKET = "/var/run/ztunnel/ztunnel.sock"  # ztunnel's INPOD_UDS default
ACK_TIMEOUT = 5.0  # the CNI's read/write deadline per message
# ztunnel reads into a 1024-byte buffer; its acks are a few bytes. A larger read buffer lets us see (and reject)
# a message that would have been truncated, instead of mis-parsing it.
_RECV_BUFFER = 4096
_NETNS_DIR = Path("/run/netns")

_CHAINS = ("ISTIO_PRERT", "ISTIO_OUTPUT")
_BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})


# --------------------------------------------------------------------------------------------------------------
# Redirection rules
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``-A <chain> <params>`` line of a table."""

    table: str
    chain: str
    params: str

    def __str__(self) -> str:
        return f"-A {self.chain} {self.params}"


def build_inpod_rules(*, ipv6: bool = False, dns_capture: bool = False) -> list[Rule]:
    """The in-pod rule set, in istio-cni's order (``AppendInpodRules``): mangle, nat, then raw (DNS capture only).

    The v6 variant differs only in its addresses: ``::1/128`` for localhost and the v6 probe SNAT address.
    """
    localhost = "::1/128" if ipv6 else "127.0.0.1/32"
    probe = PROBE_SNAT_V6 if ipv6 else PROBE_SNAT_V4
    mark = f"{INPOD_MARK:#x}/{INPOD_MASK:#x}"
    tproxy = f"{INPOD_TPROXY_MARK:#x}/{INPOD_TPROXY_MASK:#x}"
    restore = f"{INPOD_RESTORE_MASK:#x}"
    rules = [
        # mangle: ztunnel's marked packets arriving (its spoofed-source connections' replies) tag the connection;
        # the tag is restored on the way out so the fwmark rule routes replies back into ztunnel.
        Rule("mangle", "PREROUTING", "-j ISTIO_PRERT"),
        Rule("mangle", "OUTPUT", "-j ISTIO_OUTPUT"),
        Rule("mangle", "ISTIO_PRERT", f"-m mark --mark {mark} -j CONNMARK --set-xmark {tproxy}"),
        Rule(
            "mangle",
            "ISTIO_OUTPUT",
            f"-m connmark --mark {tproxy} -j CONNMARK --restore-mark --nfmask {restore} --ctmask {restore}",
        ),
        Rule("nat", "OUTPUT", "-j ISTIO_OUTPUT"),
        Rule("nat", "PREROUTING", "-j ISTIO_PRERT"),
        Rule("nat", "ISTIO_PRERT", f"-s {probe} -p tcp -m tcp -j ACCEPT"),
        Rule("nat", "ISTIO_OUTPUT", f"-d {probe} -p tcp -m tcp -j ACCEPT"),
        Rule(
            "nat",
            "ISTIO_PRERT",
            f"! -d {localhost} -p tcp ! --dport {INBOUND_PORT} -m mark ! --mark {mark} "
            f"-j REDIRECT --to-ports {INBOUND_PLAINTEXT_PORT}",
        ),
    ]
    if dns_capture:
        rules += [
            Rule(
                "nat",
                "ISTIO_OUTPUT",
                f"! -o lo -p udp -m mark ! --mark {mark} -m udp --dport 53 -j REDIRECT --to-port {DNS_PORT}",
            ),
            Rule(
                "nat",
                "ISTIO_OUTPUT",
                f"! -d {localhost} -p tcp --dport 53 -m mark ! --mark {mark} -j REDIRECT --to-ports {DNS_PORT}",
            ),
        ]
    rules += [
        Rule("nat", "ISTIO_OUTPUT", f"-p tcp -m mark --mark {tproxy} -j ACCEPT"),
        Rule("nat", "ISTIO_OUTPUT", f"! -d {localhost} -o lo -j ACCEPT"),
        Rule(
            "nat",
            "ISTIO_OUTPUT",
            f"! -d {localhost} -p tcp -m mark ! --mark {mark} -j REDIRECT --to-ports {OUTBOUND_PORT}",
        ),
    ]
    if dns_capture:
        # Separate conntrack zones for the pod's DNS and ztunnel's upstream DNS, so the two flows (same 5-tuple
        # after the REDIRECT) cannot clash.
        rules += [
            Rule("raw", "PREROUTING", "-j ISTIO_PRERT"),
            Rule("raw", "OUTPUT", "-j ISTIO_OUTPUT"),
            Rule("raw", "ISTIO_OUTPUT", f"-p udp -m mark --mark {mark} -m udp --dport 53 -j CT --zone 1"),
            Rule("raw", "ISTIO_PRERT", f"-p udp -m mark ! --mark {mark} -m udp --sport 53 -j CT --zone 1"),
        ]
    return rules


def render_restore(rules: Sequence[Rule]) -> str:
    """``iptables-restore`` input for ``rules``: per table, ``-N`` for each non-builtin chain in order of first use
    (istio's ``buildRestore``), the ``-A`` lines, ``COMMIT``. Tables appear in order of first use."""
    tables: dict[str, list[str]] = {}
    created: dict[str, list[str]] = {}
    for r in rules:
        tables.setdefault(r.table, [])
        chains = created.setdefault(r.table, [])
        if r.chain not in _BUILTIN_CHAINS and r.chain not in chains:
            chains.append(r.chain)
        tables[r.table].append(str(r))
    out: list[str] = []
    for table, lines in tables.items():
        out.append(f"* {table}")
        out += [f"-N {c}" for c in created[table]]
        out += lines
        out.append("COMMIT")
    return "\n".join(out) + "\n"


def build_removal(saved: str) -> str:
    """``iptables-restore --noflush`` input that removes what :func:`build_inpod_rules` added, given the pod's
    current ``iptables-save`` output: the jumps into our chains, then the chains themselves. Only what exists is
    removed, so a partly applied (or absent) rule set is cleaned up without errors. Empty when nothing is there."""
    out: list[str] = []
    table = ""
    chains: list[str] = []
    jumps: list[str] = []

    def flush() -> None:
        if table and (chains or jumps):
            out.append(f"* {table}")
            out.extend(jumps)
            out.extend(f"-F {c}" for c in chains)
            out.extend(f"-X {c}" for c in chains)
            out.append("COMMIT")

    for line in saved.splitlines():
        if line.startswith("*"):
            table, chains, jumps = line[1:].strip(), [], []
        elif line.startswith("COMMIT"):
            flush()
            table = ""
        elif line.startswith(":"):
            name = line[1:].split()[0]
            if name in _CHAINS:
                chains.append(name)
        elif line.startswith("-A "):
            parts = line.split()
            if parts[1] in _BUILTIN_CHAINS and parts[-2:-1] == ["-j"] and parts[-1] in _CHAINS:
                jumps.append("-D" + line[2:])
    return "\n".join(out) + "\n" if out else ""


class InpodRulesError(RuntimeError):
    """A command applying or removing the in-pod rules failed; the message names the command, netns and stderr."""


def netns_path(netns: str | os.PathLike[str]) -> Path:
    """A netns name (``ip netns`` style, under /run/netns) or a path (``/proc/<pid>/ns/net``, a bind mount)."""
    s = os.fspath(netns)
    return Path(s) if "/" in s else _NETNS_DIR / s


def _run_in_netns(path: Path, argv: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        raise InpodRulesError("nsenter (util-linux) is not installed; it runs the rule commands inside the pod netns")
    if shutil.which(argv[0]) is None:
        raise InpodRulesError(f"{argv[0]} is not installed (apt-get install iptables iproute2)")
    try:
        return subprocess.run(
            [nsenter, f"--net={path}", "--", *argv],
            check=False,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired as e:
        raise InpodRulesError(f"`{' '.join(argv)}` in netns {path} did not finish within 30 s") from e


def _check(path: Path, argv: Sequence[str], stdin: str | None = None, hint: str = "") -> str:
    p = _run_in_netns(path, argv, stdin)
    if p.returncode != 0:
        detail = (p.stderr or p.stdout).strip()
        raise InpodRulesError(
            f"`{' '.join(argv)}` failed in netns {path} (exit {p.returncode}): {detail}{hint}"
            + (f"\ninput was:\n{stdin}" if stdin else "")
        )
    return p.stdout


def _ipv6_usable(ipv6: bool) -> bool:
    return ipv6 and shutil.which("ip6tables-restore") is not None and os.path.exists("/proc/net/if_inet6")


def _families(ipv6: bool) -> list[tuple[str, str, str]]:
    """(ip family flag, iptables binary prefix, local default route) per address family in use."""
    fams = [("-4", "iptables", "0.0.0.0/0")]
    if _ipv6_usable(ipv6):
        fams.append(("-6", "ip6tables", "::/0"))
    return fams


def _require_netns(path: Path) -> None:
    if not path.exists():
        raise InpodRulesError(f"network namespace {path} does not exist")


def apply_inpod_rules(netns: str | os.PathLike[str], dns_capture: bool = False, ipv6: bool = True) -> None:
    """Apply the in-pod rule set and policy routing to a pod's network namespace (name or path).

    Idempotent: rules already there (from an earlier apply) are removed first, so the result is exactly one copy.
    IPv6 rules are applied too when ``ipv6`` and the host has IPv6 and ``ip6tables-restore``. On failure whatever
    was applied is removed again and :class:`InpodRulesError` says which command failed, where, and why.
    """
    path = netns_path(netns)
    _require_netns(path)
    remove_inpod_rules(path, ipv6=ipv6)
    try:
        for fam, binary, default in _families(ipv6):
            text = render_restore(build_inpod_rules(ipv6=fam == "-6", dns_capture=dns_capture))
            _check(path, [f"{binary}-restore", "--noflush", "--wait", "10"], text)
            _check(path, ["ip", fam, "rule", "add", *_rule_selector()])
            _check(
                path,
                ["ip", fam, "route", "add", "local", default, "dev", "lo", "table", str(ROUTE_TABLE_INBOUND)],
                hint=" (is the pod's lo interface up?)",
            )
    except InpodRulesError:
        with contextlib.suppress(InpodRulesError):
            remove_inpod_rules(path, ipv6=ipv6)
        raise


def _rule_selector() -> list[str]:
    return [
        "fwmark",
        f"{INPOD_TPROXY_MARK:#x}/{INPOD_TPROXY_MASK:#x}",
        "pref",
        str(RULE_PRIORITY),
        "lookup",
        str(ROUTE_TABLE_INBOUND),
    ]


def remove_inpod_rules(netns: str | os.PathLike[str], ipv6: bool = True) -> None:
    """Remove exactly what :func:`apply_inpod_rules` added (chains, jumps, the fwmark rule, the table-100 route);
    anything already gone is skipped. Other rules in the namespace are left alone."""
    path = netns_path(netns)
    _require_netns(path)
    for fam, binary, default in _families(ipv6):
        text = build_removal(_check(path, [f"{binary}-save"]))
        if text:
            _check(path, [f"{binary}-restore", "--noflush", "--wait", "10"], text)
        rules = _check(path, ["ip", fam, "rule", "show", "pref", str(RULE_PRIORITY)])
        if f"fwmark {INPOD_TPROXY_MARK:#x}/{INPOD_TPROXY_MASK:#x} lookup {ROUTE_TABLE_INBOUND}" in rules:
            _check(path, ["ip", fam, "rule", "del", *_rule_selector()])
        table = ["table", str(ROUTE_TABLE_INBOUND)]
        shown = _run_in_netns(path, ["ip", fam, "route", "show", *table])
        if shown.returncode != 0 and "does not exist" not in shown.stderr:  # no table 100 at all is fine
            raise InpodRulesError(f"`ip {fam} route show table 100` failed in netns {path}: {shown.stderr.strip()}")
        routes = shown.stdout if shown.returncode == 0 else ""
        if any(line.startswith("local default dev lo") for line in routes.splitlines()):
            _check(path, ["ip", fam, "route", "del", "local", default, "dev", "lo", *table])


# --------------------------------------------------------------------------------------------------------------
# Pods, and the errors of the ZDS server (the messages themselves: ztunnel.inpod.protocol)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodInfo:
    """A pod as the node agent knows it: ZDS identity plus its network namespace (name or path)."""

    uid: str
    namespace: str
    name: str
    service_account: str = "default"
    netns: str = ""

    @property
    def netns_path(self) -> Path:
        return netns_path(self.netns)

    @property
    def workload_info(self) -> WorkloadInfo:
        return WorkloadInfo(name=self.name, namespace=self.namespace, service_account=self.service_account)

    @classmethod
    def parse(cls, spec: str) -> PodInfo:
        """``UID:NAMESPACE/NAME[/SERVICE_ACCOUNT]:NETNS`` (NETNS is a name under /run/netns or a path)."""
        parts = spec.split(":", 2)
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"pod {spec!r}: expected UID:NAMESPACE/NAME/SERVICE_ACCOUNT:NETNS")
        uid, ident, netns = parts
        names = ident.split("/")
        if len(names) not in (2, 3) or not all(names):
            raise ValueError(f"pod {spec!r}: expected NAMESPACE/NAME or NAMESPACE/NAME/SERVICE_ACCOUNT, got {ident!r}")
        sa = names[2] if len(names) == 3 else "default"
        return cls(uid=uid, namespace=names[0], name=names[1], service_account=sa, netns=netns)


class ZdsError(RuntimeError):
    """The ztunnel connection failed: no ack in time, a malformed message, or the connection closed."""


class ZdsNotConnected(ZdsError):
    """No ztunnel is connected. The pod is still recorded and goes out in the next connection's snapshot."""


def _check_hello(data: bytes) -> None:
    try:
        decode_hello(data)
    except ZdsMessageError as e:
        raise ZdsError(str(e)) from None


def _ack_error(data: bytes) -> str:
    try:
        return decode_ack(data)
    except ZdsMessageError as e:
        raise ZdsError(str(e)) from None


# --------------------------------------------------------------------------------------------------------------
# ZDS server (the CNI side)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request and its answer, kept in :attr:`ZdsServer.history` for tests and the demo."""

    connection: int
    kind: str  # "add", "keep", "del", "snapshot_sent"
    uid: str
    error: str  # ack.error: "" for an ack


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Connection:
    """One ztunnel connection. A reader callback delivers each packet to the one outstanding request (hello or
    ack); any other packet, or EOF, closes the connection, as the CNI's keepalive read does."""

    def __init__(self, sock: socket.socket, ident: int, on_closed: Callable[[_Connection], None]) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.id = ident
        self.loop = asyncio.get_running_loop()
        # One message in flight at a time; API requests also wait for `synced` (the snapshot acked, or closed).
        self.lock = asyncio.Lock()
        self.synced = asyncio.Event()
        self.closed = False
        self.close_reason = ""
        self._on_closed = on_closed
        self._writable: asyncio.Future[None] | None = None
        # The hello may arrive before the handshake task runs, so the first "request" is armed right away.
        self._pending: asyncio.Future[bytes] | None = self.loop.create_future()
        self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            data, ancdata, flags, _ = self.sock.recvmsg(_RECV_BUFFER, socket.CMSG_SPACE(16 * 4))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.close(f"read failed: {e}")
            return
        for level, kind, payload in ancdata:  # ztunnel never sends fds; never leak them
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                for fd in fds:
                    os.close(fd)
        if not data:
            self.close("ztunnel closed the connection")
        elif flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            self.close("truncated message from ztunnel")
        elif self._pending is None or self._pending.done():
            self.close(f"unsolicited message from ztunnel ({len(data)} bytes)")
        else:
            self._pending.set_result(data)

    async def _send(self, data: bytes, fds: Sequence[int]) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while True:
            if self.closed:
                raise ZdsError(f"connection {self.id} closed: {self.close_reason}")
            try:
                self.sock.sendmsg([data], anc)
                return
            except (BlockingIOError, InterruptedError):
                self._writable = writable = self.loop.create_future()
                self.loop.add_writer(self.fd, _resolve, writable)
                try:
                    await writable
                finally:
                    self._writable = None
                    if not self.closed:
                        self.loop.remove_writer(self.fd)

    async def receive(self, timeout: float) -> bytes:
        """The next packet (the armed one first)."""
        if self.closed:
            raise ZdsError(f"connection {self.id} closed: {self.close_reason}")
        if self._pending is None:
            self._pending = self.loop.create_future()
        try:
            return await asyncio.wait_for(self._pending, timeout)
        except TimeoutError:
            self.close(f"no message from ztunnel within {timeout:g} s")
            raise ZdsError(f"connection {self.id}: no message from ztunnel within {timeout:g} s") from None
        finally:
            self._pending = None

    async def request(self, data: bytes, fds: Sequence[int], timeout: float) -> str:
        """Send one request and wait for its ack; returns ack.error. The caller holds :attr:`lock`."""
        if self.closed:
            raise ZdsError(f"connection {self.id} closed: {self.close_reason}")
        self._pending = self.loop.create_future()
        try:
            await asyncio.wait_for(self._send(data, fds), timeout)
        except (OSError, TimeoutError) as e:
            reason = f"send failed: {e or 'timed out'}"
            self.close(reason)
            raise ZdsError(f"connection {self.id}: {reason}") from e
        try:
            return _ack_error(await self.receive(timeout))
        except ZdsError as e:
            self.close(str(e))
            raise

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        log.info("ztunnel connection %d closed: %s", self.id, reason)
        self.loop.remove_reader(self.fd)
        if self._writable is not None:
            self.loop.remove_writer(self.fd)
            _resolve(self._writable)  # _send sees `closed`
        self.sock.close()
        if self._pending is not None and not self._pending.done():
            self._pending.set_exception(ZdsError(f"connection {self.id} closed: {reason}"))
            self._pending.exception()  # marked retrieved: nobody may be waiting
        self.synced.set()  # wake API callers; they find the connection closed
        self._on_closed(self)


@dataclass
class _Counters:
    connections: int = 0
    snapshots: int = 0
    history: list[Exchange] = field(default_factory=list)


class ZdsServer:
    """The CNI side of ZDS on a SOCK_SEQPACKET unix socket at ``path``.

    ``pods`` are known from the start and go out in every connection's snapshot; :meth:`add_pod` and
    :meth:`del_pod` change the set and tell the connected ztunnel(s). With ``apply_rules`` the in-pod rules are
    applied to a pod's netns before ztunnel hears of it (at :meth:`start` for the initial pods) and removed after
    its delete, as istio-cni does.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        pods: Iterable[PodInfo] = (),
        *,
        ack_timeout: float = ACK_TIMEOUT,
        apply_rules: bool = False,
        dns_capture: bool = False,
        ipv6: bool = True,
    ) -> None:
        self.path = Path(path)
        self.pods: dict[str, PodInfo] = {p.uid: p for p in pods}
        self.ack_timeout = ack_timeout
        self.apply_rules = apply_rules
        self.dns_capture = dns_capture
        self.ipv6 = ipv6
        self._listener: socket.socket | None = None
        self._conns: list[_Connection] = []  # oldest first
        self._counters = _Counters()
        self._changed: asyncio.Event | None = None  # set and replaced on every state change
        self._tasks = TaskGroup("nodeagent")

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> ZdsServer:
        if self.apply_rules:
            for pod in self.pods.values():
                if pod.netns_path.exists():  # a gone pod is announced with `keep`; nothing to redirect
                    await asyncio.to_thread(apply_inpod_rules, pod.netns_path, self.dns_capture, self.ipv6)
        self._changed = asyncio.Event()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a stale socket from an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(str(self.path))
            sock.listen(16)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)
        log.info("ZDS server listening on %s with %d pod(s)", self.path, len(self.pods))
        return self

    async def stop(self) -> None:
        """Stop listening and close every connection (ztunnel sees EOF and reconnects with backoff)."""
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        for conn in list(self._conns):
            conn.close("node agent stopped")
        await self._tasks.cancel_all(timeout=5)

    async def __aenter__(self) -> ZdsServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- state for callers ----------------------------------------------------------------------------------------

    @property
    def connected(self) -> int:
        """Live ztunnel connections (including ones still receiving their snapshot)."""
        return len(self._conns)

    @property
    def snapshots(self) -> int:
        """Snapshots completed (SnapshotSent acked) since start, over all connections."""
        return self._counters.snapshots

    @property
    def history(self) -> list[Exchange]:
        return self._counters.history

    async def wait_snapshot(self, count: int = 1, timeout: float = 10.0) -> None:
        """Wait until ``count`` snapshots have completed since start (i.e. the count-th ztunnel is in sync)."""
        await self._wait(lambda: self._counters.snapshots >= count, timeout)

    async def wait_disconnected(self, timeout: float = 10.0) -> None:
        """Wait until no ztunnel is connected."""
        await self._wait(lambda: not self._conns, timeout)

    async def _wait(self, pred: Callable[[], bool], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not pred():
                assert self._changed is not None, "start() first"
                await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # -- API --------------------------------------------------------------------------------------------------------

    async def add_pod(self, pod: PodInfo) -> str:
        """Record ``pod`` and announce it to the newest ztunnel; returns "" on ack, else the NACK reason.

        Raises :class:`ZdsNotConnected` when no ztunnel is connected (the pod still goes out in the next snapshot),
        :class:`ZdsError` when the connection fails or the netns cannot be opened, :class:`InpodRulesError` when
        ``apply_rules`` is set and the rules cannot be applied.
        """
        if self.apply_rules:
            await asyncio.to_thread(apply_inpod_rules, pod.netns_path, self.dns_capture, self.ipv6)
        self.pods[pod.uid] = pod
        if not self._conns:
            raise ZdsNotConnected(f"pod {pod.uid} recorded, but no ztunnel is connected to {self.path}")
        conn = self._conns[-1]
        await conn.synced.wait()
        async with conn.lock:
            try:
                fd = os.open(pod.netns_path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise ZdsError(f"pod {pod.uid}: cannot open netns {pod.netns_path}: {e}") from e
            try:
                return await self._exchange(conn, "add", pod.uid, encode_add(pod.uid, pod.workload_info), [fd])
            finally:
                os.close(fd)

    async def del_pod(self, uid: str) -> str:
        """Forget the pod and tell every connected ztunnel; returns "" when all acked (or none is connected), else
        the NACK reasons joined by "; ". Raises :class:`ZdsError` if a connection failed."""
        pod = self.pods.pop(uid, None)

        async def one(conn: _Connection) -> str:
            await conn.synced.wait()
            async with conn.lock:
                return await self._exchange(conn, "del", uid, encode_del(uid), [])

        results = await asyncio.gather(*(one(c) for c in list(self._conns)), return_exceptions=True)
        if self.apply_rules and pod is not None and pod.netns_path.exists():
            await asyncio.to_thread(remove_inpod_rules, pod.netns_path, self.ipv6)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise ZdsError("; ".join(str(f) for f in failures))
        return "; ".join(r for r in results if isinstance(r, str) and r)

    # -- connections ---------------------------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.warning("accept on %s failed: %s", self.path, e)
            return
        sock.setblocking(False)
        self._counters.connections += 1
        conn = _Connection(sock, self._counters.connections, self._closed)
        self._conns.append(conn)
        log.info("ztunnel connection %d accepted", conn.id)
        self._notify()
        self._tasks.spawn(self._handshake(conn), f"conn-{conn.id}")

    def _closed(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self._conns.remove(conn)
        self._notify()

    async def _handshake(self, conn: _Connection) -> None:
        # API requests wait for `conn.synced`, so until the snapshot is acked only this task talks to ztunnel.
        try:
            _check_hello(await conn.receive(self.ack_timeout))
            snapshot = list(self.pods.values())
            for pod in snapshot:
                try:
                    fd = os.open(pod.netns_path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as e:
                    log.info("pod %s: netns %s unavailable (%s); sending keep", pod.uid, pod.netns_path, e)
                    await self._exchange(conn, "keep", pod.uid, encode_keep(pod.uid), [])
                    continue
                try:
                    await self._exchange(conn, "add", pod.uid, encode_add(pod.uid, pod.workload_info), [fd])
                finally:
                    os.close(fd)
            await self._exchange(conn, "snapshot_sent", "", encode_snapshot_sent(), [])
            self._counters.snapshots += 1
            log.info("ztunnel connection %d: snapshot of %d pod(s) acked", conn.id, len(snapshot))
            self._notify()
        except ZdsError as e:
            conn.close(str(e))
        finally:
            conn.synced.set()

    async def _exchange(self, conn: _Connection, kind: str, uid: str, data: bytes, fds: Sequence[int]) -> str:
        error = await conn.request(data, fds, self.ack_timeout)
        self._counters.history.append(Exchange(conn.id, kind, uid, error))
        if error:
            log.warning("ztunnel connection %d NACKed %s %s: %s", conn.id, kind, uid, error)
        return error


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ztunnel.inpod.nodeagent",
        description="A stand-in for istio-cni's node agent: in-pod redirection rules and the ZDS server ztunnel "
        "connects to in in-pod mode.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve ZDS to ztunnel",
        description="Listen for ztunnel on a SOCK_SEQPACKET unix socket and announce pods to it. While running, "
        "lines on stdin change the pod set: `add UID:NAMESPACE/NAME/SA:NETNS` and `del UID`; each is answered "
        "on stdout with `ok`, `nack REASON` or `error REASON`.",
    )
    serve.add_argument("--socket", default=DEFAULT_SOCKET, help=f"socket path (ztunnel's INPOD_UDS; {DEFAULT_SOCKET})")
    serve.add_argument(
        "--pod",
        action="append",
        default=[],
        metavar="UID:NAMESPACE/NAME/SA:NETNS",
        help="a pod in the snapshot (repeatable); NETNS is a name under /run/netns or a path",
    )
    serve.add_argument("--apply-rules", action="store_true", help="apply the in-pod rules to each pod's netns")
    serve.add_argument("--dns-capture", action="store_true", help="with --apply-rules: redirect DNS to 15053")
    serve.add_argument("--no-ipv6", action="store_true", help="with --apply-rules: IPv4 rules only")
    serve.add_argument("--ack-timeout", type=float, default=ACK_TIMEOUT, help="seconds to wait for each ack")

    rules = sub.add_parser("rules", help="apply, remove or print the in-pod iptables rules")
    rules.add_argument("action", choices=["apply", "remove", "show"])
    rules.add_argument("--netns", help="the pod's netns: a name under /run/netns or a path (apply/remove)")
    rules.add_argument("--dns-capture", action="store_true", help="include the DNS capture rules (apply/show)")
    rules.add_argument("--no-ipv6", action="store_true", help="IPv4 only (apply/remove)")
    rules.add_argument("--ipv6", action="store_true", help="show the IPv6 variant (show)")
    return p


def _out(line: str) -> None:
    print(line, flush=True)


async def _serve(args: argparse.Namespace, pods: list[PodInfo]) -> int:
    server = ZdsServer(
        args.socket,
        pods,
        ack_timeout=args.ack_timeout,
        apply_rules=args.apply_rules,
        dns_capture=args.dns_capture,
        ipv6=not args.no_ipv6,
    )
    await server.start()
    _out(f"listening {server.path}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    commands: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:  # a daemon thread: a blocked read never holds up exit
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line)
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, name="nodeagent-stdin", daemon=True).start()
    tasks = TaskGroup("nodeagent-cli")
    tasks.spawn(_control(server, commands), "stdin")
    try:
        await stop.wait()
    finally:
        await tasks.cancel_all(timeout=1)
        await server.stop()
    return 0


async def _control(server: ZdsServer, commands: asyncio.Queue[str | None]) -> None:
    while (line := await commands.get()) is not None:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "add" and len(words) == 2:
                error = await server.add_pod(PodInfo.parse(words[1]))
            elif words[0] == "del" and len(words) == 2:
                error = await server.del_pod(words[1])
            else:
                _out(f"error unknown command {line.strip()!r} (use `add UID:NS/NAME/SA:NETNS` or `del UID`)")
                continue
        except (ZdsError, InpodRulesError, ValueError) as e:
            _out(f"error {e}")
            continue
        _out(f"nack {error}" if error else "ok")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "rules":
        if args.action == "show":
            sys.stdout.write(render_restore(build_inpod_rules(ipv6=args.ipv6, dns_capture=args.dns_capture)))
            return 0
        if not args.netns:
            parser.error(f"rules {args.action} needs --netns")
        try:
            if args.action == "apply":
                apply_inpod_rules(args.netns, dns_capture=args.dns_capture, ipv6=not args.no_ipv6)
            else:
                remove_inpod_rules(args.netns, ipv6=not args.no_ipv6)
        except InpodRulesError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        pods = [PodInfo.parse(s) for s in args.pod]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvloop

    try:
        return uvloop.run(_serve(args, pods))
    except (InpodRulesError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

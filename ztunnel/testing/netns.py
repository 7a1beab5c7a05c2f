"""Network-namespace topologies for root-only tests: nodes on a bridge, pods on veths (upstream's
``test_helpers/netns.rs``, ``setup_netns_test!``).

Everything lives in namespaces this module creates, so the host's own network is never touched::

    root netns  <prefix>            br0 172.172.0.1/16 (+ a route to each node's pod /24)
      veth<n> ── eth0 in node netns <prefix>-<node>     172.172.0.<n>/16, forwards for its pods
                   veth<k> ── eth0 in pod netns <prefix>-<node>-<pod>   10.0.<n>.<k>/32, default via 10.0.<n>.1

Nodes are numbered from 2 (172.172.0.1 is the bridge), pods per node from 2 (10.0.<n>.1 is the node's side of
every pod veth, as in CNI's ptp plugin). Each node has a route to every other node's pod /24 via that node, so pods
reach each other across nodes through the node namespaces. IPv4 only.

Namespace names start with ``ztt-<pid>-<random>``: tests in parallel never collide, and namespaces left behind by
a killed test process are reaped by the next :class:`Topology` (its pid is gone). :meth:`Topology.close` deletes
every namespace it made, which takes their veths and the bridge with them; use it as a context manager.

Code runs "inside" a namespace in three ways: a subprocess (:meth:`Netns.exec`, :meth:`Netns.popen`), a socket
created there and used from anywhere (:meth:`Netns.new_socket`, :meth:`Netns.open_connection`,
:meth:`Netns.start_server` — a socket keeps the namespace it was created in), or an event loop on a thread that
entered the namespace (:meth:`Netns.loop_thread`), for code that creates its own sockets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ztunnel.errors import ZtunnelError

T = TypeVar("T")

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
SO_MARK = 36
BRIDGE_IP = "172.172.0.1"
PREFIX = "ztt"
_NAME = re.compile(r"^[A-Za-z0-9_.]+$")  # "-" separates the parts of a namespace name
_MAX_NODES = 250
_MAX_PODS_PER_NODE = 250

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.setns.restype = ctypes.c_int


class NetnsSetupError(ZtunnelError, RuntimeError):
    """A command building or tearing down the topology failed (the message has the command and its stderr)."""


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET) failed: {os.strerror(err)}")


@contextlib.contextmanager
def entered(path: str | os.PathLike[str]) -> Iterator[None]:
    """Switch the *calling thread* into the netns at ``path`` and back. Only for threads of your own: other
    threads (the event loop's) are unaffected, and nothing else must run on this thread meanwhile."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def run_in_netns(path: str | os.PathLike[str], fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)`` on a fresh thread inside the netns at ``path``; returns its result or raises its error."""
    box: list[Any] = []

    def target() -> None:
        try:
            with entered(path):
                box.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller
            box.append((False, e))

    t = threading.Thread(target=target, name=f"netns:{Path(path).name}", daemon=True)
    t.start()
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _run(argv: Sequence[str], input: str | None = None) -> str:
    p = subprocess.run(list(argv), input=input, capture_output=True, text=True, check=False, timeout=30)
    if p.returncode != 0:
        raise NetnsSetupError(f"`{' '.join(argv)}` failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p.stdout


def _netns_add(name: str) -> None:
    _run(["ip", "netns", "add", name])


def _netns_del(name: str) -> bool:
    """Delete a named netns; False if it was not there."""
    if not (NETNS_DIR / name).exists():
        return False
    _run(["ip", "netns", "del", name])
    return True


_probe_result: str | None = None
_probe_done = False


def skip_reason(*, iptables: bool = False) -> str | None:
    """Why namespaced tests cannot run here, or None. Checks root, ``ip`` (and the iptables tools), and that a
    namespace can really be created (containers without CAP_SYS_ADMIN cannot)."""
    global _probe_result, _probe_done
    if os.geteuid() != 0:
        return "needs root (network namespaces, veths, iptables)"
    for tool in ("ip", "nsenter") + (("iptables", "iptables-save", "iptables-restore") if iptables else ()):
        if shutil.which(tool) is None:
            pkg = "util-linux" if tool == "nsenter" else "iproute2" if tool == "ip" else "iptables"
            return f"{tool} is not installed (apt-get install -y {pkg})"
    if not _probe_done:
        _probe_done = True
        name = f"{PREFIX}-{os.getpid()}-probe{secrets.token_hex(3)}"
        try:
            _netns_add(name)
            _run(["ip", "-n", name, "link", "add", "br0", "type", "bridge"])
        except (NetnsSetupError, OSError) as e:
            _probe_result = f"cannot create a network namespace with a bridge here: {e}"
        finally:
            with contextlib.suppress(NetnsSetupError, OSError):
                _netns_del(name)
    return _probe_result


def require(*, iptables: bool = False) -> None:
    """``pytest.skip`` (visibly, with the reason) unless namespaced tests can run here. With
    ``ZTUNNEL_NETNS_TESTS=require`` in the environment (CI on a root machine) that is a failure instead."""
    reason = skip_reason(iptables=iptables)
    if reason is not None:
        import pytest

        if os.environ.get("ZTUNNEL_NETNS_TESTS") == "require":
            pytest.fail(f"ZTUNNEL_NETNS_TESTS=require, but {reason}")
        pytest.skip(reason)


@contextlib.contextmanager
def topology(*, iptables: bool = False) -> Iterator[Topology]:
    """A fixture body: skip unless namespaced tests can run, then a :class:`Topology` closed afterwards."""
    require(iptables=iptables)
    with Topology() as t:
        yield t


def reap_stale() -> list[str]:
    """Delete namespaces left by test processes that no longer exist (``ztt-<pid>-...`` with a dead pid)."""
    removed: list[str] = []
    if not NETNS_DIR.is_dir():
        return removed
    for entry in sorted(NETNS_DIR.iterdir(), key=lambda p: -len(p.name)):  # pods before nodes before roots
        m = re.match(rf"^{PREFIX}-(\d+)-", entry.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            with contextlib.suppress(NetnsSetupError):
                if _netns_del(entry.name):
                    removed.append(entry.name)
    return removed


class Netns:
    """A named network namespace (``/run/netns/<name>``) and ways to run code in it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = NETNS_DIR / name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- subprocesses ----------------------------------------------------------------------------------------------

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def exec(
        self, argv: Sequence[str], *, check: bool = True, input: str | None = None, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the namespace and wait; ``check`` raises :class:`NetnsSetupError` with stderr."""
        p = subprocess.run(
            self.command(argv), input=input, capture_output=True, text=True, check=False, timeout=timeout
        )
        if check and p.returncode != 0:
            detail = (p.stderr or p.stdout).strip()
            raise NetnsSetupError(f"`{' '.join(argv)}` in netns {self.name} failed (exit {p.returncode}): {detail}")
        return p

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the namespace (keyword arguments as for :class:`subprocess.Popen`)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def iproute(self, *args: str) -> str:
        """``ip -n <ns> <args>``; stdout."""
        return _run(["ip", "-n", self.name, *args])

    def sysctl(self, key: str, value: str) -> None:
        """Set a per-namespace sysctl (``net.*``)."""
        self.run(Path("/proc/sys", *key.split(".")).write_text, value)

    # -- in-process ------------------------------------------------------------------------------------------------

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(*args)`` on a thread inside this namespace."""
        return run_in_netns(self.path, fn, *args)

    def new_socket(
        self, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM, proto: int = 0, *, mark: int | None = None
    ) -> socket.socket:
        """A non-blocking socket living in this namespace (usable from any thread), with SO_MARK ``mark``."""

        def make() -> socket.socket:
            s = socket.socket(family, type, proto)
            try:
                s.setblocking(False)
                if mark is not None:
                    s.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
            except OSError:
                s.close()
                raise
            return s

        return self.run(make)

    def listen_tcp(
        self, host: str = "0.0.0.0", port: int = 0, *, backlog: int = 128, mark: int | None = None
    ) -> socket.socket:
        """A listening TCP socket in this namespace (SO_REUSEADDR, non-blocking)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = self.new_socket(family, mark=mark)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))  # binding uses the socket's namespace, not the thread's
            s.listen(backlog)
        except OSError:
            s.close()
            raise
        return s

    async def start_server(
        self,
        client_connected_cb: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]],
        host: str = "0.0.0.0",
        port: int = 0,
        **kwargs: Any,
    ) -> asyncio.Server:
        """``asyncio.start_server`` on a socket in this namespace."""
        return await asyncio.start_server(client_connected_cb, sock=self.listen_tcp(host, port), **kwargs)

    async def connect(
        self, host: str, port: int, *, mark: int | None = None, source: str | None = None, timeout: float = 5.0
    ) -> socket.socket:
        """A TCP connection from this namespace (a connected non-blocking socket)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = self.new_socket(family, mark=mark)
        try:
            if source is not None:
                s.bind((source, 0))
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(s, (host, port)), timeout)
        except BaseException:
            s.close()
            raise
        return s

    async def open_connection(
        self, host: str, port: int, *, mark: int | None = None, source: str | None = None, timeout: float = 5.0
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """``asyncio.open_connection`` from this namespace."""
        return await asyncio.open_connection(
            sock=await self.connect(host, port, mark=mark, source=source, timeout=timeout)
        )

    def loop_thread(self, name: str = "") -> LoopThread:
        """A started event loop on a thread inside this namespace (stop it when done)."""
        return LoopThread(self, name or self.name).start()

    def open_fd(self) -> int:
        """The namespace opened O_RDONLY, as istio-cni sends it over ZDS (caller closes)."""
        return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

    @property
    def inode(self) -> int:
        return self.path.stat().st_ino

    def exists(self) -> bool:
        return self.path.exists()


class LoopThread:
    """An asyncio event loop running on its own thread inside a namespace (upstream's ``Namespace::run``): every
    socket code on it creates (``asyncio.start_server(host=...)``, ``open_connection``) lives in the namespace."""

    def __init__(self, ns: Netns, name: str, uvloop: bool = True) -> None:
        self.ns = ns
        self.name = name
        self.uvloop = uvloop
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> LoopThread:
        ready: concurrent.futures.Future[asyncio.AbstractEventLoop] = concurrent.futures.Future()

        def main() -> None:
            try:
                with entered(self.ns.path):
                    if self.uvloop:
                        import uvloop

                        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
                    else:
                        loop = asyncio.new_event_loop()
                    asyncio.set_event_loop(loop)
                    ready.set_result(loop)
                    try:
                        loop.run_forever()
                    finally:
                        loop.run_until_complete(loop.shutdown_asyncgens())
                        loop.close()
            except BaseException as e:
                if not ready.done():
                    ready.set_exception(e)
                raise

        self._thread = threading.Thread(target=main, name=f"netns-loop:{self.name}", daemon=True)
        self._thread.start()
        self.loop = ready.result(timeout=10)
        return self

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the namespace's loop; a concurrent future (``asyncio.wrap_future`` to await it)."""
        assert self.loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30) -> T:
        """Run ``coro`` on the namespace's loop and block until it is done."""
        return self.submit(coro).result(timeout)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` run on the namespace's loop, from another loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self, timeout: float = 10) -> None:
        """Cancel what is still running on the loop, stop it and join the thread."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return

        async def cancel_rest() -> None:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_rest(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Node(Netns):
    """A node: a namespace on the bridge at 172.172.0.<id> that routes for its pods."""

    def __init__(self, name: str, node: str, ident: int) -> None:
        super().__init__(name)
        self.node = node
        self.id = ident
        self.ip = f"172.172.0.{ident}"
        self.gateway = f"10.0.{ident}.1"  # the node's side of every pod veth
        self.pod_cidr = f"10.0.{ident}.0/24"
        self.pods: dict[str, Pod] = {}


class Pod(Netns):
    """A pod: a namespace with one veth (eth0) to its node, 10.0.<node>.<id>."""

    def __init__(self, name: str, pod: str, node: Node, ident: int) -> None:
        super().__init__(name)
        self.pod = pod
        self.node = node
        self.id = ident
        self.ip = f"10.0.{node.id}.{ident}"
        self.interface = f"veth{ident}"  # the host-side veth, in the node namespace


class Topology:
    """Nodes and pods as namespaces; see the module docstring for the layout. Close it (or use ``with``)."""

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.root = Netns(self.prefix)
        self.nodes: dict[str, Node] = {}
        self.pods: dict[str, Pod] = {}
        self._created: list[str] = []  # namespace names in creation order
        self._loops: list[LoopThread] = []
        self._closed = False
        reap_stale()
        try:
            self._add_netns(self.root.name)
            self.root.iproute("link", "set", "lo", "up")
            self.root.iproute("link", "add", "br0", "type", "bridge")
            self.root.iproute("link", "set", "br0", "up")
            self.root.iproute("addr", "add", f"{BRIDGE_IP}/16", "dev", "br0")
            self.root.sysctl("net.ipv4.ip_forward", "1")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def namespaces(self) -> list[str]:
        """Every namespace name this topology created (and has not deleted yet)."""
        return list(self._created)

    def _add_netns(self, name: str) -> None:
        _netns_add(name)
        self._created.append(name)

    def node(self, name: str) -> Node:
        """The node ``name``, created (and routed to and from every other node) on first use."""
        if name in self.nodes:
            return self.nodes[name]
        if not _NAME.match(name):
            raise ValueError(f"node name {name!r}: use letters, digits, '_' and '.'")
        if len(self.nodes) >= _MAX_NODES:
            raise ValueError(f"at most {_MAX_NODES} nodes")
        ident = len(self.nodes) + 2
        node = Node(f"{self.prefix}-{name}", name, ident)
        self._add_netns(node.name)
        self.nodes[name] = node
        veth = f"veth{ident}"
        self.root.iproute("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", node.name)
        self.root.iproute("link", "set", veth, "master", "br0", "up")
        self.root.iproute("route", "add", node.pod_cidr, "via", node.ip, "dev", "br0")
        node.iproute("link", "set", "lo", "up")
        node.iproute("link", "set", "eth0", "up")
        node.iproute("addr", "add", f"{node.ip}/16", "dev", "eth0")
        node.iproute("route", "add", "default", "via", BRIDGE_IP)
        node.sysctl("net.ipv4.ip_forward", "1")
        # Pod veths answer for the same gateway address on every link; strict reverse-path checks would drop
        # forwarded pod traffic whose source is only reachable through a /32 route.
        node.sysctl("net.ipv4.conf.all.rp_filter", "0")
        node.sysctl("net.ipv4.conf.default.rp_filter", "0")
        for other in self.nodes.values():
            if other is not node:
                node.iproute("route", "add", other.pod_cidr, "via", other.ip, "dev", "eth0")
                other.iproute("route", "add", node.pod_cidr, "via", node.ip, "dev", "eth0")
        return node

    def pod(self, node: str, name: str) -> Pod:
        """A new pod ``name`` on ``node`` (the node is created if needed). Pod names are unique per topology."""
        if name in self.pods:
            raise ValueError(f"pod {name!r} already exists")
        if not _NAME.match(name):
            raise ValueError(f"pod name {name!r}: use letters, digits, '_' and '.'")
        n = self.node(node)
        if len(n.pods) >= _MAX_PODS_PER_NODE:
            raise ValueError(f"at most {_MAX_PODS_PER_NODE} pods per node")
        ident = len(n.pods) + 2
        pod = Pod(f"{n.name}-{name}", name, n, ident)
        self._add_netns(pod.name)
        self.pods[name] = pod
        n.pods[name] = pod
        n.iproute("link", "add", pod.interface, "type", "veth", "peer", "name", "eth0", "netns", pod.name)
        n.iproute("link", "set", pod.interface, "up")
        n.iproute("addr", "add", f"{n.gateway}/32", "dev", pod.interface)
        n.iproute("route", "add", f"{pod.ip}/32", "dev", pod.interface, "scope", "link")
        n.sysctl(f"net.ipv4.conf.{pod.interface}.rp_filter", "0")
        pod.iproute("link", "set", "lo", "up")
        pod.iproute("link", "set", "eth0", "up")
        pod.iproute("addr", "add", f"{pod.ip}/32", "dev", "eth0")
        pod.iproute("route", "add", n.gateway, "dev", "eth0", "scope", "link", "src", pod.ip)
        pod.iproute("route", "add", "default", "via", n.gateway, "dev", "eth0", "src", pod.ip)
        return pod

    def resolve(self, pod: str) -> str:
        """A pod's IP by name."""
        try:
            return self.pods[pod].ip
        except KeyError:
            raise KeyError(f"no pod {pod!r}; have {sorted(self.pods)}") from None

    def loop_thread(self, ns: Netns, name: str = "") -> LoopThread:
        """:meth:`Netns.loop_thread`, stopped by :meth:`close`."""
        lt = ns.loop_thread(name)
        self._loops.append(lt)
        return lt

    def close(self) -> None:
        """Stop loop threads and delete every namespace created (pods, nodes, then the root with the bridge).
        Idempotent; keeps going past errors and raises the first one at the end."""
        if self._closed:
            return
        self._closed = True
        for lt in self._loops:
            with contextlib.suppress(Exception):
                lt.stop()
        first: BaseException | None = None
        for name in reversed(self._created):
            try:
                _netns_del(name)
            except (NetnsSetupError, OSError) as e:
                first = first or e
        self._created.clear()
        if first is not None:
            raise first

"""Interop with upstream Rust ztunnel as a peer (``make interop-upstream``; ``ztunnel.testing.interop`` has the set-up).

Skipped, with the reason, unless ``ZTUNNEL_UPSTREAM_BIN`` names an executable upstream build (and namespaced tests can
run: root, ``ip``, ``iptables``); ``make interop-upstream`` turns the skip into a failure.

For each mode (``dedicated`` with ``ENABLE_ORIG_SRC=false``, ``inpod`` with istio-cni's rules and source spoofing)
and each direction (this project's ztunnel as the client's node and upstream as the server's, then the mirror), one
run with fresh ztunnels makes two connections from the client's namespace:

1. to the echo service's VIP: the app's greeting (the address it sees the client at), 256 KiB each way, half-close;
2. to the server on the port a DENY policy names: the server-side ztunnel refuses the HBONE stream (401).

The tests then check the run: traffic intact, the denial made by the server side and reported by both, and the
``istio_tcp_*`` label sets of each connection at each reporter equal between the run and its mirror (the same node,
one time ours and one time upstream). Runs are made once per module and shared by the tests that read them; a run
that failed to start fails every test that needs it, with both ztunnels' logs attached to each failure.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ztunnel.testing import Sample
from ztunnel.testing.interop import (
    CLIENT_ID,
    DENIED_PORT,
    SERVER_ID,
    VIP,
    Impl,
    InteropMesh,
    Mode,
    require_upstream,
)

pytestmark = pytest.mark.root

PAYLOAD = hashlib.shake_256(b"interop payload").digest(256 * 1024)  # 256 KiB: past every HTTP/2 window's first fill
DIRECTIONS = {  # the client's node, then the server's
    "ours-to-upstream": (Impl.OURS, Impl.UPSTREAM),
    "upstream-to-ours": (Impl.UPSTREAM, Impl.OURS),
}
Labels = frozenset[tuple[str, str]]


@dataclass
class Run:
    """What one run saw. ``error`` is set when the ztunnels did not start (nothing else is then)."""

    mode: Mode
    impls: dict[str, Impl]
    error: str = ""
    echo_peer: str = ""
    echoed: bytes | None = None
    echo_error: str = ""
    denial: str = ""
    denied_app_connections: int = -1
    # Per node: the istio_tcp_* counter samples the connection created or changed (scrape after minus before).
    echo_samples: dict[str, list[Sample]] = field(default_factory=dict)
    deny_samples: dict[str, list[Sample]] = field(default_factory=dict)
    final_samples: dict[str, list[Sample]] = field(default_factory=dict)
    exit_codes: dict[str, int] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)

    def name(self, node: str) -> str:
        return f"{node} ({self.impls[node]})"


class Runs:
    """The module's meshes (one per mode, made on first use) and runs (one per mode and direction)."""

    def __init__(self, upstream_bin: str, workdir: Path) -> None:
        self.upstream_bin = upstream_bin
        self.workdir = workdir
        self.meshes: dict[Mode, InteropMesh] = {}
        self.runs: dict[tuple[Mode, str], Run] = {}

    def get(self, mode: Mode, direction: str) -> Run:
        key = (mode, direction)
        if key not in self.runs:
            if mode not in self.meshes:
                path = self.workdir / mode
                path.mkdir()
                self.meshes[mode] = InteropMesh(mode, path, self.upstream_bin)
            self.runs[key] = run(self.meshes[mode], *DIRECTIONS[direction])
        return self.runs[key]

    def close(self) -> None:
        for mesh in self.meshes.values():
            mesh.close()


def counters(samples: list[Sample]) -> dict[tuple[str, Labels], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for s in samples if s.name.endswith("_total")}


def delta(before: list[Sample], after: list[Sample]) -> list[Sample]:
    """Counter samples of ``after`` that are new or changed since ``before``."""
    old = counters(before)
    return [s for s in after if s.name.endswith("_total") and old.get((s.name, frozenset(s.labels.items()))) != s.value]


def closed(samples: list[Sample]) -> float:
    return sum(s.value for s in samples if s.name == "istio_tcp_connections_closed_total")


def settle(mesh: InteropMesh, count: int, timeout: float = 5.0) -> dict[str, list[Sample]]:
    """Scrape both nodes once each has recorded ``count`` closed connections (the server side records a moment
    after the client saw EOF), or after ``timeout`` with what there is."""
    deadline = time.monotonic() + timeout
    while True:
        scraped = {node: mesh.scrape(node) for node in mesh.nodes}
        if all(closed(s) >= count for s in scraped.values()) or time.monotonic() > deadline:
            return scraped
        time.sleep(0.05)


def run(mesh: InteropMesh, client: Impl, server: Impl) -> Run:
    """Start fresh ztunnels (node1 = the client's, node2 = the server's), make the two connections, stop them."""
    result = Run(mesh.mode, {"node1": client, "node2": server})
    try:
        mesh.start(client, server)
    except Exception as e:
        result.error = f"ztunnels did not start: {e}"
    else:
        try:
            before = {node: mesh.scrape(node) for node in mesh.nodes}
            try:
                result.echo_peer, result.echoed = mesh.exchange(*VIP, PAYLOAD)
            except Exception as e:
                result.echo_error = repr(e)
            after_echo = settle(mesh, 1)
            result.echo_samples = {node: delta(before[node], after_echo[node]) for node in mesh.nodes}
            connections = mesh.denied_app.connections
            result.denial = mesh.attempt(mesh.server_ip, DENIED_PORT)
            after_deny = settle(mesh, 2)
            result.denied_app_connections = mesh.denied_app.connections - connections
            result.deny_samples = {node: delta(after_echo[node], after_deny[node]) for node in mesh.nodes}
            result.final_samples = after_deny
        except Exception as e:
            result.error = f"run failed: {e!r}"
    finally:
        result.exit_codes = mesh.stop()
        result.logs = {name: mesh.log_text(name) for name in ("node1", "node2", "control-plane")}
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    r = Runs(require_upstream(), tmp_path_factory.mktemp("interop"))
    try:
        yield r
    finally:
        r.close()


def use(request: pytest.FixtureRequest, *found: Run) -> None:
    """Attach the runs' logs to the test's report (shown when it fails); fail at once if a run did not start."""
    for r in found:
        for node in ("node1", "node2"):
            request.node.add_report_section("call", f"{r.mode} {r.name(node)} log", r.logs.get(node, ""))
        request.node.add_report_section("call", f"{r.mode} control plane log", r.logs.get("control-plane", ""))
    for r in found:
        assert not r.error, r.error
        assert r.exit_codes == {"node1": 0, "node2": 0}, f"exit status after SIGTERM: {r.exit_codes}"


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("mode", list(Mode))
def test_traffic_intact(runs: Runs, request: pytest.FixtureRequest, mode: Mode, direction: str) -> None:
    """Through the service VIP, over HBONE between the two implementations: every byte echoed, the half-close
    carried both ways (the echo ends with EOF), the app sees the client's address in-pod (spoofed) and the server
    node's own address in dedicated mode (``ENABLE_ORIG_SRC=false``); each side counts the bytes."""
    r = runs.get(mode, direction)
    use(request, r)
    mesh = runs.meshes[mode]
    assert not r.echo_error, f"{r.name('node1')} -> {r.name('node2')}: {r.echo_error}"
    assert r.echoed is not None and len(r.echoed) == len(PAYLOAD) and r.echoed == PAYLOAD
    assert r.echo_peer == (mesh.client_ip if mode is Mode.INPOD else mesh.server_ip)
    greeting = len(f"peer={r.echo_peer}\n")
    for node, reporter in (("node1", "source"), ("node2", "destination")):
        got = {
            s.name: s.value
            for s in r.echo_samples[node]
            if s.labels["reporter"] == reporter and s.labels["response_flags"] == "-"
        }
        # Client->server is "received" and server->client "sent" at both reporters (Istio's convention).
        want = {
            "istio_tcp_connections_opened_total": 1,
            "istio_tcp_connections_closed_total": 1,
            "istio_tcp_received_bytes_total": len(PAYLOAD),
            "istio_tcp_sent_bytes_total": len(PAYLOAD) + greeting,
        }
        assert got == want, r.name(node)
        (labels,) = [s.labels for s in r.echo_samples[node] if s.name == "istio_tcp_connections_opened_total"]
        assert (labels["source_principal"], labels["destination_principal"]) == (CLIENT_ID, SERVER_ID)
        assert labels["destination_service"] == "echo.default.svc.cluster.local"
        assert labels["connection_security_policy"] == "mutual_tls"


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("mode", list(Mode))
def test_policy_denial(runs: Runs, request: pytest.FixtureRequest, mode: Mode, direction: str) -> None:
    """A DENY policy on the server's port: the server-side ztunnel answers the CONNECT with 401 and never reaches
    the app; the client's connection fails (a SOCKS5 "not allowed" from ours, which replies once the tunnel is up;
    accepted then closed from upstream's SOCKS5 and from every in-pod capture). The server reports DENY as the
    destination, the client a failed connection (CONNECT) as the source; both access logs say so."""
    r = runs.get(mode, direction)
    use(request, r)
    ours_socks = mode is Mode.DEDICATED and r.impls["node1"] is Impl.OURS
    assert r.denial == ("refused: SOCKS5 reply 2" if ours_socks else "closed"), r.name("node1")
    assert r.denied_app_connections == 0
    for node, reporter, flag in (("node1", "source", "CONNECT"), ("node2", "destination", "DENY")):
        failed = [s for s in r.deny_samples[node] if s.name == "istio_tcp_connections_failed_total"]
        assert [(s.labels["reporter"], s.labels["response_flags"], s.value) for s in failed] == [(reporter, flag, 1)], (
            r.name(node)
        )
    server = f"{runs.meshes[mode].server_ip}:{DENIED_PORT}"
    assert any(server in line and "401 Unauthorized" in line for line in access_log(r, "node1")), r.name("node1")
    denied = f"explicitly denied by: default/deny-{DENIED_PORT}"
    assert any(server in line and denied in line for line in access_log(r, "node2")), r.name("node2")


def access_log(r: Run, node: str) -> list[str]:
    """The access-log lines of a node's ztunnel (both print "connection complete" records under scope access)."""
    return [line for line in r.logs[node].splitlines() if "\taccess\t" in line and "connection complete" in line]


def label_sets(samples: list[Sample]) -> set[tuple[str, Labels]]:
    return {(s.name, frozenset(s.labels.items())) for s in samples}


def differences(ours: set[tuple[str, Labels]], upstream: set[tuple[str, Labels]]) -> list[str]:
    """Readable differences: each label set only one side has, with the labels that differ from the other side's
    closest set of the same sample name."""
    out = []
    for side, mine, other in (
        ("ours", ours - upstream, upstream - ours),
        ("upstream", upstream - ours, ours - upstream),
    ):
        for name, labels in sorted(mine):
            twin = min((lb for n, lb in other if n == name), key=lambda lb: len(labels ^ lb), default=frozenset())
            out.append(
                f"{name} only from {side}: {dict(sorted(labels - twin))} (other side: {dict(sorted(twin - labels))})"
            )
    return out


@pytest.mark.parametrize("mode", list(Mode))
def test_metric_labels_match_upstream(runs: Runs, request: pytest.FixtureRequest, mode: Mode) -> None:
    """The same connections, mirrored: node1 (the source reporter) is ours in one run and upstream in the other,
    node2 (the destination reporter) the reverse. For the echo connection, for the denied one, and for everything
    each ztunnel exposed by the end, the ``istio_tcp_*`` samples' label sets are equal between the two."""
    mine, theirs = runs.get(mode, "ours-to-upstream"), runs.get(mode, "upstream-to-ours")
    use(request, mine, theirs)
    problems = []
    for node in ("node1", "node2"):
        ours, upstream = (mine, theirs) if mine.impls[node] is Impl.OURS else (theirs, mine)
        for what in ("echo_samples", "deny_samples", "final_samples"):
            a, b = label_sets(getattr(ours, what)[node]), label_sets(getattr(upstream, what)[node])
            assert a, f"{node}: no istio_tcp_* samples in {what} from ours"
            problems += [f"{node} {what}: {d}" for d in differences(a, b)]
    assert not problems, "\n".join(problems)

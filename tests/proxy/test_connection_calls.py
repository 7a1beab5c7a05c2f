"""Python calls per connection outside the HBONE core, counted exactly (cProfile's call counts; its timings are unused).

Two in-process ztunnels (node A: SOCKS5 in, HBONE out; node B: HBONE in, the app out) and an echo app on the
test's loop; 30 connections of SOCKS5 + 1-byte echo + close after five warm-up ones (pool, certificates,
caches), profiled together. The counts are per connection for both nodes; each bound is one a change in
``bench/README.md`` ("Optimisations", issue 17: per-connection Python outside the HBONE core) brought it to, and
each was above it before. The anchors check the profile saw the connections at all, so no bound passes by
measuring nothing.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
from pathlib import Path

import pytest
import uvloop

from ztunnel.testing import EchoServer, TwoNodeMesh, running_app

N = 30
# (file, function name) -> calls per connection, both nodes together; and ("file:function", caller's file) -> the
# calls made to it from that file.
Counts = dict[tuple[str, str], float]


async def _one(mesh: TwoNodeMesh) -> None:
    reader, writer = await mesh.socks5()
    writer.write(b"x")
    assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
    writer.close()
    await writer.wait_closed()


async def _profiled(workdir: Path) -> cProfile.Profile:
    mesh = TwoNodeMesh(workdir)  # a random block of 127/8: no clash with other tests on the fixed addresses
    prof = cProfile.Profile()
    echo = await EchoServer().start(*mesh.server_app)
    try:
        async with running_app(mesh.env_b(RUST_LOG="warn")), running_app(mesh.env_a(RUST_LOG="warn")):
            for _ in range(5):
                await _one(mesh)
            await asyncio.sleep(0.1)
            prof.enable()
            for _ in range(N):
                await _one(mesh)
            await asyncio.sleep(0.1)  # both nodes finish closing the last connection
            prof.disable()
    finally:
        await echo.stop()
    return prof


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> Counts:
    """Calls per connection, on uvloop as the product runs (a loop of its own: the fixture is module-wide)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        prof = runner.run(_profiled(tmp_path_factory.mktemp("calls")))
    out: Counts = {}
    for (file, _line, name), (_cc, nc, _tt, _ct, callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        key = _key(file, name)
        out[key] = out.get(key, 0.0) + nc / N
        for (caller_file, _caller_line, caller_name), caller_counts in callers.items():
            # ("<callee file>:<callee name>", "<caller file>"): calls made from one file of ours.
            edge = (f"{key[0]}:{name}", _key(caller_file, caller_name)[0])
            out[edge] = out.get(edge, 0.0) + caller_counts[1] / N
    return out


def _key(file: str, name: str) -> tuple[str, str]:
    # ztunnel's own files by their path in the package (ztunnel/metrics.py is not ztunnel/proxy/metrics.py), the
    # rest (the standard library's ipaddress, contextlib ...) by file name.
    parts = Path(file).parts
    return ("/".join(parts[parts.index("ztunnel") :]) if "ztunnel" in parts else parts[-1] if parts else file, name)


def _calls(counts: Counts, file: str, name: str | None = None) -> float:
    return sum(v for (f, n), v in counts.items() if f == file and (name is None or n == name))


def test_the_profile_saw_every_connection(counts: Counts) -> None:
    """Anchors: one SOCKS5 handshake accepted per connection, one CONNECT served on node B, one app connect."""
    assert _calls(counts, "ztunnel/proxy/socks5.py", "connection_made") == pytest.approx(1.0), counts
    assert _calls(counts, "ztunnel/proxy/inbound.py", "_on_request") == pytest.approx(1.0), counts
    assert _calls(counts, "ztunnel/proxy/connect.py", "_loop_connect") >= 1.0, counts


def test_metric_series_are_found_once_per_label_set(counts: Counts) -> None:
    """The four istio_tcp_* children of a label set, and the sockets-open child of a reporter, are kept together:
    no ``Family.child`` lookup (a Python call hashing the whole 27-pair label tuple) per connection. It was 9 (node
    A: opened, sent, received, closed and sockets open; node B the first four)."""
    assert _calls(counts, "ztunnel/metrics.py", "child") == 0, counts


def test_socks5_builds_no_address_objects(counts: Counts) -> None:
    """The SOCKS5 replies are constants (all name 0.0.0.0:0) and a request's IPv4 destination is parsed once per
    distinct address: no ipaddress constructor or packing per connection. It was 2 constructors (the request's
    address, the reply's 0.0.0.0) and a ``packed`` per connection, and ``Socks5Parser.done`` 6 times."""
    assert _calls(counts, "ipaddress.py", "__init__") == 0, counts
    assert _calls(counts, "ipaddress.py", "packed") == 0, counts
    assert _calls(counts, "ztunnel/proxy/socks5.py", "done") == 0, counts
    assert _calls(counts, "ztunnel/proxy/socks5.py", "reply") == 0, counts


def test_outbound_routing_looks_each_thing_up_once(counts: Counts) -> None:
    """Node A's routing of a service-addressed connection: the VIP looked up once (``build_request`` hands its
    answer to ``fetch_upstream``, which looked it up again), the service's SANs parsed once per SAN string, the
    CONNECT authority formatted once (for the record and the request), the endpoint's IP picked without lists.
    Before: 2 VIP lookups, 1 SPIFFE parse, 2 authority formats, 3 list comprehensions in state/upstream.py."""
    assert _calls(counts, "ztunnel/state/service.py", "get_best_by_vip") == 1, counts
    assert _calls(counts, "ztunnel/identity/spiffe.py", "parse") == 0, counts
    assert _calls(counts, "ztunnel/proxy/outbound.py", "authority") == 1, counts
    assert _calls(counts, "ztunnel/state/upstream.py", "<listcomp>") == 0, counts


def test_socket_options_through_a_plain_socket_object(counts: Counts) -> None:
    """Node B's keepalive options after the app connect go through one C socket object made from the descriptor,
    with the family read from the transport's address: no ``socket.socket`` (Python-level constructor and
    ``detach``, and the stand-in's family and type turned into enums) and no generator context manager. Before:
    ``socket.py`` 2 calls, ``contextlib.contextmanager``'s helper 1, and its ``__enter__``/``__exit__``."""
    assert _calls(counts, "socket.py") == 0, counts
    assert _calls(counts, "contextlib.py", "helper") == 0, counts
    assert _calls(counts, "ztunnel/sockets.py", "socket_of") == pytest.approx(1.0), counts  # anchor: it ran


def test_no_on_demand_coroutines_or_traceparent_splitting(counts: Counts) -> None:
    """Without ``XDS_ON_DEMAND`` there is nothing to wait for: node A does not build the destination's
    NetworkAddress and await ``fetch_address``, node B looks the peer's workload up without two coroutines
    (``_workload_at_peer``, ``fetch_workload_by_address``) and two ``_naddr`` calls. Node B's span id is one regex
    match of the client's traceparent instead of a split, a list and a set per field (8 calls). Node A takes the
    local workload without awaiting ``LocalWorkload.get`` when it is known."""
    for name in ("fetch_address", "fetch_workload_by_address", "get"):
        assert _calls(counts, "ztunnel/proxy/inputs.py", name) == 0, name
    assert _calls(counts, "ztunnel/proxy/inbound.py", "_workload_at_peer") == 0, counts
    assert _calls(counts, "ztunnel/proxy/inbound.py", "_naddr") == 0, counts
    assert _calls(counts, "ztunnel/telemetry.py") <= 4, counts  # span_id, display, enter_span twice
    assert _calls(counts, "ztunnel/telemetry.py", "span_id") == pytest.approx(1.0), counts  # anchor: it ran


def test_no_typing_cast_or_reporter_property_calls(counts: Counts) -> None:
    """``typing.cast`` is a Python function (a call per use): the plaintext connection and the SOCKS5 handshake
    took their transport through it, 3 per connection; the labels of a record read ``reporter`` (a property) twice
    per connection; ``register`` called ``established`` for node A's record, and node B's span wrapped its peer
    through ``display()``."""
    for caller in ("ztunnel/proxy/relay.py", "ztunnel/proxy/socks5.py"):
        assert counts.get(("typing.py:cast", caller), 0) == 0, caller
    assert _calls(counts, "ztunnel/proxy/connection_manager.py", "reporter") == 0, counts
    # A record registered as established counts itself in register (node A); node B's, registered before its policy
    # check, still calls established once it is. Before: 2. And the span's peer is a Display made directly.
    assert _calls(counts, "ztunnel/proxy/connection_manager.py", "established") == pytest.approx(1.0), counts
    assert _calls(counts, "ztunnel/telemetry.py", "display") == 0, counts
    assert _calls(counts, "ztunnel/proxy/relay.py", "connection_made") == pytest.approx(2.0), counts  # anchor


def test_no_coroutine_layers_around_the_outbound_path_or_the_app_connect(counts: Counts) -> None:
    """A SOCKS5 request for an IP runs the outbound path as the connection's task itself (``Socks5.connect``, the
    coroutine around it, is for names to resolve), and node B's app connect runs the event loop's connect without
    ``connect_plain`` around it, and node A's outbound HBONE path awaits the pooled CONNECT without two
    coroutines around that wait. Before: ``Socks5.connect`` 2, ``connect_plain`` 2, ``_hbone`` 2 and
    ``_established`` 2 (a coroutine counts its start and each resumption)."""
    assert _calls(counts, "ztunnel/proxy/socks5.py", "connect") == 0, counts
    # connect_plain is a plain call now (it picks the way and returns that coroutine): once, not a coroutine's 2.
    assert _calls(counts, "ztunnel/proxy/connect.py", "connect_plain") <= 1, counts
    # The pooled CONNECT awaited and its answer checked in _open_outer itself (no _hbone, no _established: 4).
    assert _calls(counts, "ztunnel/proxy/outbound.py", "_established") == 0, counts
    assert _calls(counts, "ztunnel/proxy/outbound.py", "_hbone") == 0, counts
    assert _calls(counts, "ztunnel/proxy/outbound.py", "proxy_to") >= 1, counts  # anchor: the path ran


def test_the_app_connect_is_chosen_in_one_place(counts: Counts) -> None:
    """Node B's app connect (``connect_interruptible``) goes through ``connect_plain``, the one body that chooses the
    event loop's connect or a socket of ours, as outbound's passthrough connect does; before, it repeated that
    choice itself to avoid ``connect_plain``'s coroutine (0 calls of it). Now ``connect_plain`` is a plain call
    returning the chosen coroutine: 1 call, no coroutine layer, and the choice made once (``_loop_local_addr``)."""
    assert counts.get(("ztunnel/proxy/connect.py:connect_plain", "ztunnel/proxy/connect.py"), 0) == pytest.approx(1.0)
    assert _calls(counts, "ztunnel/proxy/connect.py", "connect_plain") == pytest.approx(1.0), counts
    assert _calls(counts, "ztunnel/proxy/connect.py", "_loop_local_addr") == pytest.approx(1.0), counts
    assert _calls(counts, "ztunnel/proxy/connect.py", "_socket_connect") == 0, counts  # the loop's connect ran


def test_routing_helpers_without_comprehensions_or_version_properties(counts: Counts) -> None:
    """Node B's services of the local workload in a plain loop (a generator and a list comprehension before: 3
    calls), node A's endpoint address family compared by class (``IPv4Address.version`` is a Python property: 2
    calls before)."""
    assert _calls(counts, "ztunnel/proxy/common.py", "<genexpr>") == 0, counts
    assert _calls(counts, "ztunnel/proxy/common.py", "<listcomp>") == 0, counts
    assert counts.get(("ipaddress.py:version", "ztunnel/state/upstream.py"), 0) == 0, counts
    assert _calls(counts, "ztunnel/proxy/common.py", "services_of") == pytest.approx(1.0), counts  # anchor


# The files of this work (issue 17): the paths outside the HBONE core a connection takes.
LANE = (
    "ztunnel/proxy/socks5.py",
    "ztunnel/proxy/outbound.py",
    "ztunnel/proxy/inbound.py",
    "ztunnel/proxy/relay.py",
    "ztunnel/proxy/connect.py",
    "ztunnel/proxy/connection_manager.py",
    "ztunnel/proxy/metrics.py",
    "ztunnel/proxy/listener.py",
    "ztunnel/proxy/common.py",
    "ztunnel/proxy/inputs.py",
    "ztunnel/sockets.py",
    "ztunnel/telemetry.py",
    "ztunnel/state/",
)


def _in_lane(path: str) -> bool:
    return path.startswith(LANE)


def test_python_calls_per_connection_outside_the_hbone_core(counts: Counts) -> None:
    """All of the above together: calls of this project's functions outside the HBONE core (SOCKS5, outbound,
    inbound, relay set-up and teardown, connect, connection records, metrics, sockets, state lookups), and the calls
    those functions make (to anything: builtins, the standard library, the HBONE core), both nodes per connection.
    Before: 185 and 302; after: 135 and 243. A bound with a little room, so the next change that adds calls here
    is a decision, not an accident."""
    own = sum(v for (path, _name), v in counts.items() if ":" not in path and _in_lane(path))
    made = sum(v for (callee, caller), v in counts.items() if ":" in callee and _in_lane(caller))
    assert own >= 100, counts  # anchor: the lane's functions ran
    assert own <= 150, own
    assert made <= 260, made


# The HBONE adapters around the core (issue 17, second round): the pool's checkout, the stream's set-up and teardown.
ADAPTERS = ("ztunnel/proxy/pool.py", "ztunnel/proxy/hbone/stream.py", "ztunnel/proxy/hbone/connection.py")


def test_pool_checkout_is_one_call_without_a_coroutine(counts: Counts) -> None:
    """Node A takes a pooled connection with room in two plain calls (``WorkloadHBONEPool.try_open_stream``, and
    the connection's ``open_stream_within``, which checks the room as it opens the stream): no ``open_stream``
    coroutine awaited when nothing needs dialling, no ``_find``, ``_usable``, ``_capacity`` helpers, no
    ``stream_count``/``goaway_received`` properties. Before: 4 calls in pool.py (the coroutine among them), the 2
    properties and the connection's ``open_stream``: 7."""
    assert _calls(counts, "ztunnel/proxy/pool.py") == pytest.approx(1.0), counts
    assert _calls(counts, "ztunnel/proxy/pool.py", "try_open_stream") == pytest.approx(1.0), counts  # anchor
    assert _calls(counts, "ztunnel/proxy/hbone/connection.py", "stream_count") == 0, counts
    assert _calls(counts, "ztunnel/proxy/hbone/connection.py", "goaway_received") == 0, counts
    assert _calls(counts, "ztunnel/proxy/hbone/connection.py", "open_stream") == 0, counts
    assert _calls(counts, "ztunnel/proxy/hbone/connection.py", "open_stream_within") == pytest.approx(1.0), counts


def test_stream_teardown_checks_inline(counts: Counts) -> None:
    """A stream's half-closes (the peer's END_STREAM, the plaintext side's FIN) and its attach check whether both
    directions are done before calling ``_maybe_done``, and the FIN sends END_STREAM without going through
    ``end``: ``_maybe_done`` runs once per stream, when it finishes. Before: ``_maybe_done`` 6 (3 a stream: attach,
    END_STREAM, FIN) and ``end`` 2."""
    assert _calls(counts, "ztunnel/proxy/hbone/stream.py", "_maybe_done") == pytest.approx(2.0), counts
    assert _calls(counts, "ztunnel/proxy/hbone/stream.py", "end") == 0, counts
    assert _calls(counts, "ztunnel/proxy/hbone/stream.py", "_finish") == pytest.approx(2.0), counts  # anchor


def test_a_finished_stream_is_not_called_back_by_its_socket(counts: Counts) -> None:
    """A stream that finished both ways closes its plaintext socket and lets go of it: the socket's
    ``connection_lost`` does not call ``plain_lost`` of a stream already done. Before: 2 (once a stream)."""
    assert _calls(counts, "ztunnel/proxy/hbone/stream.py", "plain_lost") == 0, counts
    assert _calls(counts, "ztunnel/proxy/relay.py", "connection_lost") >= 2.0, counts  # anchor: the sockets closed


def test_python_calls_per_connection_in_the_hbone_adapters(counts: Counts) -> None:
    """All calls of the adapters' functions (pool, stream, connection), and the calls they make, both nodes per
    connection. Before: 85 and 172; after: 72 and 159. A bound with a little room above the result, as for the
    other paths, so the next change that adds calls here is a decision, not an accident."""
    own = sum(v for (path, _name), v in counts.items() if ":" not in path and path in ADAPTERS)
    made = sum(v for (callee, caller), v in counts.items() if ":" in callee and caller in ADAPTERS)
    assert own >= 50, counts  # anchor: the adapters ran
    assert own <= 75, own
    assert made <= 162, made

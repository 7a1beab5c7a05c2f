"""One ``/metrics`` for many processes (``ztunnel.metrics_merge``): worker snapshots and the control process's merge,
without processes: the snapshots come from real registries fed as the data path feeds them."""

from __future__ import annotations

import asyncio
import pickle
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from ztunnel.app import App
from ztunnel.config import SocketAddress, from_env
from ztunnel.dns.metrics import DnsLabels
from ztunnel.dns.metrics import Metrics as DnsMetrics
from ztunnel.inpod.netns import Netns
from ztunnel.inpod.statemanager import WorkloadProxyManagerState
from ztunnel.inpod.workloadmanager import WorkloadProxyManager
from ztunnel.metrics import Family, Metric, Registry, StatsServer, encode, render
from ztunnel.metrics_merge import (
    CUMULATIVE,
    EMPTY,
    FamilySnapshot,
    MetricsMerger,
    Snapshot,
    family_order,
    merge,
    retain,
    snapshot,
)
from ztunnel.proxy.common import ResponseFlag
from ztunnel.proxy.metrics import TrafficMetrics, traffic_labels
from ztunnel.readiness import Readiness
from ztunnel.state import ProxyState
from ztunnel.state.workload import Locality, Workload
from ztunnel.xds.client import ConnectionTerminationReason
from ztunnel.xds.updater import AddressHandler

SRC = Workload(uid="u1", name="client-1", namespace="default", workload_name="client", canonical_name="client")
DST = Workload(
    uid="u2",
    name="server-1",
    namespace="default",
    workload_name="server",
    service_account="server",
    locality=Locality(region="eu", zone="eu-1"),
)
SVC = ("echo.default.svc.cluster.local", "echo", "default")
FDS = b"process_open_fds "


def body(metrics: Iterable[Metric]) -> bytes:
    return render(metrics)[0]


# Per-process values a second process adds its own of: descriptors, the runtime metrics, dropped log lines.
PER_PROCESS = (FDS, b"ztunnel_event_loop_", b"ztunnel_gc_pause_", b"ztunnel_log_lines_dropped")


def without_fds(text: bytes) -> bytes:
    """The exposition without the per-process live values (a second process adds its own)."""
    return b"".join(line for line in text.splitlines(keepends=True) if not line.startswith(PER_PROCESS))


def data_path_traffic(traffic: TrafficMetrics, dns: DnsMetrics) -> None:
    """What a data plane records: three connections with upstream's 27 labels (one failed), one still open, DNS
    requests answered and forwarded (a histogram)."""
    ok = traffic_labels("source", SRC, None, DST, SVC, True, ResponseFlag.NONE)
    plain = traffic_labels("source", SRC, None, None, None, False, ResponseFlag.NONE)
    c = traffic.open(ok)
    traffic.close(c, 300_000, 1000, ResponseFlag.NONE)
    c = traffic.open(plain)
    traffic.close(c, 0, 10, ResponseFlag.CONNECT)
    traffic.flush(traffic.open(ok), 5, 7)
    traffic.socket_opened("source")  # its accepted socket
    labels = DnsLabels.of(1, "udp", SRC)
    dns.request(labels)
    dns.request(DnsLabels.of(28, "tcp", None))
    dns.forwarded(labels)
    dns.forward_duration(labels, 0.004)


def control_plane_traffic(app: App, tmp_path: Path) -> None:
    """What the control process records: xDS messages and a termination, the in-pod workload manager's families."""
    config = from_env({"XDS_ADDRESS": "https://istiod.istio-system.svc:15012"})
    from ztunnel.xds.client import AdsClient

    client = AdsClient(config, [AddressHandler(app.state)])
    client.terminations[ConnectionTerminationReason.RECONNECT] += 2
    client.messages["type.googleapis.com/istio.workload.Address"] = [3, 4096]
    app.xds_client = client
    state = WorkloadProxyManagerState(factory=None, open_netns=no_netns)  # type: ignore[arg-type]  # no proxies
    WorkloadProxyManager(str(tmp_path / "zds.sock"), state, Readiness(), app.registry)


def no_netns(fd: int) -> Netns:
    raise AssertionError("no pod is added in these tests")


def worker_registry(version: str) -> tuple[Registry, TrafficMetrics, DnsMetrics]:
    """A data-plane worker's families: the proxies' and the DNS proxy's, nothing of the control plane."""
    registry = Registry(version)
    dns = DnsMetrics()
    registry.extra.append(dns)
    return registry, TrafficMetrics(registry), dns


def app() -> App:
    return App(config=from_env({}), state=ProxyState("node"))


# -- one worker: exactly today's output ------------------------------------------------------------------------------


@pytest.mark.parametrize("control_declares_all", [True, False], ids=["control-as-today", "control-own-only"])
def test_one_worker_merged_is_todays_output_byte_for_byte(tmp_path: Path, control_declares_all: bool) -> None:
    """Today's single process against the control process + one worker with the same samples: the same bytes,
    families, HELP, label order and all, whether the control process declares the data-plane families (App's
    registry) or only has its own (their place then comes from the worker's order)."""
    single = app()
    control_plane_traffic(single, tmp_path / "a")
    data_path_traffic(single.traffic, single.dns_metrics)

    if control_declares_all:
        control = app()
        control_plane_traffic(control, tmp_path / "b")
        control_registry = control.registry
    else:
        bare = app()
        control_registry = Registry(single.config.istio_version)
        control_registry.dynamic.append(bare._xds_metrics)
        control_plane_traffic(bare, tmp_path / "b")
        state = WorkloadProxyManagerState(factory=None, open_netns=no_netns)  # type: ignore[arg-type]  # no proxies
        WorkloadProxyManager(str(tmp_path / "zds.sock"), state, Readiness(), control_registry)
    worker, traffic, dns = worker_registry(single.config.istio_version)
    data_path_traffic(traffic, dns)

    today = encode(single.registry)[0]
    shipped = pickle.loads(pickle.dumps(snapshot(worker)))
    merged = body(merge(snapshot(control_registry), {0: shipped}, per_worker=False))
    assert without_fds(merged) == without_fds(today)
    # The families a scrape of today shows, all there (the comparison is not of two empty texts).
    for family in (b"istio_build", b"istio_tcp_sent_bytes", b"workload_manager_active_proxy_count"):
        assert b"# HELP " + family in today
    assert b"istio_xds_message_total{" in today and b"istio_dns_upstream_request_duration_seconds_bucket{" in today

    # With the per-worker families: today's text, then theirs, then the end.
    full = body(merge(snapshot(control_registry), {0: shipped}))
    head, sep, tail = full.partition(b"# HELP ztunnel_worker_")
    assert sep and without_fds(head) == without_fds(today).removesuffix(b"# EOF\n")
    assert tail.endswith(b"# EOF\n")


def test_one_snapshot_renders_as_its_registry() -> None:
    registry, traffic, dns = worker_registry("1.0")
    data_path_traffic(traffic, dns)
    snap = pickle.loads(pickle.dumps(snapshot(registry)))
    assert body(merge(snap, {}, per_worker=False)) == encode(registry)[0]


def test_descriptors_are_summed_and_the_limit_is_the_control_process_own() -> None:
    """process_open_fds: what every ztunnel process holds together; process_max_fds and istio_build: the control
    process's alone (not N+1 times)."""
    control, worker = Registry("1.0"), Registry("1.0")
    merged = {m.name: m for m in merge(snapshot(control), {0: snapshot(worker), 1: snapshot(worker)})}
    (own,) = [m for m in control.collect() if m.name == "process_open_fds"]
    assert merged["process_open_fds"].samples[0].value == pytest.approx(3 * own.samples[0].value, abs=3)
    (limit,) = merged["process_max_fds"].samples
    assert limit.value == next(m for m in control.collect() if m.name == "process_max_fds").samples[0].value
    assert [s.value for s in merged["istio_build"].samples] == [1]


# -- sums, gauges, restarts ------------------------------------------------------------------------------------------


def test_two_workers_sum_counters_histograms_and_gauges() -> None:
    control = Registry("1.0")
    workers = [worker_registry("1.0") for _ in range(2)]
    for _, traffic, dns in workers:
        data_path_traffic(traffic, dns)
    merged = {m.name: m for m in merge(snapshot(control), {i: snapshot(w[0]) for i, w in enumerate(workers)})}
    one = {m.name: m for m in workers[0][0].exposed()}
    for name in ("istio_tcp_connections_opened", "istio_tcp_sent_bytes", "istio_dns_upstream_request_duration_seconds"):
        assert [(s.name, s.labels) for s in merged[name].samples] == [(s.name, s.labels) for s in one[name].samples]
        assert [s.value for s in merged[name].samples] == [2 * s.value for s in one[name].samples]
    assert [s.value for s in merged["istio_tcp_sockets_open"].samples] == [2]  # one open connection per worker


def test_an_exited_worker_keeps_its_counters_and_loses_its_gauges() -> None:
    control = Registry("1.0")
    w0, t0, d0 = worker_registry("1.0")
    data_path_traffic(t0, d0)
    merger = MetricsMerger()
    merger.update(0, snapshot(w0))
    before = {m.name: m for m in merger.families(snapshot(control))}
    merger.exited(0)
    after = {m.name: m for m in merger.families(snapshot(control))}
    for name, fam in before.items():
        if fam.type in CUMULATIVE:
            assert after[name].samples == fam.samples, name
    assert "istio_tcp_sockets_open" not in after  # the dead worker's open socket is gone
    assert [s.value for s in after["ztunnel_worker_connections_opened"].samples] == [3]
    assert after["ztunnel_worker_sockets_open"].samples == []
    # A new worker 0 starts from zero: the totals go on from what the old one counted.
    w0b, t0b, _ = worker_registry("1.0")
    t0b.open(traffic_labels("source", SRC, None, DST, SVC, True, ResponseFlag.NONE))
    t0b.socket_opened("source")
    merger.update(0, Snapshot(snapshot(w0b).families, pid=-1, cpu_seconds=0.5))
    again = {m.name: m for m in merger.families(snapshot(control))}
    opened = {tuple(s.labels.items()): s.value for s in again["istio_tcp_connections_opened"].samples}
    assert sorted(opened.values()) == [1, 3]  # the plain connection's series is kept; the mTLS one grew 2 -> 3
    assert [s.value for s in again["ztunnel_worker_connections_opened"].samples] == [4]
    assert [s.value for s in again["istio_tcp_sockets_open"].samples] == [1]


def test_a_snapshot_from_a_new_process_retains_the_old_one() -> None:
    """A restart whose exit the supervisor did not report: the pid differs, the old counters are kept."""
    old = Snapshot((FamilySnapshot("c", "h", "counter", "", (("c_total", (), 5.0),)),), pid=10, cpu_seconds=2.0)
    new = Snapshot((FamilySnapshot("c", "h", "counter", "", (("c_total", (), 1.0),)),), pid=11, cpu_seconds=0.25)
    merger = MetricsMerger()
    merger.update(3, old)
    merger.update(3, old)  # the same process again: nothing retained
    assert merger.retained == {}
    merger.update(3, new)
    merged = {m.name: m for m in merger.families(EMPTY)}
    assert [s.value for s in merged["c"].samples] == [6]
    assert [(s.labels, s.value) for s in merged["ztunnel_worker_cpu_seconds"].samples] == [({"worker": "3"}, 2.25)]


def test_per_worker_families_are_unstable_and_ordered_by_worker() -> None:
    workers = {}
    for i, n in ((1, 2), (0, 1)):
        reg, traffic, _ = worker_registry("1.0")
        for _ in range(n):
            traffic.open(traffic_labels("destination", SRC, None, DST, SVC, True, ResponseFlag.NONE))
            traffic.socket_opened("destination")
        workers[i] = snapshot(reg)
    text = body(merge(EMPTY, workers)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("ztunnel_worker_connections_opened", "ztunnel_worker_sockets_open", "ztunnel_worker_cpu_seconds"):
        assert "unstable" in fams[name].documentation
        assert [s.labels for s in fams[name].samples] == [{"worker": "0"}, {"worker": "1"}]
    assert [s.value for s in fams["ztunnel_worker_connections_opened"].samples] == [1, 2]
    assert [s.value for s in fams["ztunnel_worker_sockets_open"].samples] == [1, 2]
    assert all(s.value > 0 for s in fams["ztunnel_worker_cpu_seconds"].samples)


def test_label_sets_are_pickled_once() -> None:
    """A connection's four families share one label tuple: the snapshot crosses the channel with each label set
    once, not once per family (27 labels of up to 253 characters each)."""
    reg, traffic, _ = worker_registry("1.0")
    for i in range(200):
        w = Workload(uid=f"u{i}", name=f"server-{i}", namespace="default", workload_name=f"server-{i}")
        traffic.close(
            traffic.open(traffic_labels("source", SRC, None, w, SVC, True, ResponseFlag.NONE)), 1, 1, ResponseFlag.NONE
        )
    snap = snapshot(reg)
    opened = [f for f in snap.families if f.name == "istio_tcp_connections_opened"]
    alone = len(pickle.dumps(Snapshot(tuple(opened))))
    assert len(pickle.dumps(snap)) < 1.5 * alone


async def test_stats_server_serves_what_collect_returns(tmp_path: Path) -> None:
    """The control process's 15020: the merged families of two workers, over real HTTP."""
    control = Registry("1.0")
    merger = MetricsMerger()
    for i in range(2):
        reg, traffic, dns = worker_registry("1.0")
        data_path_traffic(traffic, dns)
        merger.update(i, snapshot(reg))

    async def collect() -> list[Metric]:
        return merger.families(snapshot(control))

    server = StatsServer(control, collect)
    await server.start(SocketAddress("127.0.0.1", 0))
    try:
        assert server.address is not None
        host, port = server.address

        def scrape() -> str:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
                return str(resp.read().decode())

        text = await asyncio.to_thread(scrape)
    finally:
        await server.stop()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.value for s in fams["istio_tcp_connections_opened"].samples] == [4, 2]
    assert [s.value for s in fams["istio_dns_requests"].samples] == [2, 2]
    assert [s.value for s in fams["ztunnel_worker_connections_opened"].samples] == [3, 3]


# -- properties ------------------------------------------------------------------------------------------------------

NAMES = ["a", "b", "c", "d", "e"]
KINDS = ["counter", "gauge", "histogram"]
LABELSETS: list[tuple[tuple[str, str], ...]] = [(), (("x", "1"),), (("x", "2"), ("y", "z")), (("y", "z"), ("x", "2"))]
values = st.integers(min_value=0, max_value=10**6).map(float)


@st.composite
def snapshots(draw: st.DrawFn, names: list[str] | None = None) -> Snapshot:
    """A snapshot over the shared schema (family ``n`` has kind KINDS[i % 3] everywhere): random families present,
    in the schema's order, each with random label sets and values."""
    chosen = names if names is not None else draw(st.lists(st.sampled_from(NAMES), unique=True))
    fams = []
    for name in sorted(chosen, key=NAMES.index):
        kind = KINDS[NAMES.index(name) % 3]
        sample = name + "_total" if kind == "counter" else name + "_sum" if kind == "histogram" else name
        sets = draw(st.lists(st.sampled_from(LABELSETS), unique=True))
        samples = tuple((sample, labels, draw(values)) for labels in sets)
        fams.append(FamilySnapshot(name, f"help of {name}", kind, "", samples))
    return Snapshot(tuple(fams), pid=draw(st.integers(1, 5)), cpu_seconds=draw(values))


def table(metrics: Iterable[Metric]) -> dict[tuple[str, str, tuple[tuple[str, str], ...]], float]:
    return {(m.name, s.name, tuple(s.labels.items())): s.value for m in metrics for s in m.samples}


def snap_table(snap: Snapshot) -> dict[tuple[str, str, tuple[tuple[str, str], ...]], float]:
    return {(f.name, n, labels): v for f in snap.families for n, labels, v in f.samples}


@given(snapshots())
@settings(max_examples=100)
def test_merge_of_one_snapshot_is_that_snapshot(snap: Snapshot) -> None:
    expected = [(f.name, f.help, f.kind, list(f.samples)) for f in snap.families]
    for merged in (merge(snap, {}, per_worker=False), merge(EMPTY, {7: snap}, per_worker=False)):
        got = [
            (m.name, m.documentation, m.type, [(s.name, tuple(s.labels.items()), s.value) for s in m.samples])
            for m in merged
        ]
        assert got == expected


@given(
    snapshots(),
    st.dictionaries(st.integers(0, 3), snapshots(), max_size=4),
    st.dictionaries(st.integers(0, 3), snapshots(), max_size=4),
)
@settings(max_examples=100)
def test_merge_sums(control: Snapshot, live: dict[int, Snapshot], dead: dict[int, Snapshot]) -> None:
    """Every merged series is the sum of its sources: counters and histograms over control, live and retained;
    gauges over control and live only. No series of a source is lost; none appears from nowhere."""
    retained = {i: retain(None, s) for i, s in dead.items()}
    merged = table(merge(control, live, retained, per_worker=False))
    expected: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    for source, keep in (
        (control, KINDS),
        *((s, KINDS) for s in live.values()),
        *((s, ["counter", "histogram"]) for s in dead.values()),
    ):
        for f in source.families:
            if f.kind in keep:
                for n, labels, v in f.samples:
                    expected[(f.name, n, labels)] = expected.get((f.name, n, labels), 0.0) + v
    assert merged == expected
    # Order: every family keeps the order it has in each source (none missing, none twice).
    order = [m.name for m in merge(control, live, retained, per_worker=False)]
    for source in (control, *live.values(), *retained.values()):
        names = [f.name for f in source.families]
        assert [n for n in order if n in names] == names
    assert len(order) == len(set(order))


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["count", "poll", "die"]),
            st.integers(0, 1),
            st.sampled_from(LABELSETS[:3]),
            st.integers(1, 100),
        ),
        max_size=40,
    )
)
@settings(max_examples=100)
def test_restarts_never_lose_or_lower_a_counter(
    events: list[tuple[str, int, tuple[tuple[str, str], ...], int]],
) -> None:
    """Two workers count, are polled and die (and come back as new processes) in any order: after every poll the
    merged counters equal what the workers had counted up to their last poll, never go down, keep every series;
    the gauge is the sum of the live workers' last polled values."""
    pids = iter(range(1000, 2000))

    def fresh() -> tuple[Registry, Family, Family, int]:
        reg = Registry("1.0")
        return reg, reg.family("requests", "r (unstable)"), reg.family("open", "o (unstable)", "gauge"), next(pids)

    workers = {i: fresh() for i in range(2)}
    polled_total: dict[tuple[tuple[str, str], ...], float] = {}
    counted_since_poll: dict[int, dict[tuple[tuple[str, str], ...], float]] = {0: {}, 1: {}}
    gauges = {0: 0.0, 1: 0.0}
    merger = MetricsMerger()
    previous: dict[tuple[tuple[str, str], ...], float] = {}
    for op, i, labels, n in events:
        reg, requests, open_, pid = workers[i]
        if op == "count":
            requests.child(labels).value += n
            open_.child().value += 1
            counted_since_poll[i][labels] = counted_since_poll[i].get(labels, 0.0) + n
            continue
        if op == "poll":
            snap = snapshot(reg)
            merger.update(i, Snapshot(snap.families, pid, snap.cpu_seconds))
            for lb, v in counted_since_poll[i].items():
                polled_total[lb] = polled_total.get(lb, 0.0) + v
            counted_since_poll[i] = {}
            gauges[i] = open_.child().value
        else:  # die: what it counted since its last poll is lost; a new process takes its index
            merger.exited(i)
            counted_since_poll[i] = {}
            gauges[i] = 0.0
            workers[i] = fresh()
        merged = {m.name: m for m in merger.families(EMPTY)}
        now = {tuple(s.labels.items()): s.value for s in merged["requests"].samples} if "requests" in merged else {}
        assert now == polled_total
        for lb, v in previous.items():
            assert now[lb] >= v
        previous = now
        live_gauge = sum(s.value for s in merged["open"].samples) if "open" in merged else 0.0
        assert live_gauge == sum(gauges[w] for w in merger.live)


@given(st.lists(st.lists(st.sampled_from(NAMES), unique=True), max_size=5), st.permutations(NAMES))
@settings(max_examples=200)
def test_family_order_keeps_every_list_order(lists: list[list[str]], global_order: list[str]) -> None:
    """Any lists: every name once. Lists that follow one order (one program's families): each keeps its order."""
    out = family_order(lists)
    assert sorted(out) == sorted({n for names in lists for n in names})
    agreeing = [sorted(names, key=global_order.index) for names in lists]
    out = family_order(agreeing)
    for names in agreeing:
        assert [n for n in out if n in names] == names

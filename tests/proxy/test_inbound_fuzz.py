"""CONNECT authorities and headers at the inbound (15008) fuzzed: ``parse_authority``, ``build_inbound_request``
and a live node answering fuzzed CONNECTs over real HBONE (mTLS + HTTP/2) from a client with a valid certificate.

Authorities are built from parts, valid and not: IPv4 and IPv6 (bracketed, bare, IPv4-mapped, with a zone), service
hostnames, unicode and junk hosts; ports in and out of range, signed, with leading zeros, in non-ASCII digits, and
thousands of digits long; plus random text. Headers: ``forwarded`` (``for=...;host=...`` with quoting, case and
spacing variants), ``baggage``, ``traceparent`` and arbitrary others.

Properties: ``parse_authority`` returns an address or raises ``ValueError`` naming the authority; round trips hold
for every valid address; ``build_inbound_request`` returns a request or rejects with 400 (the request is malformed)
or 503 (nothing to connect to), with a message; the reported service is one that selects the workload, whatever
the ``forwarded`` host says. Live: every CONNECT is answered 200/400/401/503 (or the stream or connection is reset
for headers HTTP/2 forbids), the same status as the pure function predicts when the authority is malformed,
access-log lines stay one line each, and the node keeps answering a good CONNECT.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import LIVE_TIMEOUT, AppThread, fuzz_settings
from ztunnel.config import WorkloadInfo
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.net import format_addr
from ztunnel.proxy.common import forwarded_header
from ztunnel.proxy.hbone.core import ErrorCode
from ztunnel.proxy.inbound import InboundRejected, build_inbound_request, parse_authority, parse_forwarded_host
from ztunnel.proxy.inputs import ProxyInputs
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import Service
from ztunnel.state.workload import InboundProtocol, NamespacedHostname, NetworkAddress, Workload
from ztunnel.telemetry import JsonFormatter, PlainFormatter
from ztunnel.testing import EchoServer, hbone_dial, hbone_request, node_env

# -- authorities ---------------------------------------------------------------------------------------------------

NODE_IP = "127.0.48.1"
SVC_HOST = "echo.default.svc.cluster.local"

ipv4s = st.one_of(st.just(NODE_IP), st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n))))
ipv6s = st.one_of(
    st.just(f"::ffff:{NODE_IP}"),
    st.sampled_from(["::1", "fd00::1", "::", "fe80::1%eth0", "fe80::1%25"]),
    st.integers(0, 2**128 - 1).map(lambda n: str(ipaddress.IPv6Address(n))),
)
hosts = st.one_of(
    ipv4s,
    ipv6s.map(lambda v6: f"[{v6}]"),
    ipv6s,  # bare: ambiguous with the port
    st.sampled_from([SVC_HOST, "nosuch.default.svc.cluster.local", "localhost", "a_b", "-", ".", "bücher.example"]),
    st.sampled_from(["[1.2.3.4]", "[]", "[::1", "::1]", "[[::1]]", "01.2.3.4", "1.2.3.4.5", " 1.2.3.4", "1.2.3.4 "]),
    st.text(max_size=12),
)
ports = st.one_of(
    st.integers(0, 65535).map(str),
    st.sampled_from(["8080", "80", "15008", "15001", "65536", "99999", "-1", "+80", "0080", "000008080", "", " 80"]),
    st.sampled_from(["²", "٨٠", "\uff18\uff10", "1e3", "0x50", "9" * 5000]),  # superscript, Arabic, fullwidth
    st.text(max_size=6),
)
authorities = st.one_of(st.builds(lambda h, p: f"{h}:{p}", hosts, ports), hosts, st.text(max_size=30))


def canonical(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Any:
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


@fuzz_settings(3000)
@given(authorities)
def test_parse_authority_any_text(authority: str) -> None:
    try:
        host, port = parse_authority(authority)
    except ValueError as e:
        assert str(e).startswith(f"invalid authority {repr(authority)[:50]}"), e
        assert len(str(e)) < 500
        return
    assert 0 <= port <= 65535
    if isinstance(host, str):
        assert host.isascii() and host and ":" not in host
    else:
        assert not (isinstance(host, ipaddress.IPv6Address) and (host.ipv4_mapped or host.scope_id))
        # What parsed as an address prints back as one (modulo IPv4-mapped and leading zeros of the port).
        assert parse_authority(format_addr(host, port)) == (host, port)


@fuzz_settings(1000)
@given(
    st.one_of(
        st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address),
        st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address),
    ),
    st.integers(0, 65535),
)
def test_every_socket_address_round_trips(ip: Any, port: int) -> None:
    assert parse_authority(format_addr(ip, port)) == (canonical(ip), port)


# -- build_inbound_request -----------------------------------------------------------------------------------------

LOCAL = Workload(
    uid="Kubernetes//v1/Pod/default/echo",
    name="echo",
    namespace="default",
    service_account="echo",
    workload_ips=(ipaddress.IPv4Address(NODE_IP),),
    protocol=InboundProtocol.HBONE,
    services={NamespacedHostname("default", SVC_HOST): {80: 8080}},
)
SVC = Service(
    name="echo",
    namespace="default",
    hostname=SVC_HOST,
    vips=(NetworkAddress("", ipaddress.IPv4Address("127.0.48.10")),),
    ports={80: 8080},
)


def fake_inputs() -> ProxyInputs:
    state = ProxyState()
    state.apply(StateUpdate(workloads=[LOCAL], services=[SVC]))
    local = SimpleNamespace(
        find=lambda: state.workloads.find_uid(LOCAL.uid), info=WorkloadInfo("echo", "default", "echo")
    )
    config = SimpleNamespace(illegal_ports={15001, 15006, 15008, 15080}, network="")
    return cast(ProxyInputs, SimpleNamespace(local=local, state=state, config=config))


PI = fake_inputs()

forwarded_values = st.one_of(
    st.builds(
        lambda ip, port, host: forwarded_header((ipaddress.ip_address(ip), port), host),
        st.sampled_from(["10.0.0.1", "fd00::1"]),
        st.integers(0, 65535),
        st.one_of(st.none(), st.sampled_from([SVC_HOST, "other.ns.svc.cluster.local"]), st.text(max_size=10)),
    ),
    st.lists(
        st.sampled_from(
            ['for="10.0.0.1:80"', f"host={SVC_HOST}", f'HOST="{SVC_HOST}"', "host=", "host", ";", " ", "=", '"']
        ),
        max_size=5,
    ).map(";".join),
    st.text(max_size=30),
)
header_maps = st.fixed_dictionaries(
    {},
    optional={
        "forwarded": forwarded_values,
        "baggage": st.text(max_size=40),
        "traceparent": st.text(max_size=60),
        "x-forwarded-network": st.text(max_size=10),
    },
)
methods = st.one_of(st.just("CONNECT"), st.just("CONNECT"), st.sampled_from(["GET", "connect", "", "CONNECT "]))
live_methods = st.one_of(
    st.just("CONNECT"), st.just("CONNECT"), st.just("CONNECT"), st.sampled_from(["GET", "connect"])
)


@fuzz_settings(2000)
@given(methods, authorities, header_maps)
def test_build_inbound_request_accepts_or_rejects_with_a_status(
    method: str, authority: str, headers: dict[str, str]
) -> None:
    conn_dst = ipaddress.IPv4Address(NODE_IP)
    try:
        req = build_inbound_request(PI, method, authority, conn_dst, headers)
    except InboundRejected as e:
        assert e.status in (400, 503) and e.args[0], e
        if method != "CONNECT":
            assert e.status == 400
        return
    assert method == "CONNECT"
    assert req.upstream[0] == conn_dst and 0 <= req.upstream[1] <= 65535
    # Whatever the forwarded host says, only a service that selects the workload is reported for telemetry: the
    # one the header names, else the one whose target port this is.
    if parse_forwarded_host(headers.get("forwarded", "")) == SVC_HOST or req.upstream[1] == 8080:
        assert req.service is not None and req.service.hostname == SVC_HOST
    else:
        assert req.service is None


@fuzz_settings(500)
@given(
    st.integers(0, 65535),
    st.sampled_from([SVC_HOST, "other.ns.svc.cluster.local"]),
    st.sampled_from([8080, 80, 9090, 1]),
)
def test_forwarded_host_names_only_services_of_the_destination(src_port: int, host: str, port: int) -> None:
    headers = {"forwarded": forwarded_header((ipaddress.IPv4Address("10.0.0.1"), src_port), host)}
    req = build_inbound_request(PI, "CONNECT", f"{NODE_IP}:{port}", ipaddress.IPv4Address(NODE_IP), headers)
    if host == SVC_HOST or port == 8080:  # named by the header, or by the port
        assert req.service is not None and req.service.hostname == SVC_HOST
    else:
        assert req.service is None


# -- a live 15008 --------------------------------------------------------------------------------------------------

CONFIG = f"""
workloads:
- uid: Kubernetes//v1/Pod/default/echo
  name: echo
  namespace: default
  serviceAccount: echo
  workloadIps: ["{NODE_IP}"]
  protocol: HBONE
  node: node-inbound-fuzz
  services:
    "default/{SVC_HOST}":
      80: 8080
services:
- name: echo
  namespace: default
  hostname: {SVC_HOST}
  vips: ["/127.0.48.10"]
  ports:
    80: 8080
policies:
- name: deny-8081
  namespace: default
  scope: Namespace
  action: Deny
  rules: [[[{{destinationPorts: [8081]}}]]]
"""
CLIENT_ID = Identity("cluster.local", "default", "client")
BATCH = 10


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AppThread, Any]]:
    tmp: Path = tmp_path_factory.mktemp("inbound-fuzz")
    cfg = tmp / "inbound.yaml"
    cfg.write_text(CONFIG)
    env = node_env("node-inbound-fuzz", NODE_IP, "default/echo/echo", tmp / "ca", config=cfg)
    with AppThread(env) as node:
        echo = node.call(EchoServer().start(NODE_IP, 8080))
        cert = LocalCA.load_or_create(tmp / "ca", "cluster.local").issue(CLIENT_ID, timedelta(hours=1))
        try:
            yield node, cert
        finally:
            node.call(echo.stop())


async def dial(cert: Any) -> Any:
    """An HBONE client connection without ``hbone_dial``'s 50 ms wait for the server's verdict on our certificate
    (a rejection shows up as a reset here, and this test dials hundreds of times)."""
    return await hbone_dial((NODE_IP, 15008), cert, settle=0)


async def send_batch(cert: Any, batch: list[tuple[str, str, list[tuple[str, str]]]]) -> list[int | str]:
    """Each request on one HBONE connection (a fresh one after the server closed it); the status, or why not."""
    out: list[int | str] = []
    conn: Any = None
    for method, authority, headers in batch:
        if conn is None or conn.closed:
            conn = await dial(cert)
        try:
            status, stream = await hbone_request(conn, authority, method=method, headers=headers)
        except ConnectionResetError as e:
            out.append(f"reset: {e}")
            continue
        except Exception as e:  # h2 refusing to even send it (our client is not the subject)
            if type(e).__module__.startswith("h2") or isinstance(e, UnicodeError):
                out.append(f"unsendable: {e}")
                conn.abort("unsendable request")
                conn = None
                continue
            raise
        out.append(status)
        if status == 200:
            stream.reset(ErrorCode.CANCEL)  # type: ignore[attr-defined]
    if conn is not None:
        conn.close("done")
    return out


async def good_connect(cert: Any) -> bytes:
    conn: Any = await dial(cert)
    try:
        status, _ = await hbone_request(conn, f"{NODE_IP}:8080")
        assert status == 200
    finally:
        conn.close("done")
    return b"ok"


header_names = st.one_of(
    st.sampled_from(["forwarded", "baggage", "traceparent", "x-forwarded-network", "x-any"]),
    st.text("abcxyz-_ABC:\n", min_size=1, max_size=8),
)
# Headers HTTP/2 forbids (uppercase names, newlines) cost the whole connection, and a new TLS handshake: a few.
header_lists = st.one_of(
    st.builds(lambda d: list(d.items()), header_maps.map(lambda d: {k: v.strip() for k, v in d.items()})),
    st.builds(lambda d: list(d.items()), header_maps),
    st.lists(st.tuples(header_names, st.text(max_size=20)), max_size=3),
)

# The live node only ever connects to the address the client dialled (itself), so any authority is safe to send;
# the good ones are drawn often enough to reach the 200 path.
live_authorities = st.one_of(
    st.just(f"{NODE_IP}:8080"),
    st.just(f"[::ffff:{NODE_IP}]:8080"),
    st.just(f"{SVC_HOST}:80"),
    st.just(f"{NODE_IP}:9"),  # nothing listens: 503
    st.just(f"{NODE_IP}:8081"),  # denied by policy: 401
    authorities,
)


@pytest.mark.timeout(LIVE_TIMEOUT)
def test_live_inbound_answers_fuzzed_connects(live: tuple[AppThread, Any], caplog: pytest.LogCaptureFixture) -> None:
    node, cert = live
    seen: dict[str, int] = {}

    @fuzz_settings(100)
    @given(st.lists(st.tuples(live_methods, live_authorities, header_lists), min_size=BATCH, max_size=BATCH))
    def run(batch: list[tuple[str, str, list[tuple[str, str]]]]) -> None:
        results = node.call(send_batch(cert, batch), 60)
        for (method, authority, _), result in zip(batch, results, strict=True):
            kind = str(result) if isinstance(result, int) else result.split(":")[0]
            seen[kind] = seen.get(kind, 0) + 1
            if isinstance(result, int):
                assert result in (200, 400, 401, 503), result
                try:
                    parse_authority(authority)
                    malformed = method != "CONNECT"
                except ValueError:
                    malformed = True
                if malformed:
                    assert result == 400, (method, authority, result)
        assert node.call(good_connect(cert)) == b"ok"

    with caplog.at_level(logging.INFO):
        run()
    assert all(seen.get(status, 0) >= 3 for status in ("200", "400", "401", "503")), sorted(seen.items())
    assert not node.errors, node.errors
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert not tracebacks, tracebacks
    # Whatever a peer put in its headers, every log line stays one line (plain) or one JSON object. (Except the
    # HTTP/2 layer's protocol-error warning: see test_h2_protocol_error_warning_is_one_line.)
    for r in caplog.records:
        if r.name != "ztunnel.proxy.h2":
            assert "\n" not in PlainFormatter().format(r), PlainFormatter().format(r)
        json.loads(JsonFormatter().format(r))


# Found by fuzzing: h2's ProtocolError text quotes the raw illegal character, so a peer's newline split the line.
def test_h2_protocol_error_warning_is_one_line(live: tuple[AppThread, Any], caplog: pytest.LogCaptureFixture) -> None:
    node, cert = live
    with caplog.at_level(logging.WARNING, logger="ztunnel.proxy.h2"):
        results = node.call(send_batch(cert, [("CONNECT", f"{NODE_IP}:8080", [("baggage", "a\nforged line")])]))
    assert results[0] != 200
    lines = [PlainFormatter().format(r) for r in caplog.records if r.name == "ztunnel.proxy.h2"]
    assert lines and all("\n" not in line for line in lines), lines


# -- regressions found by the fuzzing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("authority", "message"),
    [
        # "²".isdigit() is true and int() refused it: a ValueError that did not name the authority.
        ("1.2.3.4:²", "invalid authority '1.2.3.4:²': port '²' is not a number from 0 to 65535"),
        # Arabic-Indic digits were accepted as port 80.
        ("1.2.3.4:٨٠", "port '٨٠' is not a number"),
        # 5,000 digits: int() raised "Exceeds the limit (4300 digits)", and the message echoed all of them.
        ("1.2.3.4:" + "9" * 5000, "invalid authority '1.2.3.4:999"),
        # ipaddress's own message, without the authority.
        ("[zz]:80", "invalid authority '[zz]:80': '[zz]' is not an IPv6 address"),
        ("[1.2.3.4]:80", "'[1.2.3.4]' is not an IPv6 address"),
        # Accepted: an unbracketed IPv6 address (is "::1:80" the address ::1:80?), a zone, a non-ASCII host.
        ("::1:80", "host '::1' is not an IP address or a hostname"),
        ("[fe80::1%eth0]:80", "host '[fe80::1%eth0]' is not an IP address or a hostname"),
        ("bücher.example:80", "host 'bücher.example' is not an IP address or a hostname"),
    ],
)
def test_authority_regressions(authority: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^invalid authority") as e:
        parse_authority(authority)
    assert message in str(e.value)
    assert len(str(e.value)) < 400


def test_ipv4_mapped_authority_is_the_ipv4_address() -> None:
    assert parse_authority(f"[::ffff:{NODE_IP}]:8080") == (ipaddress.IPv4Address(NODE_IP), 8080)

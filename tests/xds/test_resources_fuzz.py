"""xDS resources fuzzed: conversion, the delta ADS core with the real handlers, and a live client over gRPC.

Inputs: ``Address`` and ``Authorization`` messages built from their descriptors with every field free to take any
value its type allows (unknown enum numbers, 5-byte IPs, ports above 65535, prefix lengths past the address, keys
without a ``/``), the same messages serialized and mutated at the byte level, and random bytes.

Properties:

* conversion gives a model value or a :class:`ConversionError` whose field path exists in the schema;
* whatever converted can be stored, and the proxies' uses of the state (address and hostname lookups, outbound
  decisions, policy evaluation) answer or refuse with their own errors, never crash;
* :class:`DeltaAdsState` never raises on a response; it NACKs exactly when something was rejected, naming every
  rejected resource with a reason (bytes that do not decode: the field path and byte offset); rejected resources
  change nothing in the state and are not recorded as held;
* live, over the real gRPC control plane: the client NACKs what it must, with that message, keeps the last good
  state and keeps applying good pushes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import random
import re
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import LIVE_TIMEOUT, fuzz_settings, mutated, protobufs
from xds.envoy.service.discovery.v3 import discovery_pb2 as pb
from xds.istio.security import authorization_pb2 as sec
from xds.istio.workload import workload_pb2 as wl
from ztunnel.config import from_env
from ztunnel.proxy.common import ProxyError
from ztunnel.proxy.outbound import build_request
from ztunnel.rbac import Connection
from ztunnel.readiness import Readiness
from ztunnel.standins.istiod.server import XdsServer
from ztunnel.state import ProxyState, StateUpdate
from ztunnel.state.service import Service
from ztunnel.state.upstream import UpstreamError
from ztunnel.state.workload import NetworkAddress, Workload
from ztunnel.testing.control_plane import control_plane, ztunnel_env
from ztunnel.xds.client import AdsClient, DeltaAdsState, XdsSignal, build_node
from ztunnel.xds.types import (
    ADDRESS_TYPE,
    AUTHORIZATION_TYPE,
    ConversionError,
    address_from_xds,
    authorization_from_xds,
)
from ztunnel.xds.updater import AddressHandler, AuthorizationHandler

T = TypeVar("T")

# -- inputs --------------------------------------------------------------------------------------------------------

strings = st.one_of(
    st.sampled_from(
        [
            "",
            "fz",
            "fz/a.fz.svc.cluster.local",
            "a.fz.svc.cluster.local",
            "Kubernetes//v1/Pod/fz/a",
            "cluster.local",
            "net1",
            "spiffe://cluster.local/ns/fz/sa/a",
            "no-slash",
        ]
    ),
    st.text(max_size=12),
)
blobs = st.one_of(
    st.binary(min_size=4, max_size=4),
    st.binary(min_size=16, max_size=16),
    st.sampled_from([b"\x0a\x00\x00\x01", b"\x7f\x00\x00\x01", b"\0" * 10 + b"\xff\xff\x0a\x00\x00\x02"]),
    st.binary(max_size=20),
)
addresses = protobufs(wl.Address, strings, blobs)
authorizations = protobufs(sec.Authorization, strings, blobs)


def _field_names(descriptor: Any, seen: set[str] | None = None, out: set[str] | None = None) -> set[str]:
    seen, out = seen if seen is not None else set(), out if out is not None else set()
    if descriptor.full_name in seen:
        return out
    seen.add(descriptor.full_name)
    out |= {f.name for f in descriptor.fields} | {o.name for o in descriptor.oneofs}
    for f in descriptor.fields:
        if f.message_type is not None:
            _field_names(f.message_type, seen, out)
    return out


SCHEMA_FIELDS = _field_names(wl.Address.DESCRIPTOR) | _field_names(sec.Authorization.DESCRIPTOR)


def check_error(e: ConversionError) -> None:
    assert e.field and e.problem, e
    # Drop the [index] and [key] parts (a key is a repr, quoted either way), then every name must be a field.
    segments = re.sub(r"\[.*?\](?=\.|\[|$)", "", e.field).split(".")
    assert all(s in SCHEMA_FIELDS for s in segments), (e.field, str(e))


# -- conversion and what the proxies do with the result ------------------------------------------------------------


def exercise(state: ProxyState) -> None:
    """Use the state the way the proxies do; their own refusals are fine, anything else raised fails the test."""
    rng = random.Random(0)
    targets: list[NetworkAddress] = [NetworkAddress(w.network, ip) for w in state.workloads for ip in w.workload_ips]
    targets += [vip for s in state.services for vip in s.vips]
    for w in list(state.workloads)[:5]:
        for t in targets[:8]:
            state.find_address(t, w.namespace)
            for port in (80, 8080):
                with contextlib.suppress(ProxyError, UpstreamError):
                    build_request(state, w, t.address, (t.address, port), t.network, rng)
            conn = Connection(t.address, 1234, t.address, 80, w.identity, w.network)
            state.policies.plan(w.namespace, w.authorization_policies).evaluate(conn)
    for s in state.services:
        state.find_service_by_hostname(s.hostname, s.namespace)


@fuzz_settings(400)
@given(st.lists(addresses, min_size=1, max_size=4), st.lists(authorizations, max_size=2))
def test_converted_resources_are_stored_and_used_or_named(
    items: list[wl.Address], policies: list[sec.Authorization]
) -> None:
    update = StateUpdate()
    for msg in items:
        try:
            out = address_from_xds(msg)
        except ConversionError as e:
            check_error(e)
            continue
        if isinstance(out, Workload):
            update.workloads.append(out)
        else:
            assert isinstance(out, Service)
            update.services.append(out)
    for p in policies:
        try:
            update.policies.append(authorization_from_xds(p))
        except ConversionError as e:
            check_error(e)
    state = ProxyState()
    state.apply(update)
    exercise(state)


payload_sources = st.one_of(
    st.binary(max_size=60),
    addresses.map(lambda m: m.SerializeToString()),
    mutated(addresses.map(lambda m: m.SerializeToString()), max_ops=3),
)


@fuzz_settings(1000)
@given(payload_sources)
def test_address_bytes_decode_and_convert_or_say_where(data: bytes) -> None:
    from ztunnel.xds.wire import describe_decode_error

    try:
        msg = wl.Address.FromString(data)
    except DecodeError:
        where = describe_decode_error(wl.Address, data)
        assert where is not None and " at byte " in where
        return
    try:
        address_from_xds(msg)
    except ConversionError as e:
        check_error(e)


# -- the delta ADS core with the real handlers ---------------------------------------------------------------------

NAMES = ["Kubernetes//v1/Pod/fz/a", "Kubernetes//v1/Pod/fz/b", "fz/a.fz.svc.cluster.local", "fz/p", "x"]


@st.composite
def resources(draw: st.DrawFn, type_url: str) -> pb.Resource:
    msgs = addresses if type_url == ADDRESS_TYPE else authorizations
    name = draw(st.one_of(st.sampled_from(NAMES), st.text(max_size=8)))
    r = pb.Resource(name=name, version=draw(st.sampled_from(["v1", "v2", ""])))
    r.aliases.extend(draw(st.lists(st.sampled_from(NAMES), max_size=2)))
    kind = draw(st.sampled_from(["message", "message", "mutated", "bytes", "none"]))
    if kind != "none":
        if kind == "message":
            value = draw(msgs).SerializeToString()
        elif kind == "mutated":
            value = draw(mutated(msgs.map(lambda m: m.SerializeToString()), max_ops=2))
        else:
            value = draw(st.binary(max_size=40))
        r.resource.CopyFrom(any_pb2.Any(type_url=type_url, value=value))
    return r


@st.composite
def responses(draw: st.DrawFn) -> pb.DeltaDiscoveryResponse:
    type_url = draw(st.sampled_from([ADDRESS_TYPE, ADDRESS_TYPE, AUTHORIZATION_TYPE, "type.googleapis.com/unknown"]))
    rtype = AUTHORIZATION_TYPE if type_url == AUTHORIZATION_TYPE else ADDRESS_TYPE
    return pb.DeltaDiscoveryResponse(
        type_url=type_url,
        nonce=draw(st.text(max_size=4)),
        resources=draw(st.lists(resources(rtype), max_size=4)),
        removed_resources=draw(st.lists(st.one_of(st.sampled_from(NAMES), st.text(max_size=8)), max_size=2)),
    )


def snapshot(state: ProxyState) -> tuple[dict[str, Any], dict[Any, Any], dict[str, Any]]:
    return dict(state.workloads.by_uid), dict(state.services.by_key), dict(state.policies.by_key)


@fuzz_settings(200)
@given(st.lists(responses(), min_size=1, max_size=5))
def test_delta_core_acks_or_nacks_every_response_and_keeps_good_state(seq: list[pb.DeltaDiscoveryResponse]) -> None:
    state = ProxyState()
    core = DeltaAdsState(build_node(from_env({})), [AddressHandler(state), AuthorizationHandler(state)])
    for resp in seq:
        before = snapshot(state)
        known_before = {t: dict(v) for t, v in core.known_resources.items()}
        handled = core.receive(resp)
        assert handled.reply.response_nonce == resp.nonce
        assert (handled.signal is XdsSignal.NACK) == bool(handled.rejected)
        if handled.rejected:
            detail = handled.error_detail or ""
            for r in handled.rejected:
                assert r.reason, r
                assert f"{r.name}: {r.reason}" in detail
                if r.reason.startswith("decode: "):
                    assert " at byte " in r.reason, r.reason
                # A rejected resource is not recorded as held (an earlier good version stays, unless removed).
                held_before = known_before.get(resp.type_url, {}).get(r.name)
                if r.name not in resp.removed_resources:
                    assert core.known_resources.get(resp.type_url, {}).get(r.name) == held_before
                else:
                    assert r.name not in core.known_resources.get(resp.type_url, {})
            rejected = {r.name for r in handled.rejected}
            if all(res.name in rejected for res in resp.resources) and not resp.removed_resources:
                assert snapshot(state) == before  # nothing applied: the last good state stands
        exercise(state)


# -- a live client against the real gRPC control plane -------------------------------------------------------------

CONFIG = """
workloads:
- uid: c1//v1/Pod/ns/a
  name: a
  namespace: ns
  serviceAccount: a
  workloadIps: ["10.0.0.1"]
  protocol: HBONE
  services: {"ns/svc.ns.svc.cluster.local": {80: 8080}}
services:
- name: svc
  namespace: ns
  hostname: svc.ns.svc.cluster.local
  vips: ["/10.96.0.1"]
  ports: {80: 8080}
policies:
- name: deny-9999
  namespace: ns
  scope: Namespace
  action: Deny
  rules: [[[{destinationPorts: [9999]}]]]
"""


class Live:
    """The control plane and one xDS client (feeding a ProxyState, as a ztunnel's) on their own loop thread."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="xds-fuzz", daemon=True)
        self.errors: list[dict[str, Any]] = []
        self.cp: XdsServer
        self.state = ProxyState()
        self.readiness = Readiness()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> Live:
        self.loop.set_exception_handler(lambda _loop, ctx: self.errors.append(ctx))
        self.thread.start()
        self._cp_ctx = control_plane(self.tmp, CONFIG)
        self.cp = self.call(self._cp_ctx.__aenter__())
        config = from_env({"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "ns/a/a", **ztunnel_env(self.cp)})
        self.client = AdsClient(
            config,
            [AddressHandler(self.state), AuthorizationHandler(self.state)],
            self.readiness.register("state manager"),
        )

        async def spawn() -> asyncio.Task[None]:
            return asyncio.get_running_loop().create_task(self.client.run(), name="xds client")

        self.task = self.call(spawn())
        self.wait(lambda: self.readiness.ready)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

        try:
            self.call(stop())
            self.call(self._cp_ctx.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()

    def wait(self, predicate: Any, timeout: float = 5) -> None:
        async def until() -> None:
            async with asyncio.timeout(timeout):
                while not predicate():
                    await asyncio.sleep(0.002)

        self.call(until(), timeout + 1)

    def push(self, raw: dict[str, bytes | None], type_url: str = ADDRESS_TYPE) -> None:
        async def push() -> None:
            for name, value in raw.items():
                self.cp.set_raw_resource(type_url, name, value)

        self.call(push())

    def held(self, type_url: str = ADDRESS_TYPE) -> dict[str, str]:
        return self.client.core.known_resources.get(type_url, {})


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with Live(tmp_path_factory.mktemp("xds-fuzz")) as node:
        yield node


def good_state(state: ProxyState) -> bool:
    a = state.workloads.find_uid("c1//v1/Pod/ns/a")
    return (
        a is not None
        and a.workload_ips == (ipaddress.ip_address("10.0.0.1"),)
        and state.services.get_best_by_vip(NetworkAddress("", ipaddress.ip_address("10.96.0.1")), None) is not None
        and state.policies.get("ns/deny-9999") is not None
    )


# Fuzzed contents never reuse the good config's keys, so the good state must survive every push untouched.
live_strings = strings.filter(lambda s: s not in ("ns", "c1//v1/Pod/ns/a"))
live_payloads = st.one_of(
    protobufs(wl.Address, live_strings, blobs).map(lambda m: m.SerializeToString()),
    mutated(protobufs(wl.Address, live_strings, blobs).map(lambda m: m.SerializeToString()), max_ops=2),
    st.binary(max_size=40),
)
live_policies = st.one_of(
    protobufs(sec.Authorization, live_strings, blobs).map(lambda m: m.SerializeToString()),
    st.binary(max_size=40),
)
_names = itertools.count()


@pytest.mark.timeout(LIVE_TIMEOUT)
def test_live_client_nacks_clearly_and_keeps_the_last_good_state(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    counts = {"acked": 0, "nacked": 0}

    def nacked(type_url: str, name: str) -> set[str]:
        """The NACK reasons given for ``name`` (names are unique per example; the server keeps the latest NACKs)."""
        prefix = f"{name}: "
        return {
            frag.removeprefix(prefix)
            for nack in list(live.cp.nacks)
            if nack.type_url == type_url
            for frag in nack.message.split("; ")
            if frag.startswith(prefix)
        }

    def settle(type_url: str, names: list[str]) -> None:
        def answered(name: str) -> bool:
            return name in live.held(type_url) or bool(nacked(type_url, name))

        try:
            live.wait(lambda: all(answered(n) for n in names))
        except TimeoutError:
            c = live.client
            raise AssertionError(
                f"not answered: {[n for n in names if not answered(n)]}; streams {c.connection_id}, "
                f"terminations {dict(c.terminations)}, last error {c.last_error!r}"
            ) from None

    @fuzz_settings(100)
    @given(st.lists(live_payloads, min_size=1, max_size=4), st.lists(live_policies, max_size=2))
    def run(payloads: list[bytes], policies: list[bytes]) -> None:
        n = next(_names)
        for type_url, batch in ((ADDRESS_TYPE, payloads), (AUTHORIZATION_TYPE, policies)):
            names = [f"fuzz-{n}-{i}" for i in range(len(batch))]
            live.push(dict(zip(names, batch, strict=True)), type_url)
            settle(type_url, names)
            for name in names:
                if name in live.held(type_url):
                    counts["acked"] += 1
                    continue
                counts["nacked"] += 1
                (reason,) = nacked(type_url, name)
                assert reason, name
                if reason.startswith("decode: "):
                    assert " at byte " in reason, reason
            assert good_state(live.state)
            # Withdraw them: the next example starts from the good config alone.
            live.push(dict.fromkeys(names), type_url)
            live.wait(lambda names=names, type_url=type_url: not any(n in live.held(type_url) for n in names))

    with caplog.at_level(logging.WARNING, logger="ztunnel"):
        run()
    assert counts["acked"] >= 3 and counts["nacked"] >= 3, counts
    # The stream never broke: one connection all along, and a good push still applies at once.
    assert live.client.connection_id == 1 and len(live.cp.sessions) == 1
    live.call(_set_config(live.cp, CONFIG.replace("10.0.0.1", "10.0.0.2")))
    live.wait(
        lambda: live.state.workloads.find_address(NetworkAddress("", ipaddress.ip_address("10.0.0.2"))) is not None
    )
    assert not live.errors, live.errors
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert not tracebacks, tracebacks


async def _set_config(cp: XdsServer, text: str) -> None:
    cp.set_config(text)


# -- regressions found by the fuzzing -------------------------------------------------------------------------------


def _core() -> tuple[ProxyState, DeltaAdsState]:
    state = ProxyState()
    return state, DeltaAdsState(build_node(from_env({})), [AddressHandler(state), AuthorizationHandler(state)])


def test_a_name_twice_in_one_response_is_rejected_whole() -> None:
    # Found: the first copy failed to decode (NACK), the second applied, and the name was not recorded as held:
    # the state changed under a NACK for that very name.
    state, core = _core()

    def policy(name: str) -> bytes:
        return sec.Authorization(name=name, namespace="fz", scope=sec.NAMESPACE, action=sec.DENY).SerializeToString()

    resp = pb.DeltaDiscoveryResponse(
        type_url=AUTHORIZATION_TYPE,
        nonce="1",
        resources=[
            pb.Resource(name="fz/p", resource=any_pb2.Any(type_url=AUTHORIZATION_TYPE, value=b"\x00")),
            pb.Resource(name="fz/p", resource=any_pb2.Any(type_url=AUTHORIZATION_TYPE, value=policy("p"))),
            pb.Resource(name="fz/q", resource=any_pb2.Any(type_url=AUTHORIZATION_TYPE, value=policy("q"))),
        ],
    )
    handled = core.receive(resp)
    assert handled.signal is XdsSignal.NACK
    assert handled.error_detail == "fz/p: duplicate resource name in one response"
    assert set(core.known_resources[AUTHORIZATION_TYPE]) == {"fz/q"}  # the other resource applies
    assert set(state.policies.by_key) == {"fz/q"}


def test_undecodable_resource_nack_says_where() -> None:
    # upb says only "Wire format was corrupt"; the NACK now names the field and byte.
    _, core = _core()
    resp = pb.DeltaDiscoveryResponse(
        type_url=ADDRESS_TYPE,
        nonce="1",
        resources=[pb.Resource(name="w", resource=any_pb2.Any(type_url=ADDRESS_TYPE, value=b"\x0a\x03\x22\x02\x01"))],
    )
    assert core.receive(resp).error_detail == (
        "w: decode: workload.network at byte 2: length 2 runs past the end of its message (1 left)"
    )

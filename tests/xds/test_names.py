# mypy: disable-error-code="import-untyped"
"""Full names, type URLs, enum values and gRPC method paths of the generated modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.protobuf.descriptor import EnumDescriptor

from xds.envoy.config.core.v3 import base_pb2 as core
from xds.envoy.service.discovery.v3 import discovery_pb2 as disc
from xds.envoy.service.discovery.v3 import discovery_pb2_grpc as disc_grpc
from xds.istio.security import authorization_pb2 as sec
from xds.istio.v1.auth import ca_pb2, ca_pb2_grpc
from xds.istio.workload import workload_pb2 as w
from xds.istio.workload.zds import zds_pb2 as zds

ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService"

GENERATED_MODULES = [
    "xds.envoy.config.core.v3.base_pb2",
    "xds.envoy.service.discovery.v3.discovery_pb2",
    "xds.envoy.service.discovery.v3.discovery_pb2_grpc",
    "xds.istio.security.authorization_pb2",
    "xds.istio.v1.auth.ca_pb2",
    "xds.istio.v1.auth.ca_pb2_grpc",
    "xds.istio.workload.workload_pb2",
    "xds.istio.workload.zds.zds_pb2",
]


@pytest.mark.parametrize("module", GENERATED_MODULES)
def test_generated_modules_import_from_repo_root(module: str) -> None:
    assert importlib.import_module(module).__name__ == module


@pytest.mark.parametrize(
    ("message", "full_name"),
    [
        (w.Address, "istio.workload.Address"),
        (w.Workload, "istio.workload.Workload"),
        (w.Service, "istio.workload.Service"),
        (w.GatewayAddress, "istio.workload.GatewayAddress"),
        (w.LoadBalancing, "istio.workload.LoadBalancing"),
        (sec.Authorization, "istio.security.Authorization"),
        (sec.Rule, "istio.security.Rule"),
        (sec.Clause, "istio.security.Clause"),
        (sec.Match, "istio.security.Match"),
        (sec.Address, "istio.security.Address"),
        (ca_pb2.IstioCertificateRequest, "istio.v1.auth.IstioCertificateRequest"),
        (ca_pb2.IstioCertificateResponse, "istio.v1.auth.IstioCertificateResponse"),
        (disc.DeltaDiscoveryRequest, "envoy.service.discovery.v3.DeltaDiscoveryRequest"),
        (disc.DeltaDiscoveryResponse, "envoy.service.discovery.v3.DeltaDiscoveryResponse"),
        (disc.DiscoveryRequest, "envoy.service.discovery.v3.DiscoveryRequest"),
        (disc.DiscoveryResponse, "envoy.service.discovery.v3.DiscoveryResponse"),
        (disc.Resource, "envoy.service.discovery.v3.Resource"),
        (core.Node, "envoy.config.core.v3.Node"),
        (zds.ZdsHello, "istio.workload.zds.ZdsHello"),
        (zds.WorkloadRequest, "istio.workload.zds.WorkloadRequest"),
        (zds.WorkloadResponse, "istio.workload.zds.WorkloadResponse"),
    ],
)
def test_full_names(message: Any, full_name: str) -> None:
    assert message.DESCRIPTOR.full_name == full_name


def test_type_urls() -> None:
    packed = any_pb2.Any()
    packed.Pack(w.Address(workload=w.Workload(uid="u")))
    assert packed.type_url == "type.googleapis.com/istio.workload.Address"
    packed.Pack(sec.Authorization(name="p"))
    assert packed.type_url == "type.googleapis.com/istio.security.Authorization"


def test_error_detail_is_google_rpc_status() -> None:
    for request in (disc.DeltaDiscoveryRequest, disc.DiscoveryRequest):
        message_type = request.DESCRIPTOR.fields_by_name["error_detail"].message_type
        assert message_type is not None
        assert message_type.full_name == "google.rpc.Status"


def _values(enum: EnumDescriptor) -> dict[str, int]:
    return {v.name: v.number for v in enum.values}


@pytest.mark.parametrize(
    ("enum", "expected"),
    [
        (w.TunnelProtocol.DESCRIPTOR, {"NONE": 0, "HBONE": 1, "LEGACY_ISTIO_MTLS": 2}),
        (w.NetworkMode.DESCRIPTOR, {"STANDARD": 0, "HOST_NETWORK": 1}),
        (w.WorkloadStatus.DESCRIPTOR, {"HEALTHY": 0, "UNHEALTHY": 1}),
        (w.WorkloadType.DESCRIPTOR, {"DEPLOYMENT": 0, "CRONJOB": 1, "POD": 2, "JOB": 3}),
        (w.IPFamilies.DESCRIPTOR, {"AUTOMATIC": 0, "IPV4_ONLY": 1, "IPV6_ONLY": 2, "DUAL": 3}),
        (w.AppProtocol.DESCRIPTOR, {"UNKNOWN": 0, "HTTP11": 1, "HTTP2": 2, "GRPC": 3, "TCP": 4, "TLS": 5}),
        (w.ApplicationTunnel.Protocol.DESCRIPTOR, {"NONE": 0, "PROXY": 1}),
        (w.Service.Visibility.DESCRIPTOR, {"PUBLIC": 0, "NAMESPACE": 1}),
        (
            w.LoadBalancing.Scope.DESCRIPTOR,
            {
                "UNSPECIFIED_SCOPE": 0,
                "REGION": 1,
                "ZONE": 2,
                "SUBZONE": 3,
                "NODE": 4,
                "CLUSTER": 5,
                "NETWORK": 6,
            },
        ),
        (
            w.LoadBalancing.Mode.DESCRIPTOR,
            {"UNSPECIFIED_MODE": 0, "STRICT": 1, "FAILOVER": 2, "PASSTHROUGH": 3},
        ),
        (w.LoadBalancing.HealthPolicy.DESCRIPTOR, {"ONLY_HEALTHY": 0, "ALLOW_ALL": 1}),
        (sec.Scope.DESCRIPTOR, {"GLOBAL": 0, "NAMESPACE": 1, "WORKLOAD_SELECTOR": 2}),
        (sec.Action.DESCRIPTOR, {"ALLOW": 0, "DENY": 1}),
        (zds.Version.DESCRIPTOR, {"NOT_USED": 0, "V1": 1}),
    ],
)
def test_enum_values(enum: EnumDescriptor, expected: dict[str, int]) -> None:
    assert _values(enum) == expected


def test_enum_full_names() -> None:
    assert w.TunnelProtocol.DESCRIPTOR.full_name == "istio.workload.TunnelProtocol"
    assert w.LoadBalancing.Scope.DESCRIPTOR.full_name == "istio.workload.LoadBalancing.Scope"
    assert sec.Scope.DESCRIPTOR.full_name == "istio.security.Scope"


class _RecordingChannel:
    """Stands in for grpc.Channel: records the method paths and codecs the generated stubs register."""

    def __init__(self) -> None:
        self.methods: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {}

    def _record(self, kind: str) -> Callable[..., object]:
        def register(
            path: str,
            request_serializer: Callable[..., Any],
            response_deserializer: Callable[..., Any],
            **_: object,
        ) -> object:
            self.methods[path] = (kind, request_serializer, response_deserializer)
            return object()

        return register

    def __getattr__(self, name: str) -> Callable[..., object]:
        if name in {"unary_unary", "unary_stream", "stream_unary", "stream_stream"}:
            return self._record(name)
        raise AttributeError(name)


def test_ads_stub_method_paths() -> None:
    channel = _RecordingChannel()
    disc_grpc.AggregatedDiscoveryServiceStub(channel)
    assert channel.methods == {
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources": (
            "stream_stream",
            disc.DiscoveryRequest.SerializeToString,
            disc.DiscoveryResponse.FromString,
        ),
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources": (
            "stream_stream",
            disc.DeltaDiscoveryRequest.SerializeToString,
            disc.DeltaDiscoveryResponse.FromString,
        ),
    }


def test_ca_stub_method_path() -> None:
    channel = _RecordingChannel()
    ca_pb2_grpc.IstioCertificateServiceStub(channel)
    assert channel.methods == {
        "/istio.v1.auth.IstioCertificateService/CreateCertificate": (
            "unary_unary",
            ca_pb2.IstioCertificateRequest.SerializeToString,
            ca_pb2.IstioCertificateResponse.FromString,
        ),
    }


class _FakeCA(ca_pb2_grpc.IstioCertificateServiceServicer):
    def CreateCertificate(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.ServicerContext
    ) -> ca_pb2.IstioCertificateResponse:
        return ca_pb2.IstioCertificateResponse(cert_chain=[request.csr.upper(), "ROOT"])


class _FakeADS(disc_grpc.AggregatedDiscoveryServiceServicer):
    def DeltaAggregatedResources(
        self, requests: Iterator[disc.DeltaDiscoveryRequest], context: grpc.ServicerContext
    ) -> Iterator[disc.DeltaDiscoveryResponse]:
        for request in requests:
            yield disc.DeltaDiscoveryResponse(type_url=request.type_url, nonce=f"ack-{request.response_nonce}")


def test_servers_answer_on_the_upstream_paths() -> None:
    """Raw calls on the literal upstream paths reach the generated server registrations."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(_FakeCA(), server)
    disc_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_FakeADS(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            create = channel.unary_unary("/istio.v1.auth.IstioCertificateService/CreateCertificate")
            raw = create(ca_pb2.IstioCertificateRequest(csr="csr").SerializeToString(), timeout=10)
            assert ca_pb2.IstioCertificateResponse.FromString(raw).cert_chain == ["CSR", "ROOT"]

            delta = channel.stream_stream(
                "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
            )
            request = disc.DeltaDiscoveryRequest(type_url="t", response_nonce="1").SerializeToString()
            replies = list(delta(iter([request]), timeout=10))
            assert [disc.DeltaDiscoveryResponse.FromString(r).nonce for r in replies] == ["ack-1"]

            # The unimplemented SotW method is registered too (UNIMPLEMENTED, not an unknown path).
            sotw = channel.stream_stream(
                "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
            )
            with pytest.raises(grpc.RpcError) as info:
                list(sotw(iter([b""]), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert info.value.details() == "Method not implemented!"
    finally:
        server.stop(None)

from __future__ import annotations

import pytest

from ztunnel.config import (
    ConfigError,
    LogFormat,
    ProxyMode,
    RootCertKind,
    SocketAddress,
    WorkloadInfo,
    from_env,
    parse_duration,
    parse_socket_address,
)
from ztunnel.dns.forwarder import ResolvConf

DEDICATED = {"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "default/local/default"}


def test_defaults_match_upstream() -> None:
    c = from_env({})
    assert c.xds_address == "https://localhost:15012"
    assert c.ca_address == "https://localhost:15012"
    assert c.xds_root_cert.kind is RootCertKind.FILE_OR_INLINE
    assert c.xds_root_cert.value == "./var/run/secrets/istio/root-cert.pem"
    assert c.cluster_id == "Kubernetes"
    assert c.cluster_domain == "cluster.local"
    assert c.trust_domain == "cluster.local"
    assert c.fake_ca is False
    assert c.secret_ttl == 86400
    assert c.proxy_mode is ProxyMode.SHARED
    assert c.proxy_workload_info is None
    assert c.inpod_uds == "/var/run/ztunnel/ztunnel.sock"
    assert c.inpod_port_reuse is True
    assert c.packet_mark == 1337  # shared mode defaults the in-pod mark
    assert c.network == ""
    assert c.node_name is None
    assert c.enable_proxy is True
    assert c.dns_proxy is True
    assert c.socks5_enabled is False and c.socks5_addr is None
    assert (c.keepalive_time, c.keepalive_interval, c.keepalive_retries) == (180, 180, 9)
    assert c.keepalive_enabled is True and c.user_timeout_enabled is False
    assert c.pool_max_streams_per_connection == 100
    assert c.pool_unused_release_timeout == 300
    assert c.http2_stream_window_size == 4 * 1024 * 1024
    assert c.http2_connection_window_size == 16 * 1024 * 1024
    assert c.http2_frame_size == 1024 * 1024
    assert c.self_termination_deadline == 5
    assert c.localhost_app_tunnel is True
    assert c.enable_response_baggage is True
    assert c.tls12_enabled is False
    assert c.ipv6_enabled is True
    assert c.outbound_addr == SocketAddress("::", 15001)
    assert c.inbound_addr == SocketAddress("::", 15008)
    assert c.inbound_plaintext_addr == SocketAddress("::", 15006)
    assert c.admin_addr == SocketAddress("localhost", 15000)
    assert c.stats_addr == SocketAddress("::", 15020)
    assert c.readiness_addr == SocketAddress("::", 15021)
    assert c.dns_proxy_addr == SocketAddress("localhost", 15053)
    assert c.illegal_ports == {15001, 15006, 15008}
    assert c.log_level == "info" and c.log_format is LogFormat.PLAIN
    assert c.worker_threads == 2  # max(ceil(0.25 * 2), 0, 2)


def test_kubernetes_default_address() -> None:
    c = from_env({"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert c.xds_address == "https://istiod.istio-system.svc:15012"
    assert c.ca_address == "https://istiod.istio-system.svc:15012"


def test_every_variable_parsed() -> None:
    env = {
        **DEDICATED,
        "XDS_ADDRESS": "istiod.istio-system.svc:15012",
        "CA_ADDRESS": "https://ca:15012",
        "XDS_ROOT_CA": "SYSTEM",
        "CA_ROOT_CA": "-----BEGIN CERTIFICATE-----",
        "ALT_XDS_HOSTNAME": "istiod.alt",
        "ALT_CA_HOSTNAME": "ca.alt",
        "AUTH_TOKEN": "static-token",
        "XDS_HEADER_X-Tenant": "a",
        "CA_HEADER_Foo": "b",
        "CLUSTER_ID": "ignored-when-meta-set",
        "ISTIO_META_CLUSTER_ID": "cluster-7",
        "CLUSTER_DOMAIN": "corp.local",
        "TRUST_DOMAIN": "td.example",
        "NODE_NAME": "node-1",
        "NETWORK": "net-1",
        "SECRET_TTL": "12h",
        "INPOD_UDS": "/tmp/zds.sock",
        "INPOD_PORT_REUSE": "false",
        "PACKET_MARK": "4242",
        "POOL_MAX_STREAMS_PER_CONNECTION": "50",
        "POOL_UNUSED_RELEASE_TIMEOUT": "1m",
        "HTTP2_STREAM_WINDOW_SIZE": "1048576",
        "HTTP2_CONNECTION_WINDOW_SIZE": "2097152",
        "HTTP2_FRAME_SIZE": "65536",
        "KEEPALIVE_TIME": "30s",
        "KEEPALIVE_INTERVAL": "10s",
        "KEEPALIVE_RETRIES": "3",
        "KEEPALIVE_ENABLED": "false",
        "USER_TIMEOUT_ENABLED": "true",
        "TERMINATION_GRACE_PERIOD_SECONDS": "30",
        "UNSTABLE_ENABLE_SOCKS5": "true",
        "LOG_FORMAT": "json",
        "RUST_LOG": "access=debug,info",
        "ENABLE_ORIG_SRC": "true",
        "TLS12_ENABLED": "true",
        "ENABLE_RESPONSE_BAGGAGE": "false",
        "LOCALHOST_APP_TUNNEL": "false",
        "AUTHZ_POLICY_INFO_LOGGING": "true",
        "PREFERED_SERVICE_NAMESPACE": "istio-system",
        "ISTIO_META_DNS_PROXY_ADDR": "127.0.0.1:5353",
        "ISTIO_META_ISTIO_VERSION": "1.28.0",
        "ISTIO_METAJSON_LABELS": '{"app": "x"}',
        "INSTANCE_IP": "10.0.0.5",
        "POD_NAME": "ztunnel-abc",
        "POD_NAMESPACE": "istio-system",
        "SERVICE_ACCOUNT": "ztunnel",
    }
    c = from_env(env)
    assert c.xds_address == "https://istiod.istio-system.svc:15012"
    assert c.ca_address == "https://ca:15012"
    assert c.xds_root_cert.kind is RootCertKind.SYSTEM
    assert c.ca_root_cert.value == "-----BEGIN CERTIFICATE-----"
    assert (c.alt_xds_hostname, c.alt_ca_hostname) == ("istiod.alt", "ca.alt")
    assert c.auth.value == "static-token"
    assert c.xds_headers == (("x-tenant", "a"),)
    assert c.ca_headers == (("foo", "b"),)
    assert c.cluster_id == "cluster-7"
    assert c.cluster_domain == "corp.local"
    assert c.trust_domain == "td.example"
    assert c.node_name == "node-1" and c.network == "net-1"
    assert c.secret_ttl == 12 * 3600
    assert c.proxy_mode is ProxyMode.DEDICATED
    assert c.proxy_workload_info == WorkloadInfo(name="local", namespace="default", service_account="default")
    assert c.inpod_uds == "/tmp/zds.sock" and c.inpod_port_reuse is False
    assert c.packet_mark == 4242
    assert c.pool_max_streams_per_connection == 50 and c.pool_unused_release_timeout == 60
    assert (c.http2_stream_window_size, c.http2_connection_window_size, c.http2_frame_size) == (2**20, 2**21, 2**16)
    assert (c.keepalive_time, c.keepalive_interval, c.keepalive_retries) == (30, 10, 3)
    assert c.keepalive_enabled is False and c.user_timeout_enabled is True
    assert c.self_termination_deadline == 25  # 30 - 5, as the chart's default gives
    assert c.socks5_enabled and c.socks5_addr == SocketAddress("127.0.0.1", 15080)
    assert 15080 in c.illegal_ports
    assert c.log_format is LogFormat.JSON and c.log_level == "access=debug,info"
    assert c.enable_orig_src is True and c.tls12_enabled is True
    assert c.enable_response_baggage is False and c.localhost_app_tunnel is False
    assert c.crl_path is None
    assert c.warnings == ()
    assert c.authz_policy_info_logging is True
    assert c.prefered_service_namespace == "istio-system"
    assert c.dns_proxy_addr == SocketAddress("127.0.0.1", 5353)
    assert c.istio_version == "1.28.0"
    assert c.proxy_metadata["LABELS"] == {"app": "x"}
    assert c.proxy_metadata["CLUSTER_ID"] == "cluster-7"
    assert c.node_id == "ztunnel~10.0.0.5~ztunnel-abc.istio-system~istio-system.svc.cluster.local"
    assert str(c.ztunnel_identity) == "spiffe://td.example/ns/istio-system/sa/ztunnel"


def test_instance_ip_unset_or_empty_as_upstream() -> None:
    """Upstream's node id and INSTANCE_IPS take INSTANCE_IP as it is when set (even empty), 1.1.1.1 when unset."""
    from ztunnel.xds.client import build_node

    unset = from_env({"XDS_ADDRESS": "", "POD_NAME": "zt", "POD_NAMESPACE": "ns"})
    empty = from_env({"XDS_ADDRESS": "", "POD_NAME": "zt", "POD_NAMESPACE": "ns", "INSTANCE_IP": ""})
    assert unset.node_id == "ztunnel~1.1.1.1~zt.ns~ns.svc.cluster.local"
    assert empty.node_id == "ztunnel~~zt.ns~ns.svc.cluster.local"
    assert build_node(unset).metadata.fields["INSTANCE_IPS"].string_value == "1.1.1.1"
    assert build_node(empty).metadata.fields["INSTANCE_IPS"].string_value == ""
    assert build_node(empty).id == empty.node_id


def test_local_xds_and_on_demand() -> None:
    c = from_env({})
    assert (c.local_xds_path, c.local_xds, c.xds_on_demand) == (None, None, False)
    # A path is kept as given (the file is read by the xDS layer, not here: parsing does no I/O).
    c = from_env({"LOCAL_XDS_PATH": "examples/does-not-exist.yaml"})
    assert c.local_xds_path == "examples/does-not-exist.yaml" and c.local_xds is None
    inline = "workloads:\n- uid: a\n  name: a\n"
    c = from_env({"LOCAL_XDS": inline})
    assert c.local_xds == inline and c.local_xds_path is None
    assert from_env({"LOCAL_XDS_PATH": "", "LOCAL_XDS": ""}).local_xds_path is None  # empty means unset
    # On-demand xDS needs the DNS proxy off (upstream validate_config); then it parses.
    no_dns = {"ISTIO_META_DNS_CAPTURE": "false"}
    assert from_env({**no_dns, "XDS_ON_DEMAND": "true"}).xds_on_demand is True
    assert from_env({**no_dns, "XDS_ON_DEMAND": "false"}).xds_on_demand is False
    with pytest.raises(ConfigError, match="XDS_ON_DEMAND"):
        from_env({**no_dns, "XDS_ON_DEMAND": "on"})


@pytest.mark.parametrize(
    ("secs", "deadline"),
    [("30", 25), ("11", 6), ("10", 9), ("2", 1), ("1", 1), ("0", 1)],
)
def test_termination_grace_period(secs: str, deadline: float) -> None:
    assert from_env({"TERMINATION_GRACE_PERIOD_SECONDS": secs}).self_termination_deadline == deadline


def test_connection_termination_deadline_wins() -> None:
    c = from_env({"TERMINATION_GRACE_PERIOD_SECONDS": "30", "CONNECTION_TERMINATION_DEADLINE": "7s"})
    assert c.self_termination_deadline == 7


def test_empty_xds_address_disables_xds_and_fake_ca_disables_ca() -> None:
    c = from_env({"XDS_ADDRESS": "", "FAKE_CA": "true"})
    assert c.xds_address is None
    assert c.ca_address is None
    assert c.fake_ca is True


def test_proxy_config_and_mesh_config() -> None:
    mesh = "defaultConfig:\n  discoveryAddress: mesh-istiod:15012\n  proxyAdminPort: 16000\n"
    c = from_env({"PROXY_CONFIG": '{"statsPort": 16020, "proxyMetadata": {"DNS_CAPTURE": "false"}}'}, mesh_config=mesh)
    assert c.xds_address == "https://mesh-istiod:15012"
    assert c.admin_addr.port == 16000
    assert c.stats_addr.port == 16020
    assert c.dns_proxy is False


@pytest.mark.parametrize(
    ("value", "enabled"), [(None, True), ("true", True), ("TRUE", True), ("false", False), ("yes", False)]
)
def test_dns_capture(value: str | None, enabled: bool) -> None:
    env = {} if value is None else {"ISTIO_META_DNS_CAPTURE": value}
    assert from_env(env).dns_proxy is enabled


def test_worker_threads() -> None:
    assert from_env({}, cpu_count=16).worker_threads == 4
    assert from_env({"ZTUNNEL_WORKER_THREADS": "3"}, cpu_count=16).worker_threads == 3
    assert from_env({"ZTUNNEL_WORKER_THREADS": "50%"}, cpu_count=16).worker_threads == 8
    assert from_env({"ZTUNNEL_WORKER_THREADS": "0"}, cpu_count=16).worker_threads == 16
    assert from_env({"ZTUNNEL_RESOURCE_CPU_LIMIT": "1500m"}, cpu_count=16).worker_threads == 2
    assert from_env({"ZTUNNEL_RESOURCE_CPU_REQUEST": "3"}, cpu_count=16).worker_threads == 4
    assert from_env({"ZTUNNEL_RESOURCE_CPU_REQUEST": "6"}, cpu_count=16).worker_threads == 6


def test_listener_address_overrides() -> None:
    c = from_env(
        {
            "ZTUNNEL_INBOUND_ADDR": "127.0.2.1:15008",
            "ZTUNNEL_OUTBOUND_ADDR": "[::1]:25001",
            "ZTUNNEL_ADMIN_ADDR": "127.0.0.1:0",
        }
    )
    assert c.inbound_addr == SocketAddress("127.0.2.1", 15008)
    assert c.outbound_addr == SocketAddress("::1", 25001)
    assert str(c.outbound_addr) == "[::1]:25001"
    assert c.admin_addr == SocketAddress("127.0.0.1", 0)
    assert c.illegal_ports == {25001, 15006, 15008}


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"SECRET_TTL": "forever"}, "SECRET_TTL: 'forever'"),
        ({"SECRET_TTL": "10"}, None),
        ({"SECRET_TTL": "0s"}, "SECRET_TTL: '0s' (must be a positive duration)"),
        ({"KEEPALIVE_TIME": "3 fortnights"}, "KEEPALIVE_TIME"),
        ({"POOL_UNUSED_RELEASE_TIMEOUT": "5x"}, "POOL_UNUSED_RELEASE_TIMEOUT"),
        ({"FAKE_CA": "yes"}, "FAKE_CA: 'yes' (expected true or false)"),
        ({"KEEPALIVE_ENABLED": "True"}, "KEEPALIVE_ENABLED"),
        ({"PACKET_MARK": "-1"}, "PACKET_MARK: '-1'"),
        ({"PACKET_MARK": "0x539"}, "PACKET_MARK"),
        ({"POOL_MAX_STREAMS_PER_CONNECTION": "0"}, "POOL_MAX_STREAMS_PER_CONNECTION"),
        ({"HTTP2_FRAME_SIZE": "1024"}, "HTTP2_FRAME_SIZE: '1024' (expected an integer from 16384 to 16777215)"),
        ({"KEEPALIVE_RETRIES": "many"}, "KEEPALIVE_RETRIES"),
        ({"TERMINATION_GRACE_PERIOD_SECONDS": "30s"}, "TERMINATION_GRACE_PERIOD_SECONDS"),
        ({"PROXY_MODE": "sidecar"}, "PROXY_MODE must be one of dedicated, shared"),
        ({"PROXY_MODE": "dedicated"}, "requires PROXY_WORKLOAD_INFO"),
        ({**DEDICATED, "PROXY_WORKLOAD_INFO": "default/local"}, "namespace/name/service-account"),
        ({"LOCAL_XDS_PATH": "a.yaml", "LOCAL_XDS": "workloads: []"}, "only one of LOCAL_XDS_PATH or LOCAL_XDS"),
        ({"LOG_FORMAT": "xml"}, "LOG_FORMAT: 'xml' (expected plain or json)"),
        ({"RUST_LOG": "access=loud"}, "RUST_LOG"),
        ({"XDS_ADDRESS": "ftp://istiod:15012"}, "XDS_ADDRESS"),
        ({"ZTUNNEL_INBOUND_ADDR": "localhost"}, "ZTUNNEL_INBOUND_ADDR"),
        ({"ZTUNNEL_INBOUND_ADDR": "10.0.0.300:15008"}, "is not an IP address"),
        ({"ISTIO_META_DNS_PROXY_ADDR": "not-an-address"}, "failed to parse DNS_PROXY_ADDR: not-an-address"),
        ({"XDS_ON_DEMAND": "true"}, "DNS proxy does not currently support on-demand mode"),
        ({"ENABLE_PROXY": "false", "ISTIO_META_DNS_CAPTURE": "false"}, "without any servers enabled"),
        ({"ISTIO_METAJSON_LABELS": "{bad"}, "ISTIO_METAJSON_LABELS"),
        ({"XDS_HEADER_bad key": "v"}, "invalid header name"),
        ({"PROXY_CONFIG": "statsPort: many"}, "PROXY_CONFIG: statsPort must be an integer"),
        ({"ZTUNNEL_WORKER_THREADS": "150%"}, "ZTUNNEL_WORKER_THREADS"),
        ({"ZTUNNEL_RESOURCE_CPU_LIMIT": "lots"}, "ZTUNNEL_RESOURCE_CPU_LIMIT"),
        ({"COMPLIANCE_POLICY": "fips"}, "COMPLIANCE_POLICY"),
    ],
)
def test_bad_values_name_variable_and_value(env: dict[str, str], needle: str | None) -> None:
    if needle is None:
        from_env(env)  # a bare number is seconds, as upstream's duration parser
        return
    with pytest.raises(ConfigError) as e:
        from_env(env)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("24h", 86400),
        ("5m", 300),
        ("10s", 10),
        ("100ms", 0.1),
        ("1h30m", 5400),
        ("30", 30),
        ("1.5s", 1.5),
        ("2d", 172800),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "h", "5 m x", "10s5", "1y", "-5s"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_parse_socket_address() -> None:
    assert parse_socket_address("[fd00::1]:80") == SocketAddress("fd00::1", 80)
    assert parse_socket_address("localhost:15053") == SocketAddress("localhost", 15053)
    with pytest.raises(ValueError):
        parse_socket_address("[fd00::1]80")
    with pytest.raises(ValueError):
        parse_socket_address("127.0.0.1:70000")


def test_config_json_hides_token() -> None:
    out = from_env({"AUTH_TOKEN": "s3cret"}).to_json(ResolvConf.load().to_json())
    assert "s3cret" not in repr(out)
    assert out["auth"] == {"token": "set"}
    assert out["inboundAddr"] == "[::]:15008"
    assert out["proxyMode"] == "Shared"

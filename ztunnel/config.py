"""ztunnel's configuration: one frozen :class:`Config` built by the pure :func:`from_env`.

Environment variable names, defaults and parsing rules are upstream's (``src/config.rs``), so a DaemonSet written
for upstream ztunnel configures this one the same way. ``from_env`` reads only the mapping it is given (plus the
optional mesh config text); anything that needs the filesystem (root certs, tokens, the local xDS file) is kept as
a *source* here and resolved by the component that uses it, so building the config never does I/O.

A bad value raises :class:`ConfigError` naming the variable, the value and what is accepted; the CLI prints it and
exits non-zero before anything is bound.

A few variables are this project's own and start with ``ZTUNNEL_``: the per-listener bind addresses (upstream fixes
them in code; running two ztunnels on one host, as the demo, tests and benchmark do, needs them), the local CA
directory, and ``ZTUNNEL_VERIFY_SOURCE_IDENTITY`` (an opt-in check stricter than upstream). Upstream has no
variables by those names.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
import math
import os
import re
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ztunnel.errors import ZtunnelError
from ztunnel.identity.spiffe import DEFAULT_TRUST_DOMAIN, Identity
from ztunnel.net import format_addr

# Ports (config.rs and ARCHITECTURE.md).
DEFAULT_ADMIN_PORT = 15000
DEFAULT_STATS_PORT = 15020
DEFAULT_READINESS_PORT = 15021
DEFAULT_DNS_PORT = 15053
OUTBOUND_PORT = 15001
INBOUND_PLAINTEXT_PORT = 15006
HBONE_PORT = 15008
SOCKS5_PORT = 15080

DEFAULT_CLUSTER_ID = "Kubernetes"
DEFAULT_CLUSTER_DOMAIN = "cluster.local"
DEFAULT_ROOT_CERT_PROVIDER = "./var/run/secrets/istio/root-cert.pem"
DEFAULT_TOKEN_PROVIDER = "./var/run/secrets/tokens/istio-token"
DEFAULT_INPOD_UDS = "/var/run/ztunnel/ztunnel.sock"
DEFAULT_MESH_CONFIG_PATH = "./etc/istio/config/mesh"
DEFAULT_INPOD_MARK = 1337
DEFAULT_CA_DIR = "./var/lib/ztunnel/ca"

DEFAULT_SECRET_TTL = 24 * 3600.0
DEFAULT_POOL_MAX_STREAMS_PER_CONNECTION = 100
DEFAULT_POOL_UNUSED_RELEASE_TIMEOUT = 5 * 60.0
DEFAULT_CONNECTION_TERMINATION_DEADLINE = 5.0
# "Setting this to the same value as window_size can introduce deadlocks" (config.rs): a stream may use at most a
# quarter of the connection window so one stalled stream cannot starve the others.
DEFAULT_HTTP2_STREAM_WINDOW_SIZE = 4 * 1024 * 1024
DEFAULT_HTTP2_CONNECTION_WINDOW_SIZE = 16 * 1024 * 1024
DEFAULT_HTTP2_FRAME_SIZE = 1024 * 1024
# Keepalive aims well below common 10-minute middlebox idle timeouts (config.rs comment).
DEFAULT_KEEPALIVE_TIME = 180.0
DEFAULT_KEEPALIVE_INTERVAL = 180.0
DEFAULT_KEEPALIVE_RETRIES = 9

ISTIO_META_PREFIX = "ISTIO_META_"
ISTIO_METAJSON_PREFIX = "ISTIO_METAJSON_"
XDS_HEADER_PREFIX = "XDS_HEADER_"
CA_HEADER_PREFIX = "CA_HEADER_"


class ConfigError(ZtunnelError, ValueError):
    """A configuration value that cannot be used. The message names the variable, the value and what is accepted."""


class ProxyMode(enum.Enum):
    """``shared``: one ztunnel per node serves all pods through in-pod listeners (ZDS); ``dedicated``: one workload."""

    SHARED = "shared"
    DEDICATED = "dedicated"


class LogFormat(enum.Enum):
    PLAIN = "plain"
    JSON = "json"


@dataclass(frozen=True, slots=True)
class WorkloadInfo:
    """The name, namespace and service account of a proxied workload (``PROXY_WORKLOAD_INFO`` or ZDS)."""

    name: str
    namespace: str
    service_account: str

    def identity(self, trust_domain: str) -> Identity:
        return Identity(trust_domain, self.namespace, self.service_account)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (sa {self.service_account})"


@dataclass(frozen=True, slots=True)
class SocketAddress:
    """A bind address. ``localhost`` binds 127.0.0.1 and, when IPv6 is enabled, ::1 too (upstream ``Address``)."""

    host: str
    port: int

    @property
    def is_localhost(self) -> bool:
        return self.host == "localhost"

    def __str__(self) -> str:
        return format_addr(self.host, self.port)


class RootCertKind(enum.Enum):
    FILE_OR_INLINE = "file-or-inline"  # decided at use time: a path if it exists, else inline PEM
    SYSTEM = "system"


@dataclass(frozen=True, slots=True)
class RootCertSource:
    """``XDS_ROOT_CA`` / ``CA_ROOT_CA``: a file path, ``SYSTEM`` for the native roots, or inline PEM."""

    kind: RootCertKind
    value: str

    @classmethod
    def parse(cls, raw: str) -> RootCertSource:
        return cls(RootCertKind.SYSTEM, raw) if raw == "SYSTEM" else cls(RootCertKind.FILE_OR_INLINE, raw)


@dataclass(frozen=True, slots=True)
class AuthSource:
    """``AUTH_TOKEN``: a token file re-read on every call, or (if no such file exists) a static token.

    ``value`` is ``None`` when no token is configured; then upstream sends the default token file if it exists.
    """

    value: str | None


@dataclass(frozen=True, slots=True)
class Config:
    """Everything ztunnel reads from its environment. Build it with :func:`from_env`; never mutate it."""

    # Control plane
    xds_address: str | None
    ca_address: str | None
    xds_root_cert: RootCertSource
    ca_root_cert: RootCertSource
    alt_xds_hostname: str | None
    alt_ca_hostname: str | None
    auth: AuthSource
    xds_headers: tuple[tuple[str, str], ...]
    ca_headers: tuple[tuple[str, str], ...]
    cluster_id: str
    cluster_domain: str
    trust_domain: str
    fake_ca: bool
    ca_dir: str
    local_xds_path: str | None
    local_xds: str | None
    xds_on_demand: bool
    secret_ttl: float
    prefered_service_namespace: str | None
    proxy_metadata: Mapping[str, Any]

    # Identity of this proxy
    proxy_mode: ProxyMode
    proxy_workload_info: WorkloadInfo | None
    node_name: str | None
    network: str
    instance_ip: str | None
    pod_name: str | None
    pod_namespace: str | None
    service_account: str | None

    # Data plane
    enable_proxy: bool
    dns_proxy: bool
    socks5_enabled: bool
    inpod_uds: str
    inpod_port_reuse: bool
    packet_mark: int | None
    ipv6_enabled: bool
    enable_orig_src: bool | None
    keepalive_time: float
    keepalive_interval: float
    keepalive_retries: int
    keepalive_enabled: bool
    user_timeout_enabled: bool
    pool_max_streams_per_connection: int
    pool_unused_release_timeout: float
    http2_stream_window_size: int
    http2_connection_window_size: int
    http2_frame_size: int
    self_termination_deadline: float
    localhost_app_tunnel: bool
    enable_response_baggage: bool
    crl_path: str | None
    tls12_enabled: bool
    compliance_policy: str | None
    authz_policy_info_logging: bool
    worker_threads: int

    # Listeners
    outbound_addr: SocketAddress
    inbound_addr: SocketAddress
    inbound_plaintext_addr: SocketAddress
    socks5_addr: SocketAddress | None
    dns_proxy_addr: SocketAddress
    admin_addr: SocketAddress
    stats_addr: SocketAddress
    readiness_addr: SocketAddress
    illegal_ports: frozenset[int]

    # Logging
    log_level: str
    log_format: LogFormat

    # Everything the process was given that starts with ISTIO_META_ etc. is in proxy_metadata; this is for display.
    istio_version: str = field(default="")
    # The command line after the program name (upstream ``proxyArgs``), for display.
    proxy_args: str = field(default="")
    # One message per setting that was given but has no effect yet (see SETTINGS); logged at startup.
    warnings: tuple[str, ...] = field(default=())
    # ZTUNNEL_VERIFY_SOURCE_IDENTITY (this project's own): on 15008, refuse a peer whose certificate is not the
    # identity of the workload at its source IP (upstream accepts it; the IP's workload is then never attributed).
    verify_source_identity: bool = field(default=False)
    # ZTUNNEL_INLINE_DATA_PLANE (this project's own): run the data plane on the control process's event loop, in
    # one process, instead of in worker_threads worker processes (debugging, and the in-process test harness).
    inline_data_plane: bool = field(default=False)
    # ZTUNNEL_OPENSSL_RECORD_LAYER (this project's own): keep OpenSSL's TLS record layer (the ssl module's) after
    # the handshake instead of ztunnel/proxy/hbone/records.py's, which is the default for TLS 1.3 connections.
    openssl_record_layer: bool = field(default=False)

    @property
    def ztunnel_identity(self) -> Identity | None:
        """ztunnel's own identity (for the self listener), from the downward API, as upstream."""
        if self.pod_namespace and self.service_account and self.pod_name:
            return Identity(self.trust_domain, self.pod_namespace, self.service_account)
        return None

    @property
    def node_id(self) -> str:
        """The xDS node id: ``ztunnel~<INSTANCE_IP|1.1.1.1>~<POD_NAME>.<NS>~<NS>.svc.cluster.local``."""
        ip = self.instance_ip if self.instance_ip is not None else "1.1.1.1"  # set but empty stays empty, as upstream
        ns = self.pod_namespace or ""
        return f"ztunnel~{ip}~{self.pod_name or ''}.{ns}~{ns}.svc.cluster.local"  # literal domain, as upstream

    def to_json(self, resolver: Mapping[str, Any]) -> dict[str, Any]:
        """The effective configuration as upstream's ``/config_dump`` ``config`` object (``ztunnel config`` prints
        the same): upstream's key names and serde shapes (``config.rs`` ``Config``), then this project's own keys.

        Shapes: durations ``{"secs", "nanos"}``; the listener addresses upstream types ``SocketAddr`` as
        ``"ip:port"``; those it types ``Address`` (admin, stats, readiness, DNS) as ``{"Localhost": [ipv6, port]}``
        or ``{"SocketAddr": "ip:port"}``; root certificates as ``{"File": path}``, ``"Default"`` (``SYSTEM``) or
        ``"Static"`` (inline PEM, not shown); headers as ``[name, value]`` pairs. Secrets never leave the process:
        the token is shown only as set or not. ``resolver`` is the ``dnsResolverCfg``/``dnsResolverOpts`` pair
        (``ResolvConf.to_json``), read once by the caller as upstream reads it at start; this checks whether the
        root certificate paths exist.
        """
        ipv6 = self.ipv6_enabled
        identity = self.ztunnel_identity
        out: dict[str, Any] = {
            "proxy": self.enable_proxy,
            "dnsProxy": self.dns_proxy,
            "windowSize": self.http2_stream_window_size,
            "connectionWindowSize": self.http2_connection_window_size,
            "frameSize": self.http2_frame_size,
            "poolMaxStreamsPerConn": self.pool_max_streams_per_connection,
            "poolUnusedReleaseTimeout": _duration(self.pool_unused_release_timeout),
            "socks5Addr": str(self.socks5_addr) if self.socks5_addr is not None else None,
            "adminAddr": _bind_address(self.admin_addr, ipv6),
            "statsAddr": _bind_address(self.stats_addr, ipv6),
            "readinessAddr": _bind_address(self.readiness_addr, ipv6),
            "inboundAddr": str(self.inbound_addr),
            "inboundPlaintextAddr": str(self.inbound_plaintext_addr),
            "outboundAddr": str(self.outbound_addr),
            "dnsProxyAddr": _bind_address(self.dns_proxy_addr, ipv6),
            "illegalPorts": sorted(self.illegal_ports),
            "network": self.network,
            "localNode": self.node_name,
            "proxyMode": self.proxy_mode.value.title(),
            "proxyWorkloadInformation": _workload_info(self.proxy_workload_info),
            "clusterId": self.cluster_id,
            "clusterDomain": self.cluster_domain,
            "caAddress": self.ca_address,
            "caRootCert": _root_cert(self.ca_root_cert),
            "altCaHostname": self.alt_ca_hostname,
            "xdsAddress": self.xds_address,
            "xdsRootCert": _root_cert(self.xds_root_cert),
            "altXdsHostname": self.alt_xds_hostname,
            "preferedServiceNamespace": self.prefered_service_namespace,
            "secretTtl": _duration(self.secret_ttl),
            "xdsOnDemand": self.xds_on_demand,
            "fakeCa": self.fake_ca,
            "fakeSelfInbound": False,  # upstream's test-only switch; never set in a real ztunnel
            "selfTerminationDeadline": _duration(self.self_termination_deadline),
            "proxyMetadata": _jsonable(self.proxy_metadata),
            "numWorkerThreads": self.worker_threads,
            "requireOriginalSource": self.enable_orig_src,
            "proxyArgs": self.proxy_args,
            **resolver,
            "inpodUds": self.inpod_uds,
            "inpodPortReuse": self.inpod_port_reuse,
            "packetMark": self.packet_mark,
            "socketConfig": {
                "keepaliveTime": _duration(self.keepalive_time),
                "keepaliveInterval": _duration(self.keepalive_interval),
                "keepaliveRetries": self.keepalive_retries,
                "keepaliveEnabled": self.keepalive_enabled,
                "userTimeoutEnabled": self.user_timeout_enabled,
            },
            "xdsHeaders": [list(h) for h in self.xds_headers],
            "caHeaders": [list(h) for h in self.ca_headers],
            "localhostAppTunnel": self.localhost_app_tunnel,
            "ztunnelIdentity": str(identity) if identity is not None else None,
            "ztunnelWorkload": (
                _workload_info(WorkloadInfo(self.pod_name, self.pod_namespace, self.service_account))
                if identity is not None and self.pod_name and self.pod_namespace and self.service_account
                else None
            ),
            "ipv6Enabled": ipv6,
            "crlPath": self.crl_path,
            "enableEnhancedBaggage": self.enable_response_baggage,
            # This project's own keys (upstream has no such fields, or keeps them out of the dump).
            "trustDomain": self.trust_domain,
            "caDir": self.ca_dir,
            "localXdsPath": self.local_xds_path,
            "localXds": "set" if self.local_xds else None,
            "instanceIp": self.instance_ip,
            "tls12Enabled": self.tls12_enabled,
            "compliancePolicy": self.compliance_policy,
            "authzPolicyInfoLogging": self.authz_policy_info_logging,
            "logLevel": self.log_level,
            "logFormat": self.log_format.value,
            "istioVersion": self.istio_version,
            "auth": {"token": "set" if self.auth.value else None},
            "inlineDataPlane": self.inline_data_plane,
            "opensslRecordLayer": self.openssl_record_layer,
        }
        return out


def _duration(seconds: float) -> dict[str, int]:
    """serde's ``std::time::Duration``."""
    nanos = round(seconds * 1_000_000_000)
    return {"secs": nanos // 1_000_000_000, "nanos": nanos % 1_000_000_000}


def _bind_address(addr: SocketAddress, ipv6_enabled: bool) -> dict[str, Any]:
    """Upstream's ``Address``: ``Localhost(ipv6_enabled, port)`` binds both loopbacks, else one socket address."""
    return {"Localhost": [ipv6_enabled, addr.port]} if addr.is_localhost else {"SocketAddr": str(addr)}


def _root_cert(source: RootCertSource) -> Any:
    """Upstream's ``RootCert``: ``File`` when the path exists, ``Default`` for ``SYSTEM``, else ``Static`` (PEM)."""
    if source.kind is RootCertKind.SYSTEM:
        return "Default"
    return {"File": source.value} if os.path.exists(source.value) else "Static"


def _workload_info(info: WorkloadInfo | None) -> dict[str, str] | None:
    if info is None:
        return None
    return {"name": info.name, "namespace": info.namespace, "serviceAccount": info.service_account}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


# --- parsing primitives -------------------------------------------------------------------------------------------

_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}
_DURATION_TERM = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|min|s|m|h|d)?\s*")
DURATION_FORMS = 'a number of seconds or units like "24h", "5m", "10s", "100ms", "1h30m"'


def parse_duration(raw: str) -> float:
    """Parse upstream's duration forms into seconds: ``24h``, ``5m``, ``10s``, ``250ms``, ``1h30m``, ``30``.

    A bare number is seconds (as ``duration_str``, which upstream uses). Raises ``ValueError`` otherwise.
    """
    text = raw.strip()
    if not text:
        raise ValueError("empty duration")
    pos = 0
    total = 0.0
    terms = 0
    while pos < len(text):
        m = _DURATION_TERM.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot parse {text[pos:]!r}")
        number, unit = m.group(1), m.group(2)
        if unit is None and (terms > 0 or m.end() != len(text)):
            raise ValueError(f"missing unit after {number!r}")
        total += float(number) * _DURATION_UNITS[unit or "s"]
        terms += 1
        pos = m.end()
    return total


class _Env:
    """Typed accessors over the environment mapping; every failure names the variable and the value."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def raw(self, name: str) -> str | None:
        return self.env.get(name)

    def error(self, name: str, value: str, accepted: str) -> ConfigError:
        return ConfigError(f"invalid value for {name}: {value!r} ({accepted})")

    def string(self, name: str, default: str) -> str:
        value = self.env.get(name)
        return default if value is None else value

    def flag(self, name: str, default: bool) -> bool:
        # Upstream parses with Rust's bool::from_str, which accepts exactly "true" and "false".
        value = self.env.get(name)
        if value is None:
            return default
        if value == "true":
            return True
        if value == "false":
            return False
        raise self.error(name, value, "expected true or false")

    def optional_flag(self, name: str) -> bool | None:
        return None if self.env.get(name) is None else self.flag(name, False)

    def integer(self, name: str, default: int, *, minimum: int = 0, maximum: int = 2**32 - 1) -> int:
        value = self.env.get(name)
        if value is None:
            return default
        return self.parse_int(name, value, minimum=minimum, maximum=maximum)

    def parse_int(self, name: str, value: str, *, minimum: int = 0, maximum: int = 2**32 - 1) -> int:
        if not re.fullmatch(r"\+?\d+", value.strip()):
            raise self.error(name, value, f"expected an integer from {minimum} to {maximum}")
        n = int(value)
        if not minimum <= n <= maximum:
            raise self.error(name, value, f"expected an integer from {minimum} to {maximum}")
        return n

    def duration(self, name: str, default: float | None) -> float | None:
        value = self.env.get(name)
        if value is None:
            return default
        try:
            return parse_duration(value)
        except ValueError as e:
            raise self.error(name, value, f"{e}; expected {DURATION_FORMS}") from None

    def address(self, name: str, default: SocketAddress) -> SocketAddress:
        value = self.env.get(name)
        if value is None:
            return default
        try:
            return parse_socket_address(value)
        except ValueError as e:
            raise self.error(name, value, f"{e}; expected ip:port, [ipv6]:port or localhost:port") from None


def parse_socket_address(raw: str) -> SocketAddress:
    """Parse ``ip:port``, ``[v6]:port`` or ``localhost:port`` into a :class:`SocketAddress`."""
    text = raw.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError("missing ']:port'")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError("missing ':port'")
    if host != "localhost":
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            raise ValueError(f"{host!r} is not an IP address") from None
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{port!r} is not a port")
    return SocketAddress(host, int(port))


def _headers(env: Mapping[str, str], prefix: str) -> tuple[tuple[str, str], ...]:
    out = []
    for key, value in sorted(env.items()):
        if not key.startswith(prefix) or key == prefix:
            continue
        name = key[len(prefix) :].lower()
        # gRPC metadata keys: lowercase ASCII letters, digits, '-', '_', '.'; values printable ASCII.
        if not re.fullmatch(r"[a-z0-9_.-]+", name) or name.endswith("-bin"):
            raise ConfigError(f"invalid header name in {key}: {name!r} (gRPC metadata keys are [a-z0-9_.-])")
        if not all(0x20 <= ord(c) < 0x7F for c in value):
            raise ConfigError(f"invalid header value in {key}: {value!r} (printable ASCII only)")
        out.append((name, value))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _ProxyConfig:
    """The subset of Istio ProxyConfig ztunnel reads (mesh config ``defaultConfig`` merged with ``PROXY_CONFIG``)."""

    discovery_address: str | None = None
    proxy_admin_port: int | None = None
    stats_port: int | None = None
    concurrency: int | None = None
    proxy_metadata: Mapping[str, str] = field(default_factory=dict)


_PROXY_CONFIG_KEYS = {"discoveryAddress", "proxyAdminPort", "statsPort", "concurrency", "proxyMetadata"}


def _parse_proxy_config(data: Any, where: str, base: _ProxyConfig) -> _ProxyConfig:
    if data is None:
        return base
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of ProxyConfig fields, got {type(data).__name__}")
    # ProxyConfig has many fields ztunnel ignores (Envoy-only settings); only the ones read are type-checked.
    values: dict[str, Any] = {}
    for key in _PROXY_CONFIG_KEYS & data.keys():
        value = data[key]
        if key in ("proxyAdminPort", "statsPort", "concurrency"):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 65535:
                raise ConfigError(f"{where}: {key} must be an integer from 0 to 65535, got {value!r}")
        elif key == "discoveryAddress":
            if not isinstance(value, str):
                raise ConfigError(f"{where}: discoveryAddress must be a string, got {value!r}")
        elif not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}: proxyMetadata must be a mapping of strings, got {value!r}")
        values[key] = value
    metadata = dict(base.proxy_metadata)
    metadata.update({k: str(v) for k, v in values.get("proxyMetadata", {}).items()})
    return _ProxyConfig(
        discovery_address=values.get("discoveryAddress", base.discovery_address),
        proxy_admin_port=values.get("proxyAdminPort", base.proxy_admin_port),
        stats_port=values.get("statsPort", base.stats_port),
        concurrency=values.get("concurrency", base.concurrency),
        proxy_metadata=metadata,
    )


def _load_yaml(text: str, where: str) -> Any:
    # Imported here: a data-plane worker has the Config class but never parses YAML, and PyYAML is ~0.8 MiB of
    # Python objects that every worker would carry (docs/process-model.md, "What it costs").
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML or JSON: {e}") from None


def _proxy_config(env: Mapping[str, str], mesh_config: str | None) -> _ProxyConfig:
    pc = _ProxyConfig()
    if mesh_config:
        mesh = _load_yaml(mesh_config, f"mesh config {DEFAULT_MESH_CONFIG_PATH}")
        if mesh is not None and not isinstance(mesh, dict):
            raise ConfigError(f"mesh config {DEFAULT_MESH_CONFIG_PATH}: expected a mapping")
        if mesh:
            pc = _parse_proxy_config(mesh.get("defaultConfig"), f"mesh config {DEFAULT_MESH_CONFIG_PATH}", pc)
    if env.get("PROXY_CONFIG"):
        pc = _parse_proxy_config(_load_yaml(env["PROXY_CONFIG"], "PROXY_CONFIG"), "PROXY_CONFIG", pc)
    # ISTIO_META_* env vars are proxy metadata too, with the prefix stripped (config.rs construct_proxy_config).
    metadata = dict(pc.proxy_metadata)
    for key, value in env.items():
        if key.startswith(ISTIO_META_PREFIX) and len(key) > len(ISTIO_META_PREFIX):
            metadata[key[len(ISTIO_META_PREFIX) :]] = value
    return dataclasses.replace(pc, proxy_metadata=metadata)


def _validate_uri(raw: str | None, name: str) -> str | None:
    """Upstream: empty disables; a value without a scheme gets ``https://``; it must parse as a URI."""
    if raw is None or raw == "":
        return None
    uri = raw if "://" in raw else "https://" + raw
    scheme, _, rest = uri.partition("://")
    host_port = rest.split("/", 1)[0]
    if scheme not in ("http", "https") or not host_port or " " in uri:
        raise ConfigError(f"invalid value for {name}: {raw!r} (expected [https://]host:port)")
    return uri


def _termination_deadline(e: _Env) -> float:
    explicit = e.duration("CONNECTION_TERMINATION_DEADLINE", None)
    if explicit is not None:
        return explicit
    raw = e.raw("TERMINATION_GRACE_PERIOD_SECONDS")
    if raw is None:
        return DEFAULT_CONNECTION_TERMINATION_DEADLINE
    secs = e.parse_int("TERMINATION_GRACE_PERIOD_SECONDS", raw, maximum=2**63 - 1)
    # Drain for less than Kubernetes' grace period so the last seconds can close what is left politely (config.rs).
    return float(max(secs - 5 if secs > 10 else secs - 1, 1))


def _cpu_quantity(e: _Env, name: str) -> int | None:
    raw = e.raw(name)
    if raw is None:
        return None
    try:
        cores = float(raw[:-1]) / 1000 if raw.endswith("m") else float(raw)
    except ValueError:
        raise e.error(name, raw, 'expected a Kubernetes CPU quantity such as "2", "1.5" or "500m"') from None
    if cores <= 0 or math.isinf(cores) or math.isnan(cores):
        raise e.error(name, raw, "expected a positive CPU quantity")
    return math.ceil(cores)


def _worker_threads(e: _Env, concurrency: int | None, cpu_count: int) -> int:
    limit = _cpu_quantity(e, "ZTUNNEL_RESOURCE_CPU_LIMIT")
    if limit is None and e.raw("ZTUNNEL_CPU_LIMIT") is not None:
        limit = e.integer("ZTUNNEL_CPU_LIMIT", 0, minimum=1)
    cpus = limit if limit is not None else cpu_count
    raw = e.raw("ZTUNNEL_WORKER_THREADS")
    if raw is not None:
        if raw.endswith("%"):
            pct = e.parse_int("ZTUNNEL_WORKER_THREADS", raw[:-1], minimum=1, maximum=100)
            return max(1, math.ceil(cpus * pct / 100))
        n = e.parse_int("ZTUNNEL_WORKER_THREADS", raw, maximum=4096)
        return n if n > 0 else cpus
    if concurrency is not None:
        return concurrency if concurrency > 0 else cpus
    if limit is not None:
        request = _cpu_quantity(e, "ZTUNNEL_RESOURCE_CPU_REQUEST") or 0
        return max(limit, request, 1)
    request = _cpu_quantity(e, "ZTUNNEL_RESOURCE_CPU_REQUEST") or 0
    return max(math.ceil(0.25 * cpus), request, 2)


def from_env(
    env: Mapping[str, str],
    *,
    mesh_config: str | None = None,
    cpu_count: int = 2,
    args: Sequence[str] = (),
) -> Config:
    """Build the configuration from an environment mapping (pure: no I/O, no ``os.environ``).

    ``mesh_config`` is the text of ``./etc/istio/config/mesh`` if the caller found one; ``cpu_count`` is the number
    of logical CPUs, used only for the worker-thread default; ``args`` the command line after the program name
    (shown as ``proxyArgs``).
    """
    e = _Env(env)
    pc = _proxy_config(env, mesh_config)

    default_istiod = (
        "https://istiod.istio-system.svc:15012" if "KUBERNETES_SERVICE_HOST" in env else "https://localhost:15012"
    )
    raw_xds = env.get("XDS_ADDRESS")
    if raw_xds is None:
        raw_xds = pc.discovery_address if pc.discovery_address is not None else default_istiod
    xds_address = _validate_uri(raw_xds, "XDS_ADDRESS")
    fake_ca = e.flag("FAKE_CA", False)
    ca_address = None if fake_ca else _validate_uri(e.string("CA_ADDRESS", default_istiod), "CA_ADDRESS")

    cluster_id = env.get("ISTIO_META_CLUSTER_ID") or e.string("CLUSTER_ID", DEFAULT_CLUSTER_ID)

    mode_raw = e.string("PROXY_MODE", ProxyMode.SHARED.value)
    try:
        proxy_mode = ProxyMode(mode_raw)
    except ValueError:
        raise e.error("PROXY_MODE", mode_raw, "PROXY_MODE must be one of dedicated, shared") from None
    workload_info = None
    if proxy_mode is ProxyMode.DEDICATED:
        raw = env.get("PROXY_WORKLOAD_INFO")
        if raw is None:
            raise ConfigError("PROXY_MODE=dedicated requires PROXY_WORKLOAD_INFO to be set (namespace/name/sa)")
        parts = raw.split("/", 2)
        if len(parts) != 3 or not all(parts):
            raise e.error("PROXY_WORKLOAD_INFO", raw, "must match the format 'namespace/name/service-account'")
        workload_info = WorkloadInfo(name=parts[1], namespace=parts[0], service_account=parts[2])

    local_xds_path = env.get("LOCAL_XDS_PATH") or None
    local_xds = env.get("LOCAL_XDS") or None
    if local_xds_path and local_xds:
        raise ConfigError("only one of LOCAL_XDS_PATH or LOCAL_XDS may be set")

    ipv6_enabled = e.flag("IPV6_ENABLED", True)
    wildcard = "::" if ipv6_enabled else "0.0.0.0"

    metadata = pc.proxy_metadata
    dns_capture = metadata.get("DNS_CAPTURE")
    dns_proxy = dns_capture is None or dns_capture.lower() == "true"
    dns_addr_raw = metadata.get("DNS_PROXY_ADDR")
    if dns_addr_raw is None:
        dns_proxy_addr = SocketAddress("localhost", DEFAULT_DNS_PORT)
    else:
        try:
            dns_proxy_addr = parse_socket_address(dns_addr_raw)
        except ValueError as err:
            raise ConfigError(f"failed to parse DNS_PROXY_ADDR: {dns_addr_raw} ({err})") from None

    socks5_enabled = e.flag("UNSTABLE_ENABLE_SOCKS5", False)
    outbound_addr = e.address("ZTUNNEL_OUTBOUND_ADDR", SocketAddress(wildcard, OUTBOUND_PORT))
    inbound_addr = e.address("ZTUNNEL_INBOUND_ADDR", SocketAddress(wildcard, HBONE_PORT))
    inbound_plaintext_addr = e.address(
        "ZTUNNEL_INBOUND_PLAINTEXT_ADDR", SocketAddress(wildcard, INBOUND_PLAINTEXT_PORT)
    )
    socks5_addr = e.address("ZTUNNEL_SOCKS5_ADDR", SocketAddress("127.0.0.1", SOCKS5_PORT)) if socks5_enabled else None
    # HBONE has no redirection, so loops are impossible, but stacking HBONE layers is banned as upstream does.
    illegal = {outbound_addr.port, inbound_addr.port, inbound_plaintext_addr.port}
    if socks5_addr is not None:
        illegal.add(socks5_addr.port)

    packet_mark_raw = env.get("PACKET_MARK")
    if packet_mark_raw is not None:
        packet_mark: int | None = e.parse_int("PACKET_MARK", packet_mark_raw)
    else:
        packet_mark = DEFAULT_INPOD_MARK if proxy_mode is ProxyMode.SHARED else None

    log_format_raw = e.string("LOG_FORMAT", "plain")
    try:
        log_format = LogFormat(log_format_raw)
    except ValueError:
        raise e.error("LOG_FORMAT", log_format_raw, "expected plain or json") from None
    log_level = e.string("RUST_LOG", "info")
    from ztunnel.telemetry import parse_log_filter  # local: telemetry imports config types

    try:
        parse_log_filter(log_level)
    except ValueError as err:
        raise e.error("RUST_LOG", log_level, str(err)) from None

    compliance = env.get("COMPLIANCE_POLICY") or None
    if compliance not in (None, "pqc"):
        raise e.error("COMPLIANCE_POLICY", compliance, "expected pqc or unset")
    if compliance == "pqc":
        raise ConfigError(pqc_refusal())
    # Loaded and watched by ztunnel.crl (each data-plane process); a file that does not parse fails the start.
    crl_path = env.get("CRL_PATH") or None

    stream_window = e.integer(
        "HTTP2_STREAM_WINDOW_SIZE", DEFAULT_HTTP2_STREAM_WINDOW_SIZE, minimum=1, maximum=2**31 - 1
    )
    conn_window = e.integer(
        "HTTP2_CONNECTION_WINDOW_SIZE", DEFAULT_HTTP2_CONNECTION_WINDOW_SIZE, minimum=1, maximum=2**31 - 1
    )
    # RFC 9113 §6.5.2: SETTINGS_MAX_FRAME_SIZE must be within [2^14, 2^24-1].
    frame_size = e.integer("HTTP2_FRAME_SIZE", DEFAULT_HTTP2_FRAME_SIZE, minimum=2**14, maximum=2**24 - 1)

    worker_threads = _worker_threads(e, pc.concurrency, cpu_count)

    secret_ttl = e.duration("SECRET_TTL", DEFAULT_SECRET_TTL)
    assert secret_ttl is not None
    if secret_ttl <= 0:
        raise e.error("SECRET_TTL", env["SECRET_TTL"], "must be a positive duration")

    metajson: dict[str, Any] = {}
    for key, value in env.items():
        if key.startswith(ISTIO_METAJSON_PREFIX) and len(key) > len(ISTIO_METAJSON_PREFIX):
            try:
                metajson[key[len(ISTIO_METAJSON_PREFIX) :]] = json.loads(value)
            except json.JSONDecodeError as err:
                raise e.error(key, value, f"expected JSON: {err}") from None
    proxy_metadata: dict[str, Any] = {**metadata, **metajson}

    cfg = Config(
        xds_address=xds_address,
        ca_address=ca_address,
        xds_root_cert=RootCertSource.parse(e.string("XDS_ROOT_CA", DEFAULT_ROOT_CERT_PROVIDER)),
        ca_root_cert=RootCertSource.parse(e.string("CA_ROOT_CA", DEFAULT_ROOT_CERT_PROVIDER)),
        alt_xds_hostname=env.get("ALT_XDS_HOSTNAME"),
        alt_ca_hostname=env.get("ALT_CA_HOSTNAME"),
        auth=AuthSource(env.get("AUTH_TOKEN")),
        xds_headers=_headers(env, XDS_HEADER_PREFIX),
        ca_headers=_headers(env, CA_HEADER_PREFIX),
        cluster_id=cluster_id,
        cluster_domain=e.string("CLUSTER_DOMAIN", DEFAULT_CLUSTER_DOMAIN),
        trust_domain=e.string("TRUST_DOMAIN", DEFAULT_TRUST_DOMAIN),
        fake_ca=fake_ca,
        ca_dir=e.string("ZTUNNEL_CA_DIR", DEFAULT_CA_DIR),
        local_xds_path=local_xds_path,
        local_xds=local_xds,
        xds_on_demand=e.flag("XDS_ON_DEMAND", False),
        secret_ttl=secret_ttl,
        # Upstream only warns on a bad PREFERED_SERVICE_NAMESPACE; any string is accepted here.
        prefered_service_namespace=env.get("PREFERED_SERVICE_NAMESPACE"),
        proxy_metadata=proxy_metadata,
        proxy_mode=proxy_mode,
        proxy_workload_info=workload_info,
        node_name=env.get("NODE_NAME"),
        network=e.string("NETWORK", ""),
        instance_ip=env.get("INSTANCE_IP"),
        pod_name=env.get("POD_NAME"),
        pod_namespace=env.get("POD_NAMESPACE"),
        service_account=env.get("SERVICE_ACCOUNT"),
        enable_proxy=e.flag("ENABLE_PROXY", True),
        dns_proxy=dns_proxy,
        socks5_enabled=socks5_enabled,
        inpod_uds=e.string("INPOD_UDS", DEFAULT_INPOD_UDS),
        inpod_port_reuse=e.flag("INPOD_PORT_REUSE", True),
        packet_mark=packet_mark,
        ipv6_enabled=ipv6_enabled,
        enable_orig_src=e.optional_flag("ENABLE_ORIG_SRC"),
        keepalive_time=_require(e.duration("KEEPALIVE_TIME", DEFAULT_KEEPALIVE_TIME)),
        keepalive_interval=_require(e.duration("KEEPALIVE_INTERVAL", DEFAULT_KEEPALIVE_INTERVAL)),
        keepalive_retries=e.integer("KEEPALIVE_RETRIES", DEFAULT_KEEPALIVE_RETRIES),
        keepalive_enabled=e.flag("KEEPALIVE_ENABLED", True),
        user_timeout_enabled=e.flag("USER_TIMEOUT_ENABLED", False),
        pool_max_streams_per_connection=e.integer(
            "POOL_MAX_STREAMS_PER_CONNECTION", DEFAULT_POOL_MAX_STREAMS_PER_CONNECTION, minimum=1, maximum=2**16 - 1
        ),
        pool_unused_release_timeout=_require(
            e.duration("POOL_UNUSED_RELEASE_TIMEOUT", DEFAULT_POOL_UNUSED_RELEASE_TIMEOUT)
        ),
        http2_stream_window_size=stream_window,
        http2_connection_window_size=conn_window,
        http2_frame_size=frame_size,
        self_termination_deadline=_termination_deadline(e),
        localhost_app_tunnel=e.flag("LOCALHOST_APP_TUNNEL", True),
        enable_response_baggage=e.flag("ENABLE_RESPONSE_BAGGAGE", True),
        crl_path=crl_path,
        tls12_enabled=e.flag("TLS12_ENABLED", False),
        compliance_policy=compliance,
        # Upstream compares with == "true" and ignores anything else.
        authz_policy_info_logging=env.get("AUTHZ_POLICY_INFO_LOGGING", "") == "true",
        worker_threads=worker_threads,
        outbound_addr=outbound_addr,
        inbound_addr=inbound_addr,
        inbound_plaintext_addr=inbound_plaintext_addr,
        socks5_addr=socks5_addr,
        dns_proxy_addr=dns_proxy_addr,
        admin_addr=e.address(
            "ZTUNNEL_ADMIN_ADDR", SocketAddress("localhost", pc.proxy_admin_port or DEFAULT_ADMIN_PORT)
        ),
        stats_addr=e.address("ZTUNNEL_STATS_ADDR", SocketAddress(wildcard, pc.stats_port or DEFAULT_STATS_PORT)),
        readiness_addr=e.address("ZTUNNEL_READINESS_ADDR", SocketAddress(wildcard, DEFAULT_READINESS_PORT)),
        illegal_ports=frozenset(illegal),
        log_level=log_level,
        log_format=log_format,
        istio_version=env.get("ISTIO_META_ISTIO_VERSION", ""),
        proxy_args=" ".join(args),
        verify_source_identity=e.flag("ZTUNNEL_VERIFY_SOURCE_IDENTITY", False),
        inline_data_plane=e.flag("ZTUNNEL_INLINE_DATA_PLANE", False),
        openssl_record_layer=e.flag("ZTUNNEL_OPENSSL_RECORD_LAYER", False),
    )
    return _validate(cfg)


def _require(value: float | None) -> float:
    assert value is not None  # defaults are never None
    return value


_WORKER_VARIABLES = (
    "ZTUNNEL_WORKER_THREADS",
    "ZTUNNEL_CPU_LIMIT",
    "ZTUNNEL_RESOURCE_CPU_LIMIT",
    "ZTUNNEL_RESOURCE_CPU_REQUEST",
)


PQC_GROUP = "X25519MLKEM768"


def pqc_refusal() -> str:
    """Why ``COMPLIANCE_POLICY=pqc`` (key exchange X25519MLKEM768 only, as upstream) is refused, with the facts.

    The data path's TLS is the ``ssl`` module, whose OpenSSL must know the group: ML-KEM came in OpenSSL 3.5
    (``ztunnel.tls.key_exchange_group_supported`` asks libssl itself; a test holds it to this version rule). The
    OpenSSL that ``cryptography`` and pyOpenSSL bundle has ML-KEM, but is not usable for the data path: pyOpenSSL
    can set neither a group list nor anything but a classical ECDH curve, and the bundled libssl is linked in
    without exported symbols.
    """
    try:
        from cryptography.hazmat.backends.openssl import backend

        bundled = backend.openssl_version_text()
    except Exception:  # pragma: no cover - cryptography is a dependency
        bundled = "unknown"
    if ssl.OPENSSL_VERSION_INFO >= (3, 5):
        why = (
            f"{ssl.OPENSSL_VERSION} (Python's ssl module) knows {PQC_GROUP}, but this ztunnel does not yet restrict "
            "the key exchange to it"
        )
    else:
        why = (
            f"the data path's TLS is Python's ssl module, linked with {ssl.OPENSSL_VERSION}, which does not know the "
            f"{PQC_GROUP} group (ML-KEM key exchange needs OpenSSL 3.5 or later); the {bundled} bundled by "
            "cryptography/pyOpenSSL has ML-KEM, but pyOpenSSL cannot set a context's key-exchange groups"
        )
    return (
        f"COMPLIANCE_POLICY=pqc is refused: upstream allows only the {PQC_GROUP} key exchange, and {why}. Accepting it "
        "would negotiate classical (X25519/ECDHE) key exchange; unset COMPLIANCE_POLICY"
    )


def _validate(cfg: Config) -> Config:
    """Cross-field checks, as upstream's ``validate_config``."""
    if cfg.dns_proxy and cfg.xds_on_demand:
        raise ConfigError("DNS proxy does not currently support on-demand mode (XDS_ON_DEMAND=true)")
    if not cfg.enable_proxy and not cfg.dns_proxy:
        raise ConfigError("ztunnel run without any servers enabled (ENABLE_PROXY=false and DNS capture off)")
    return cfg


# --- what each documented setting does --------------------------------------------------------------------------


class Support(enum.Enum):
    """What a documented setting does here (docs/configuration.md's tables say the same)."""

    IMPLEMENTED = "implemented"
    # Accepted, but has no effect yet: a WARNING at startup names the variable, its value and why. For performance
    # and tuning settings, where doing without them is slower or different but never less safe.
    WARNS = "warns: no effect yet"
    # Startup fails with a ConfigError saying why. For security-relevant settings that would otherwise be silently
    # weaker than asked for (fail-open).
    REFUSED = "refused at startup"


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the tables in docs/configuration.md: its variables, the :class:`Config` fields they set, support.

    ``warns_when`` / ``refused_when`` map each variable (of this row) that warns or is refused to a value that makes
    it do so when set alone; an implemented setting may have a part that warns or is refused (none does today,
    so ``from_env`` fills no ``Config.warnings``; a row that warns must add its message there).
    ``tests/test_settings_registry.py`` checks this registry against docs/configuration.md, against the code
    (implemented fields are read outside this module, the others are not) and against the behaviour (each warning
    and refusal happens).
    """

    names: tuple[str, ...]
    fields: tuple[str, ...]
    support: Support = Support.IMPLEMENTED
    warns_when: Mapping[str, str] | None = None
    refused_when: Mapping[str, str] | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting(("XDS_ADDRESS",), ("xds_address",)),
    Setting(("CA_ADDRESS",), ("ca_address",)),
    Setting(("XDS_ROOT_CA", "CA_ROOT_CA"), ("xds_root_cert", "ca_root_cert")),
    Setting(("ALT_XDS_HOSTNAME", "ALT_CA_HOSTNAME"), ("alt_xds_hostname", "alt_ca_hostname")),
    Setting(("AUTH_TOKEN",), ("auth",)),
    Setting(("XDS_HEADER_<K>", "CA_HEADER_<K>"), ("xds_headers", "ca_headers")),
    Setting(("CLUSTER_ID", "ISTIO_META_CLUSTER_ID"), ("cluster_id",)),
    Setting(("CLUSTER_DOMAIN",), ("cluster_domain",)),
    Setting(("TRUST_DOMAIN",), ("trust_domain",)),
    Setting(("FAKE_CA",), ("fake_ca",)),
    Setting(("LOCAL_XDS_PATH", "LOCAL_XDS"), ("local_xds_path", "local_xds")),
    Setting(("XDS_ON_DEMAND",), ("xds_on_demand",)),
    Setting(("SECRET_TTL",), ("secret_ttl",)),
    Setting(("PROXY_MODE",), ("proxy_mode",)),
    Setting(("PROXY_WORKLOAD_INFO",), ("proxy_workload_info",)),
    Setting(("INPOD_UDS",), ("inpod_uds",)),
    Setting(("INPOD_PORT_REUSE",), ("inpod_port_reuse",)),
    Setting(("PACKET_MARK",), ("packet_mark",)),
    Setting(("NODE_NAME", "NETWORK"), ("node_name", "network")),
    Setting(
        ("INSTANCE_IP", "POD_NAME", "POD_NAMESPACE", "SERVICE_ACCOUNT"),
        ("instance_ip", "pod_name", "pod_namespace", "service_account"),
    ),
    # false: no HBONE proxy listeners (15001, 15006, 15008, SOCKS5), only the DNS proxy; in shared mode each pod's
    # DNS proxy, as upstream's ProxyFactory (ztunnel/proxyfactory.py).
    Setting(("ENABLE_PROXY",), ("enable_proxy",)),
    Setting(("ISTIO_META_DNS_CAPTURE",), ("dns_proxy",)),
    Setting(("ISTIO_META_DNS_PROXY_ADDR",), ("dns_proxy_addr",)),
    Setting(("ISTIO_META_*", "ISTIO_METAJSON_*"), ("proxy_metadata",)),
    # ProxyConfig's concurrency sets the worker count (see the ZTUNNEL_WORKER_THREADS row).
    Setting(("PROXY_CONFIG",), ("xds_address", "admin_addr", "stats_addr", "proxy_metadata", "worker_threads")),
    Setting(("PREFERED_SERVICE_NAMESPACE",), ("prefered_service_namespace",)),
    Setting(("IPV6_ENABLED",), ("ipv6_enabled",)),
    Setting(("ENABLE_ORIG_SRC",), ("enable_orig_src",)),
    Setting(
        ("KEEPALIVE_TIME", "KEEPALIVE_INTERVAL", "KEEPALIVE_RETRIES", "KEEPALIVE_ENABLED"),
        ("keepalive_time", "keepalive_interval", "keepalive_retries", "keepalive_enabled"),
    ),
    Setting(("USER_TIMEOUT_ENABLED",), ("user_timeout_enabled",)),
    Setting(("POOL_MAX_STREAMS_PER_CONNECTION",), ("pool_max_streams_per_connection",)),
    Setting(("POOL_UNUSED_RELEASE_TIMEOUT",), ("pool_unused_release_timeout",)),
    Setting(
        ("HTTP2_STREAM_WINDOW_SIZE", "HTTP2_CONNECTION_WINDOW_SIZE", "HTTP2_FRAME_SIZE"),
        ("http2_stream_window_size", "http2_connection_window_size", "http2_frame_size"),
    ),
    Setting(("TERMINATION_GRACE_PERIOD_SECONDS",), ("self_termination_deadline",)),
    Setting(("CONNECTION_TERMINATION_DEADLINE",), ("self_termination_deadline",)),
    # The number of data-plane worker processes (ztunnel/workers/); the chart sets the CPU limit and request.
    Setting(_WORKER_VARIABLES, ("worker_threads",)),
    Setting(("UNSTABLE_ENABLE_SOCKS5",), ("socks5_enabled", "socks5_addr")),
    # How a PROXY-protocol app tunnel reaches the app: over loopback (default) or to the pod's own address.
    Setting(("LOCALHOST_APP_TUNNEL",), ("localhost_app_tunnel",)),
    Setting(("ENABLE_RESPONSE_BAGGAGE",), ("enable_response_baggage",)),
    Setting(("CRL_PATH",), ("crl_path",)),
    Setting(("TLS12_ENABLED",), ("tls12_enabled",)),
    # Security: pqc would silently negotiate classical key exchange here (see pqc_refusal).
    Setting(
        ("COMPLIANCE_POLICY",),
        ("compliance_policy",),
        Support.REFUSED,
        refused_when={"COMPLIANCE_POLICY": "pqc"},
    ),
    Setting(("AUTHZ_POLICY_INFO_LOGGING",), ("authz_policy_info_logging",)),
    Setting(("RUST_LOG",), ("log_level",)),
    Setting(("LOG_FORMAT",), ("log_format",)),
    Setting(("ISTIO_META_ISTIO_VERSION",), ("istio_version",)),
    # This project's own variables.
    Setting(("ZTUNNEL_OUTBOUND_ADDR",), ("outbound_addr",)),
    Setting(("ZTUNNEL_INBOUND_ADDR",), ("inbound_addr",)),
    Setting(("ZTUNNEL_INBOUND_PLAINTEXT_ADDR",), ("inbound_plaintext_addr",)),
    Setting(("ZTUNNEL_SOCKS5_ADDR",), ("socks5_addr",)),
    Setting(("ZTUNNEL_ADMIN_ADDR",), ("admin_addr",)),
    Setting(("ZTUNNEL_STATS_ADDR",), ("stats_addr",)),
    Setting(("ZTUNNEL_READINESS_ADDR",), ("readiness_addr",)),
    Setting(("ZTUNNEL_CA_DIR",), ("ca_dir",)),
    Setting(("ZTUNNEL_VERIFY_SOURCE_IDENTITY",), ("verify_source_identity",)),
    Setting(("ZTUNNEL_INLINE_DATA_PLANE",), ("inline_data_plane",)),
    Setting(("ZTUNNEL_OPENSSL_RECORD_LAYER",), ("openssl_record_layer",)),
)

# Config fields no variable sets directly.
DERIVED_FIELDS: Mapping[str, str] = {
    "illegal_ports": "the listener ports, which no connection may target (from the ZTUNNEL_*_ADDR settings)",
    "proxy_args": "the command line, shown as proxyArgs in the config dump",
    "warnings": "the startup warnings of the settings above that have no effect yet",
}

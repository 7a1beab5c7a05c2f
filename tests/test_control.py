"""Control-plane connection settings: root certificate sources, auth headers, addresses; and the app's wiring."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ztunnel.app import StartupError, build
from ztunnel.config import DEFAULT_TOKEN_PROVIDER, AuthSource, RootCertSource, from_env
from ztunnel.control import ControlPlaneError, auth_metadata, grpc_target, load_root_pem, token_path_or_static
from ztunnel.identity.manager import SecretManager
from ztunnel.identity.spiffe import Identity
from ztunnel.testing.control_plane import control_plane, wait_until, ztunnel_env

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_root_sources(tmp_path: Path) -> None:
    assert load_root_pem(RootCertSource.parse("SYSTEM"), "XDS_ROOT_CA") is None
    f = tmp_path / "root.pem"
    f.write_text(PEM)
    assert load_root_pem(RootCertSource.parse(str(f)), "XDS_ROOT_CA") == PEM.encode()
    assert load_root_pem(RootCertSource.parse(PEM), "XDS_ROOT_CA") == PEM.encode()  # inline
    with pytest.raises(ControlPlaneError, match=r"^CA_ROOT_CA='/nope.pem': no such file and not inline PEM"):
        load_root_pem(RootCertSource.parse("/nope.pem"), "CA_ROOT_CA")
    f.write_text("not a cert")
    with pytest.raises(ControlPlaneError, match=r"^XDS_ROOT_CA: .*root.pem contains no PEM certificate$"):
        load_root_pem(RootCertSource.parse(str(f)), "XDS_ROOT_CA")


def test_auth_metadata(tmp_path: Path) -> None:
    assert auth_metadata(AuthSource("static-token"), "c1") == [
        ("authorization", "Bearer static-token"),
        ("clusterid", "c1"),
    ]
    token = tmp_path / "token"
    token.write_text("jwt\n")
    assert auth_metadata(AuthSource(str(token)), "c1")[0] == ("authorization", "Bearer jwt")
    token.write_text("")
    with pytest.raises(ControlPlaneError, match="exists, but was empty"):
        auth_metadata(AuthSource(str(token)), "c1")


def test_token_source_resolved_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The file check happens here (control.py), not when the config is parsed: a token file may appear later.
    monkeypatch.chdir(tmp_path)
    token = tmp_path / "token"
    auth = AuthSource(str(token))
    assert token_path_or_static(auth) == (None, str(token))  # no such file (yet): the value is the token itself
    token.write_text("jwt")
    assert token_path_or_static(auth) == (str(token), None)
    # Unset AUTH_TOKEN: the default projected-token file when it exists, else no token at all.
    assert token_path_or_static(AuthSource(None)) == (None, None)
    assert auth_metadata(AuthSource(None), "c1") == []
    default = tmp_path / DEFAULT_TOKEN_PROVIDER
    default.parent.mkdir(parents=True)
    default.write_text("projected\n")
    assert token_path_or_static(AuthSource(None)) == (DEFAULT_TOKEN_PROVIDER, None)
    assert auth_metadata(AuthSource(None), "c1") == [("authorization", "Bearer projected"), ("clusterid", "c1")]


def test_grpc_target() -> None:
    assert grpc_target("https://istiod.istio-system.svc:15012", "XDS_ADDRESS") == "istiod.istio-system.svc:15012"
    assert grpc_target("https://[::1]:15012/", "XDS_ADDRESS") == "[::1]:15012"
    assert grpc_target("https://istiod", "XDS_ADDRESS") == "istiod:443"
    with pytest.raises(ControlPlaneError, match=r"only https:// control-plane addresses"):
        grpc_target("http://istiod:15010", "XDS_ADDRESS")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    ip = "127.0.41.1"
    return {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": "ns/a/a",
        "ZTUNNEL_INBOUND_ADDR": f"{ip}:15008",
        "ZTUNNEL_OUTBOUND_ADDR": f"{ip}:15001",
        "ZTUNNEL_INBOUND_PLAINTEXT_ADDR": f"{ip}:15006",
        "ZTUNNEL_ADMIN_ADDR": f"{ip}:15000",
        "ZTUNNEL_STATS_ADDR": f"{ip}:15020",
        "ZTUNNEL_READINESS_ADDR": f"{ip}:15021",
        **extra,
    }


async def test_app_uses_the_xds_client_and_the_secret_manager(tmp_path: Path) -> None:
    config = (
        "workloads: [{uid: c//v1/Pod/ns/a, name: a, namespace: ns, serviceAccount: a, workloadIps: ['127.0.41.1']}]"
    )
    async with control_plane(tmp_path, config, tokens={"t": Identity("cluster.local", "ns", "a")}) as cp:
        app = build(from_env(_env(tmp_path, **ztunnel_env(cp, token="t"))))
        await app.start()
        try:
            assert app.readiness.pending() == ["state manager"] or app.readiness.ready
            await wait_until(lambda: app.readiness.ready, 5)
            assert app.state.workloads.find_uid("c//v1/Pod/ns/a") is not None
            assert isinstance(app.certs, SecretManager)
            cert = await app.certs.fetch_certificate(Identity("cluster.local", "ns", "a"))
            assert cert.roots == (cp.ca.root_cert,)
        finally:
            app.shutdown()
            await asyncio.wait_for(app.wait(), 10)
        assert len(app.tasks) == 0  # the xDS client and the certificate manager were cancelled by the drain


@pytest.mark.parametrize("var", ["XDS_ROOT_CA", "CA_ROOT_CA"])
async def test_app_refuses_to_start_without_its_root_certificate(tmp_path: Path, var: str) -> None:
    roots = {"XDS_ROOT_CA": "SYSTEM", "CA_ROOT_CA": "SYSTEM", var: str(tmp_path / "missing.pem")}
    env = _env(tmp_path, XDS_ADDRESS="https://127.0.0.1:1", FAKE_CA="false", **roots)
    app = build(from_env(env))
    try:
        with pytest.raises(StartupError, match=rf"^{var}=.*missing.pem': no such file and not inline PEM"):
            await app.start()
    finally:
        app.shutdown()
        await asyncio.wait_for(app.wait(), 10)

"""One exception root (issue 15, item 4): every error class ztunnel defines derives from :class:`ZtunnelError`."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import ztunnel
from ztunnel.errors import ZtunnelError

# Not (yet) under the root, each with its reason.
EXEMPT = {
    # A leaf module that imports nothing of the project (protobuf wire-format diagnostics); private to it.
    "ztunnel.xds.wire._Broken",
}
EXEMPT_PACKAGES: tuple[str, ...] = ()


def defined_exceptions() -> dict[str, type[BaseException]]:
    out: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(ztunnel.__path__, "ztunnel."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                out[f"{info.name}.{name}"] = obj
    return out


def test_every_project_exception_derives_from_the_root() -> None:
    found = defined_exceptions()
    outside = sorted(
        name
        for name, cls in found.items()
        if not issubclass(cls, ZtunnelError) and name not in EXEMPT and not name.startswith(EXEMPT_PACKAGES)
    )
    assert outside == []


def test_the_scan_finds_the_project_exceptions() -> None:
    found = defined_exceptions()
    # A sample across the layers, so an import failure or a changed walk cannot make the check above vacuous.
    for name in (
        "ztunnel.config.ConfigError",
        "ztunnel.tls.TlsError",
        "ztunnel.proxy.common.ProxyError",
        "ztunnel.proxy.hbone.core.HboneProtocolError",
        "ztunnel.app.StartupError",
    ):
        assert name in found, name


def test_standard_bases_are_kept() -> None:
    """Callers catch bad input as ValueError and socket failures as OSError: those bases stay."""
    from ztunnel.config import ConfigError
    from ztunnel.sockets import TransparentError

    assert issubclass(ConfigError, ValueError)
    err = TransparentError(1, "Operation not permitted")
    assert isinstance(err, OSError) and err.errno == 1 and isinstance(err, ZtunnelError)

"""Every change ztunnel makes to another library's internals, in one place.

**Process-wide patches**, installed by :func:`apply`: module attributes of hpack and aiohttp are replaced.
:func:`apply` runs once, at start (:meth:`ztunnel.app.App.start`, so the ``ztunnel`` command, the demo and every
in-process app), and in the test session (``tests/conftest.py``) and the micro-benchmarks
(``bench/micro/conftest.py``). Nothing is patched on import: importing any ztunnel module, the sans-IO HBONE core
included, leaves the other libraries as they are (``tests/test_thirdparty.py`` checks it in a fresh interpreter).
The HBONE core no longer uses h2 (it once adjusted h2's internals per connection, and hyperframe's frame ``repr``
was shortened for h2's per-frame trace line).

Each patch names the versions of its library it was written for: from the lowest that ``pyproject.toml`` admits
(read there) to the next major version, exclusive. Outside that range a patch is not applied and one warning says
which and why; a patch that correctness depends on stops startup instead (:class:`PatchError`). Inside it, each
install still checks the structure it replaces and fails loudly if that is missing. ``tests/test_thirdparty.py``
has one test per patch that fails when the internals it relies on change.

Nothing of ztunnel is imported here: any layer may use this module.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from dataclasses import dataclass

from ztunnel.errors import ZtunnelError

log = logging.getLogger("ztunnel.thirdparty")


class PatchError(ZtunnelError):
    """A patch that correctness depends on cannot be applied to the installed library; the message says which
    library, which version and what to do."""


@dataclass(frozen=True, slots=True)
class Patch:
    """One change to another library, and the versions of that library it was written for."""

    name: str  # what is replaced
    distribution: str  # the package whose version is checked
    lowest: tuple[int, ...]  # the oldest version checked (inclusive)
    below: tuple[int, ...]  # the first version not known (exclusive)
    required: bool  # correctness depends on it: outside the range, startup fails
    without: str  # what is lost when it is not applied (the warning's "why")

    @property
    def range(self) -> str:
        return f">={_dotted(self.lowest)},<{_dotted(self.below)}"

    def unsupported(self, version: str | None) -> str | None:
        """Why this patch must not be applied to ``version`` of its library (None: unknown), or None if it may."""
        if version is None:
            return f"{self.distribution}'s version is unknown (no package metadata); written for {self.range}"
        if self.lowest <= _release(version) < self.below:
            return None
        return f"{self.distribution} {version} is outside the versions it was written for ({self.range})"


def _release(version: str) -> tuple[int, ...]:
    """``"4.2.0"`` -> ``(4, 2, 0)``; pre-release and local suffixes (``rc1``, ``+x``) are ignored."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- process-wide patches ---------------------------------------------------------------------------------------

HPACK_DEBUG_LOG = Patch(
    name="hpack.hpack.log (a no-op logger)",
    distribution="hpack",
    lowest=(4, 0),  # pyproject's lowest hpack; checked in 4.0.0 and 4.2.0
    below=(5,),
    required=False,  # speed only: without it hpack logs nothing either (DEBUG is off), it just costs more
    without="hpack's per-field DEBUG calls stay (~5% of a proxy's CPU per new connection)",
)


class _NoLog:
    """hpack logs every integer and header field it encodes or decodes at DEBUG: about 20 ``Logger.debug`` calls per
    CONNECT, each also an ``isEnabledFor`` check, ~5% of a proxy's CPU per new connection (cProfile, connection-rate
    benchmark; with plain literals below: CPU per new connection ztunnel A 403 -> 341 µs, B 457 -> 390 µs). Nothing
    in ztunnel wants those lines, so hpack's module logger is replaced by this no-op. hpack only ever calls
    ``log.debug`` on it (tests/test_thirdparty.py reads hpack's source to keep that true)."""

    def debug(self, *args: object, **kwargs: object) -> None:
        pass


def _install_hpack_debug_log() -> None:
    import hpack.hpack

    if not isinstance(getattr(hpack.hpack, "log", None), logging.Logger | _NoLog):
        raise PatchError(f"hpack.hpack.log is not a logger in hpack {installed_version('hpack')}")
    hpack.hpack.log = _NoLog()  # type: ignore[assignment]


AIOHTTP_HTTP11_ERRORS = Patch(
    name="aiohttp.web_protocol.ERROR (the placeholder request of an unparsable one says HTTP/1.1)",
    distribution="aiohttp",
    lowest=(3, 9),  # pyproject's lowest; checked in 3.9.0 and 3.14.5
    below=(4,),
    # Required: what the probe and stats ports answer is wire behaviour, which must match upstream (see below).
    required=True,
    without="a request that cannot be parsed on 15000/15020/15021 is answered HTTP/1.0 400, not upstream's HTTP/1.1",
)


def _install_aiohttp_http11_errors() -> None:
    # A request aiohttp cannot parse (plaintext garbage, TLS to a plain port) is answered from a placeholder request
    # that says HTTP/1.0, so the status line reads ``HTTP/1.0 400``. Upstream's hyper answers ``HTTP/1.1 400``, and
    # clients check it (upstream's ``malicious_calls_inpod`` reads exactly that on 15020 and 15021): make the
    # placeholder HTTP/1.1. Only aiohttp servers are affected, and ztunnel's are its only ones.
    from aiohttp import web_protocol
    from aiohttp.http import HttpVersion11

    placeholder = getattr(web_protocol, "ERROR", None)
    if placeholder is None or not hasattr(placeholder, "_replace") or not hasattr(placeholder, "version"):
        raise PatchError(
            f"aiohttp {installed_version('aiohttp')} has no web_protocol.ERROR placeholder request to answer "
            "unparsable requests in HTTP/1.1 (ztunnel/thirdparty.py)"
        )
    if placeholder.version != HttpVersion11:
        web_protocol.ERROR = placeholder._replace(version=HttpVersion11)


_PROCESS_WIDE = (
    (HPACK_DEBUG_LOG, _install_hpack_debug_log),
    (AIOHTTP_HTTP11_ERRORS, _install_aiohttp_http11_errors),
)

PATCHES = tuple(p for p, _ in _PROCESS_WIDE)


_decisions: dict[str, bool] = {}  # by patch name


def enabled(patch: Patch) -> bool:
    """Whether ``patch`` applies to the installed library; decided (and warned about) once per process.

    Raises :class:`PatchError` for a required patch that does not apply."""
    decided = _decisions.get(patch.name)
    if decided is None:
        decided = _decisions[patch.name] = _decide(patch)
    return decided


def _decide(patch: Patch) -> bool:
    reason = patch.unsupported(installed_version(patch.distribution))
    if reason is None:
        return True
    if patch.required:
        raise PatchError(
            f"cannot apply {patch.name}: {reason}, and correctness depends on it ({patch.without}); install a "
            f"version in that range, or update ztunnel/thirdparty.py"
        )
    log.warning("not applying %s: %s; so %s", patch.name, reason, patch.without)
    return False


_applied = False


def apply(*, http_servers: bool = True) -> None:
    """Install the process-wide patches (idempotent) and decide them all, so that every warning
    appears at start. Raises :class:`PatchError` (before installing anything) when a required one cannot apply.

    ``http_servers=False``: a process without HTTP servers (a data-plane worker) leaves aiohttp alone, and
    unimported."""
    global _applied
    if _applied:
        return
    wanted = [(p, install) for p, install in _PROCESS_WIDE if http_servers or p is not AIOHTTP_HTTP11_ERRORS]
    usable = [(p, install) for p, install in wanted if enabled(p)]  # may raise: nothing installed yet
    for p in PATCHES:
        if http_servers or p is not AIOHTTP_HTTP11_ERRORS:
            enabled(p)
    for _, install in usable:
        install()
    _applied = True

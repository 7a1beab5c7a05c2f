from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings

from ztunnel import thirdparty
from ztunnel.testing import PROCESS_LOGS

# `make fuzz` sets HYPOTHESIS_PROFILE=fuzz: random (not derandomized) exploration, failures kept in .hypothesis/,
# and every fuzz test's bounded example count multiplied by max_examples / 100 (tests/fuzzing.py).
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("FUZZ_MAX_EXAMPLES", "10000")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config: pytest.Config) -> None:
    # The third-party patches, as App.start applies them in the product: tests that build HBONE connections or HTTP
    # servers without an App see what production sees (HTTP/1.1 400 for garbage on 15000/15020/15021, ...).
    thirdparty.apply()


# The last lines of each ztunnel process log a failing test leaves: enough to see what the process was doing.
LOG_TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failing test's report gets the tail of every ztunnel process log it started (``ZtunnelProcess`` with a
    log path), as a section of its own, so a failure in CI says what the process under test logged."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for proc in PROCESS_LOGS:
            path = proc.log_path
            if path is None:
                continue
            try:
                lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            except OSError as e:
                lines = [f"(unreadable: {e})"]
            report.sections.append((f"ztunnel log {path}", "\n".join(lines)))
    if call.when == "teardown":  # a process a wider fixture keeps running stays for the next test
        PROCESS_LOGS[:] = [p for p in PROCESS_LOGS if p.proc is not None and p.proc.poll() is None]


class _TestLoop(uvloop.Loop):
    """uvloop, but a handle left open by a test fails that test instead of hanging the run.

    uvloop's ``close()`` warns (ResourceWarning) for each handle still open and then closes it. Under
    ``filterwarnings = error`` the warning is raised inside uvloop's close-all-handles callback, the handle is never
    closed and ``close()`` waits for it forever (uvloop 0.23): one test failing before it stopped its server would
    stall the whole session in the loop fixture's teardown, out of pytest-timeout's reach. So the warnings are
    collected while closing and raised once the loop is closed.
    """

    def close(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            super().close()
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    # The product runs on uvloop; tests marked `both_loops` also run on the stdlib loop (the fallback).
    if item.get_closest_marker("both_loops") is not None:
        return {"uvloop": _TestLoop, "asyncio": asyncio.new_event_loop}
    return {"uvloop": _TestLoop}

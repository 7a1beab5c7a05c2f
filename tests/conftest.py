from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    # The product runs on uvloop; tests marked `both_loops` also run on the stdlib loop (the fallback).
    if item.get_closest_marker("both_loops") is not None:
        return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}

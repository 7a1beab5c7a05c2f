"""The per-connection CONNECT headers built in ``ztunnel/proxy/common.py``: ``forwarded`` and ``traceparent``."""

from __future__ import annotations

import ipaddress
import re

import pytest

from ztunnel.proxy.common import forwarded_header, new_traceparent

# W3C trace context version 00 as upstream sends it: random trace id and parent id, flags 00 (not sampled).
TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00")


@pytest.mark.parametrize(
    ("ip", "port", "host", "expected"),
    [
        # upstream outbound.rs `build_forwarded`
        ("1.1.1.1", 80, None, 'for="1.1.1.1:80"'),
        ("::1", 80, None, 'for="[::1]:80"'),
        ("::1", 80, "example.com", 'for="[::1]:80";host=example.com'),
        (
            "10.244.0.42",
            41234,
            "echo.default.svc.cluster.local",
            'for="10.244.0.42:41234";host=echo.default.svc.cluster.local',
        ),
        ("fd00::1", 5, "", 'for="[fd00::1]:5"'),  # an empty hostname is no hostname
    ],
)
def test_forwarded(ip: str, port: int, host: str | None, expected: str) -> None:
    assert forwarded_header((ipaddress.ip_address(ip), port), host) == expected


def test_traceparent_format_and_randomness() -> None:
    values = [new_traceparent() for _ in range(1000)]
    for v in values:
        assert TRACEPARENT.fullmatch(v), v
        assert len(v) == 55  # the length the inbound side checks before using it as the span id
    assert len(set(values)) == 1000
    assert len({v[3:35] for v in values}) == 1000  # trace ids
    assert len({v[36:52] for v in values}) == 1000  # parent ids

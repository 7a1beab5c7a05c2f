"""HTTP/2 settings of both roles from one config (``http2_settings``): the sizes from the environment, the rest as
upstream's client and server."""

from __future__ import annotations

import pytest

from ztunnel.config import from_env
from ztunnel.proxy.hbone.connection import http2_settings


@pytest.mark.parametrize("client_side", [True, False])
def test_sizes_come_from_the_config_in_both_roles(client_side: bool) -> None:
    cfg = from_env(
        {
            "XDS_ADDRESS": "",
            "HTTP2_STREAM_WINDOW_SIZE": "1000000",
            "HTTP2_CONNECTION_WINDOW_SIZE": "3000000",
            "HTTP2_FRAME_SIZE": "65536",
        }
    )
    s = http2_settings(cfg, client_side=client_side)
    assert (s.stream_window, s.connection_window, s.max_frame_size) == (1_000_000, 3_000_000, 65_536)


def test_role_values_are_upstreams() -> None:
    cfg = from_env({"XDS_ADDRESS": ""})
    client, server = http2_settings(cfg, client_side=True), http2_settings(cfg, client_side=False)
    # h2/client.rs: no stream limit advertised, 16 KiB of headers; h2/server.rs: 200 streams, 64 KiB of headers.
    assert (client.max_concurrent_streams, client.max_header_list_size) == (None, 16 * 1024)
    assert (server.max_concurrent_streams, server.max_header_list_size) == (200, 64 * 1024)
    assert (server.stream_window, server.connection_window, server.max_frame_size) == (4 << 20, 16 << 20, 1 << 20)

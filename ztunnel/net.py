"""Network address text shared by every layer (config, sockets, state, rbac, proxy, admin, DNS, control plane).

Nothing of ztunnel is imported here, so the lowest layer (``config``) can use it.
"""

from __future__ import annotations

import ipaddress


def format_addr(host: ipaddress.IPv4Address | ipaddress.IPv6Address | str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (``[::1]:15008``), as upstream prints a ``SocketAddr`` and as
    an HTTP authority writes it. ``host`` is an IP address or its text; a hostname (no ``:``) is left as it is."""
    text = str(host)
    return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"

"""The DNS proxy (15053): mesh service names answered from ztunnel's state, the rest forwarded (upstream ``dns/``).

- :mod:`~ztunnel.dns.resolver`: which service a name means and its addresses (pure, reads the state);
- :mod:`~ztunnel.dns.handler`: the protocol core, request bytes to a reply or a forward command (sans-IO);
- :mod:`~ztunnel.dns.forwarder`: asking resolv.conf's nameservers, through the socket factory;
- :mod:`~ztunnel.dns.cache`: forwarded answers kept for their TTL (negative ones per RFC 2308);
- :mod:`~ztunnel.dns.lookup`: resolving a hostname-only workload's address on demand (outbound);
- :mod:`~ztunnel.dns.server`: :class:`DnsProxy`, the UDP and TCP listeners around them;
- :mod:`~ztunnel.dns.metrics` and :mod:`~ztunnel.dns.name_util`.
"""

from __future__ import annotations

from ztunnel.dns.cache import AnswerCache, CachingForwarder
from ztunnel.dns.forwarder import Forwarder, ForwardError, Nameserver, ResolvConf, SystemForwarder, forwarder_for_mode
from ztunnel.dns.handler import Forward, Handler, Reply, Transport
from ztunnel.dns.metrics import Metrics
from ztunnel.dns.resolver import Store
from ztunnel.dns.server import DnsProxy, ResolveError

__all__ = [
    "AnswerCache",
    "CachingForwarder",
    "DnsProxy",
    "Forward",
    "ForwardError",
    "Forwarder",
    "Handler",
    "Metrics",
    "Nameserver",
    "Reply",
    "ResolvConf",
    "ResolveError",
    "Store",
    "SystemForwarder",
    "Transport",
    "forwarder_for_mode",
]

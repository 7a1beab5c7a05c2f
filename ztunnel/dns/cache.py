"""A cache of forwarded answers (upstream's resolver caches: hickory's ``cache_size`` 4096 in ``config.rs``).

What is kept, and for how long (RFC 1035 §7.4, RFC 2308):

- **Positive answers** (NOERROR with records): for the smallest TTL among the answer's records (a CNAME chain
  expires with its shortest link), at most :data:`MAX_TTL` (one day, hickory's ``positive_max_ttl``). A TTL of 0
  means "do not cache" (RFC 1035 §3.2.1) and is honoured.
- **Negative answers** (NXDOMAIN, and NODATA: NOERROR without records) only with an SOA in the authority section,
  for ``min(SOA TTL, SOA MINIMUM)`` (RFC 2308 §5), at most :data:`MAX_NEGATIVE_TTL` (three hours, the upper end of
  what RFC 2308 §5 recommends). Without an SOA a negative answer is not cached (RFC 2308 §5: "SHOULD NOT").
- **Never**: truncated answers (TC), SERVFAIL and every other error (a server that failed now may answer in a
  moment; RFC 2308 §7.1 allows caching SERVFAIL for at most 5 minutes, which only delays recovery), and answers to
  anything but one question.

An entry is keyed by the question (name without case, type, class) and the request's DO and CD bits, which change
the answer. A hit is the stored answer with every record's TTL lowered by the seconds it spent in the cache, as a
resolver must (RFC 1035 §7.4), so a client's own cache never outlives the original TTL.

Bounds: at most ``max_entries`` answers (:data:`DEFAULT_ENTRIES`, 4096 as upstream) and ``max_bytes`` of their wire
form (:data:`DEFAULT_BYTES`, 4 MiB), the least recently used going first. In-pod every pod has its own DNS proxy
and so its own cache, as upstream (one forwarder per pod); 4 MiB bounds what one pod's lookups can pin.

Pure: no I/O; the clock is injected.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset

from ztunnel.dns.forwarder import Forwarder
from ztunnel.state.workload import Workload

DEFAULT_ENTRIES = 4096  # upstream: dns_resolver_opts.cache_size = 4096
DEFAULT_BYTES = 4 << 20
MAX_TTL = 86400  # one day: hickory's default positive_max_ttl
MAX_NEGATIVE_TTL = 3 * 3600  # RFC 2308 §5: "values of one to three hours have been found to work well"

Key = tuple[dns.name.Name, int, int, bool, bool]


@dataclass(slots=True)
class _Entry:
    wire: bytes
    stored: float  # clock time it was stored
    expires: float


def cache_key(request: dns.message.Message) -> Key | None:
    """The key of ``request``'s answer, or None when it is not cacheable (not exactly one question)."""
    if len(request.question) != 1:
        return None
    q = request.question[0]
    return (
        q.name.canonicalize(),  # lowercase: DNS names compare without case
        int(q.rdtype),
        int(q.rdclass),
        bool(request.ednsflags & dns.flags.DO),
        bool(request.flags & dns.flags.CD),
    )


def _records(msg: dns.message.Message) -> list[dns.rrset.RRset]:
    return [*msg.answer, *msg.authority, *msg.additional]


def cache_ttl(answer: dns.message.Message) -> int:
    """How long ``answer`` may be cached, in seconds (0: not at all). The rules are the module docstring's."""
    if answer.flags & dns.flags.TC:
        return 0
    rcode = answer.rcode()
    if rcode == dns.rcode.NOERROR and answer.answer:
        return min(MAX_TTL, *(r.ttl for r in answer.answer))
    if rcode in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
        soas = [r for r in answer.authority if r.rdtype == dns.rdatatype.SOA]
        if not soas:
            return 0
        soa = soas[0]
        minimum = min(int(rd.minimum) for rd in soa)
        return min(MAX_NEGATIVE_TTL, soa.ttl, minimum)
    return 0


class AnswerCache:
    """Forwarded answers by question, bounded and TTL-respecting (see the module docstring)."""

    def __init__(
        self,
        max_entries: int = DEFAULT_ENTRIES,
        max_bytes: int = DEFAULT_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, request: dns.message.Message) -> dns.message.Message | None:
        """The cached answer to ``request`` (its id), TTLs lowered by the time spent here; None on a miss."""
        key = cache_key(request)
        if key is None:
            return None
        entry = self._entries.get(key)
        now = self.clock()
        if entry is None or now >= entry.expires:
            if entry is not None:
                self._drop(key)
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        answer = dns.message.from_wire(entry.wire, one_rr_per_rrset=True)
        aged = int(now - entry.stored)
        if aged:
            for rrset in _records(answer):
                if rrset.rdtype != dns.rdatatype.OPT:
                    rrset.ttl = max(0, rrset.ttl - aged)
        answer.id = request.id
        return answer

    def put(self, request: dns.message.Message, answer: dns.message.Message) -> bool:
        """Keep ``answer`` to ``request`` if the rules allow; whether it was kept."""
        key = cache_key(request)
        ttl = cache_ttl(answer)
        if key is None or ttl <= 0 or cache_key(answer) is None:
            return False
        q, a = request.question[0], answer.question[0]
        if (q.name, q.rdtype, q.rdclass) != (a.name, a.rdtype, a.rdclass):
            return False  # the answer to another question (names compare without case)
        try:
            wire = answer.to_wire()
        except Exception:  # a record dnspython cannot render again: simply not cached
            return False
        if len(wire) > self.max_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        now = self.clock()
        self._entries[key] = _Entry(wire, now, now + ttl)
        self._bytes += len(wire)
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
        return True

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        self._bytes -= len(entry.wire)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


class CachingForwarder:
    """A :class:`~ztunnel.dns.forwarder.Forwarder` that answers from an :class:`AnswerCache` when it can and keeps
    what ``inner`` answers."""

    def __init__(self, inner: Forwarder, cache: AnswerCache | None = None) -> None:
        self.inner = inner
        self.cache = cache if cache is not None else AnswerCache()

    def search_domains(self, client: Workload) -> Sequence[dns.name.Name]:
        return self.inner.search_domains(client)

    async def forward(self, request: dns.message.Message) -> dns.message.Message:
        cached = self.cache.get(request)
        if cached is not None:
            return cached
        answer = await self.inner.forward(request)
        self.cache.put(request, answer)
        return answer

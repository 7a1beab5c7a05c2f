"""The plaintext side of a relay (``PlainConnection``) as a buffered protocol, driven the way the event loop drives
it (``get_buffer`` / ``buffer_updated``), with a recording peer: what it buffers, when, and that no byte is lost.

The read buffer exists only while read bytes wait to be passed on, grows with reads that fill it, shrinks with small
reads, and an idle socket holds none (relay.py, ``_NO_BUFFER``).
"""

from __future__ import annotations

from ztunnel.proxy.relay import _INITIAL_BUFFER, _MAX_BUFFER, HDR, PlainConnection


class Recorder:
    """A peer that takes up to ``accept`` bytes per offer (None: everything), copying them."""

    def __init__(self, accept: int | None = None) -> None:
        self.accept = accept
        self.got = bytearray()
        self.eof = False

    def send_from_plain(self, plain: PlainConnection, offset: int, length: int) -> int:
        n = length if self.accept is None else min(length, self.accept)
        self.got += plain.buf[offset : offset + n]
        return n

    def plain_eof(self, plain: PlainConnection) -> None:
        self.eof = True

    def plain_lost(self, plain: PlainConnection, exc: Exception | None) -> None:
        pass

    def plain_write_paused(self, plain: PlainConnection, paused: bool) -> None:
        pass


def read(plain: PlainConnection, data: bytes) -> int:
    """One socket read of (up to the buffer's room of) ``data``, as uvloop does it; returns the bytes taken."""
    room = plain.get_buffer(-1)
    n = min(len(room), len(data))
    room[:n] = data[:n]
    plain.buffer_updated(n)
    return n


def attached(accept: int | None = None) -> tuple[PlainConnection, Recorder]:
    plain, peer = PlainConnection(), Recorder(accept)
    plain.attach(peer)
    return plain, peer


def test_idle_connection_holds_no_buffer() -> None:
    plain, peer = attached()
    assert len(plain.buf) == 0  # nothing allocated before the first read
    assert len(plain.get_buffer(-1)) == _INITIAL_BUFFER
    plain.buffer_updated(0)
    read(plain, b"hello")
    assert peer.got == b"hello"
    assert len(plain.buf) == 0  # passed on: given back until the next read


def test_filled_reads_grow_the_buffer_to_the_cap_and_small_reads_shrink_it() -> None:
    plain, peer = attached()
    sizes = []
    sent = bytearray()
    for i in range(12):
        chunk = bytes([i]) * len(plain.get_buffer(-1))
        sizes.append(len(chunk))
        assert read(plain, chunk) == len(chunk)
        sent += chunk
    assert sizes[:3] == [_INITIAL_BUFFER, 2 * _INITIAL_BUFFER, 4 * _INITIAL_BUFFER]
    assert max(sizes) == sizes[-1] == _MAX_BUFFER
    for _ in range(20):
        read(plain, b"x")
        sent += b"x"
    assert len(plain.get_buffer(-1)) == _INITIAL_BUFFER  # 256 KiB -> 1 KiB after 8 small reads
    assert peer.got == sent


def test_a_partial_read_of_a_large_buffer_keeps_its_size() -> None:
    # A bulk sender whose reads do not always fill the buffer must not shrink it (1/8 is the line).
    plain, _ = attached()
    while len(plain.get_buffer(-1)) < _MAX_BUFFER:
        read(plain, b"z" * len(plain.get_buffer(-1)))
    read(plain, b"z" * (_MAX_BUFFER // 2))
    assert len(plain.get_buffer(-1)) == _MAX_BUFFER


def test_bytes_the_peer_cannot_take_stay_buffered_in_order() -> None:
    plain, peer = attached(accept=3)
    read(plain, b"abcdefgh")
    assert peer.got == b"abc"
    assert plain._pause_reasons  # the rest waits, reading stops (the transport is paused when there is one)
    assert bytes(plain.buf[plain.start : plain.end]) == b"defgh"
    peer.accept = None
    plain.push()
    assert peer.got == b"abcdefgh"
    assert not plain._pause_reasons


def test_bytes_read_before_attach_and_preloaded_bytes_are_passed_on_first() -> None:
    big = PlainConnection()
    big.preload(b"pipelined-" * 200)  # more than the initial buffer holds: the buffer fits it exactly
    assert len(big.get_buffer(-1)) == 0  # full: SOCKS5 keeps reading paused until the relay is attached
    peer = Recorder()
    big.attach(peer)
    assert peer.got == b"pipelined-" * 200
    plain = PlainConnection()
    plain.preload(b"pipelined")
    read(plain, b"+more")
    plain.attach(peer := Recorder())
    assert peer.got == b"pipelined+more"
    assert plain.start == plain.end == HDR


def test_eof_after_buffered_bytes_comes_after_them() -> None:
    plain, peer = attached(accept=2)
    read(plain, b"1234")
    plain.eof_received()
    assert not peer.eof
    peer.accept = None
    plain.push()
    assert peer.got == b"1234" and peer.eof


def test_preloaded_bytes_once_passed_on_leave_no_buffer() -> None:
    """The SOCKS5 request's pipelined first bytes are preloaded into a buffer; once the relay has passed them on, an
    idle tunnel holds no buffer (it held the 1 KiB one, ~9 % of an idle tunnel's heap, before)."""
    plain = PlainConnection()
    plain.preload(b"x")
    assert len(plain.buf) > 0
    plain.attach(peer := Recorder())
    assert peer.got == b"x"
    assert len(plain.buf) == 0 and plain.start == plain.end == HDR
    read(plain, b"more")  # and the next read allocates afresh
    assert peer.got == b"xmore"
    held = PlainConnection()
    held.preload(b"abc")
    held.attach(Recorder(accept=1))  # what the peer cannot take yet stays buffered
    assert len(held.buf) > 0 and held.end - held.start == 2


def _bulk(plain: PlainConnection) -> None:
    """Reads that fill the buffer until it has its largest size."""
    while len(plain.get_buffer(-1)) < _MAX_BUFFER:
        read(plain, b"z" * len(plain.get_buffer(-1)))


def test_a_drained_largest_buffer_is_reused_by_the_next_read_not_allocated_again() -> None:
    plain, peer = attached()
    _bulk(plain)
    first = plain.buf
    read(plain, b"a" * (_MAX_BUFFER // 2))  # a big read that does not fill it: drained, given back
    assert len(plain.buf) == 0
    plain.get_buffer(-1)
    # Before: a fresh 256 KiB bytearray (malloc and memset) for every such read.
    assert plain.buf is first
    other, _ = attached()
    _bulk(other)
    assert other.buf is not first  # one socket's buffer is never another's at the same time
    read(plain, b"b" * 1000)
    assert peer.got.endswith(b"a" * (_MAX_BUFFER // 2) + b"b" * 1000)


def test_a_buffer_a_transport_kept_is_never_reused() -> None:
    class Keeper(Recorder):
        """A peer whose transport keeps a view of what it took (the socket could not take it at once)."""

        def __init__(self) -> None:
            super().__init__()
            self.kept: list[memoryview] = []
            self.keeping = False

        def send_from_plain(self, plain: PlainConnection, offset: int, length: int) -> int:
            if self.keeping:
                self.kept.append(plain.view[offset : offset + length])
                plain.pin()
            return length

    plain, keeper = PlainConnection(), Keeper()
    plain.attach(keeper)
    _bulk(plain)
    keeper.keeping = True
    other, _ = attached()
    for i in range(8):
        read(plain, bytes([65 + i]) * (_MAX_BUFFER // 2))  # kept by the transport: must not become a spare
        _bulk(other)  # another socket's reads in between, into whatever buffers it gets (the spares)
        read(other, b"x" * (_MAX_BUFFER // 2))
    assert [bytes(v) for v in keeper.kept] == [bytes([65 + i]) * (_MAX_BUFFER // 2) for i in range(8)]

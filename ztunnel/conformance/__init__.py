"""HBONE conformance checker: holds any HBONE peer to upstream ztunnel's behaviour (docs/conformance.md).

Two modes: against a *terminator* (``--target HOST:15008``: the checker is the client, :mod:`.target`), and against an
*originator* (``--serve ADDR``: the checker is the server, :mod:`.originator`). Checks are data
(:class:`~ztunnel.conformance.checks.Check`); the HTTP/2 side is raw frames (:mod:`.wire`), independent of the
proxy's own HBONE code.
"""

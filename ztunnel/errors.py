"""The root of ztunnel's own exceptions.

Every error class the project defines derives from :class:`ZtunnelError` (keeping a standard base where callers
catch that, such as ``ValueError`` for bad input or ``OSError`` for socket failures), so one ``except`` can tell
ztunnel's failures, whose messages are written for the operator, from bugs. This module imports nothing, so every
layer can use it.
"""

from __future__ import annotations


class ZtunnelError(Exception):
    """A failure ztunnel detected and can explain: the message says what and where (file, field, peer)."""

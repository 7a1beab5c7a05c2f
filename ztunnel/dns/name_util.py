"""Label arithmetic on DNS names, as upstream ``dns/name_util.rs``: does a name end in a domain, and strip it.

Labels compare case-insensitively (DNS names do, RFC 4343); a name is never "in" a domain it equals.
"""

from __future__ import annotations

import dns.name


def labels(name: dns.name.Name) -> tuple[bytes, ...]:
    """The name's labels without the root label (``a.b.`` and ``a.b`` both give ``(b"a", b"b")``)."""
    return name.labels[:-1] if name.is_absolute() else name.labels


def has_domain(name: dns.name.Name, domain: dns.name.Name) -> bool:
    """True if ``name`` ends with ``domain``'s labels and has at least one label more. Wildcards never match."""
    name_labels, domain_labels = labels(name), labels(domain)
    if is_wildcard(domain) or len(name_labels) <= len(domain_labels):
        return False
    tail = name_labels[len(name_labels) - len(domain_labels) :]
    return all(a.lower() == b.lower() for a, b in zip(tail, domain_labels, strict=True))


def trim_domain(name: dns.name.Name, domain: dns.name.Name) -> dns.name.Name | None:
    """``name`` without ``domain``'s labels, as a relative name; None if it is not in the domain."""
    if not has_domain(name, domain):
        return None
    name_labels = labels(name)
    return dns.name.Name(name_labels[: len(name_labels) - len(labels(domain))])


def is_wildcard(name: dns.name.Name) -> bool:
    return bool(name.labels) and name.labels[0] == b"*"

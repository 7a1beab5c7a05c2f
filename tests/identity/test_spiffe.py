"""Identity.parse / __str__: exactly upstream's ``Identity::from_str`` (``spiffe://td/ns/<ns>/sa/<sa>``)."""

from __future__ import annotations

import pytest

from ztunnel.identity.spiffe import Identity, IdentityError


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("spiffe://cluster.local/ns/default/sa/client", Identity("cluster.local", "default", "client")),
        ("spiffe://td.example/ns/istio-system/sa/ztunnel", Identity("td.example", "istio-system", "ztunnel")),
        # Segment values are taken as they are: markers are only checked in the marker positions.
        ("spiffe://td/ns/sa/sa/ns", Identity("td", "sa", "ns")),
    ],
)
def test_round_trip(uri: str, expected: Identity) -> None:
    parsed = Identity.parse(uri)
    assert parsed == expected
    assert str(parsed) == uri
    assert Identity.parse(str(expected)) == expected
    assert Identity.try_parse(uri) == expected


def test_str_is_the_spiffe_uri() -> None:
    assert str(Identity("cluster.local", "ns1", "sa1")) == "spiffe://cluster.local/ns/ns1/sa/sa1"


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("cluster.local/ns/default/sa/client", "must start with 'spiffe://'"),
        ("http://cluster.local/ns/default/sa/client", "must start with 'spiffe://'"),
        ("SPIFFE://cluster.local/ns/default/sa/client", "must start with 'spiffe://'"),
        ("", "must start with 'spiffe://'"),
        ("spiffe://cluster.local/ns/default/sa", "expected spiffe://<trust-domain>/ns/<ns>/sa/<sa>"),  # 4 segments
        ("spiffe://cluster.local/ns/default/sa/client/x", "expected spiffe://"),  # 6 segments
        ("spiffe://cluster.local/ns/default/sa/client/", "expected spiffe://"),  # trailing slash
        ("spiffe://cluster.local/namespace/default/sa/client", "expected spiffe://"),  # wrong ns marker
        ("spiffe://cluster.local/ns/default/serviceaccount/client", "expected spiffe://"),  # wrong sa marker
        ("spiffe://cluster.local/sa/default/ns/client", "expected spiffe://"),  # markers swapped
        ("spiffe://cluster.local/NS/default/SA/client", "expected spiffe://"),  # markers are case-sensitive
        ("spiffe://", "expected spiffe://"),
    ],
)
def test_rejects(uri: str, reason: str) -> None:
    with pytest.raises(IdentityError) as info:
        Identity.parse(uri)
    message = str(info.value)
    assert repr(uri) in message, message  # the message names the offending value
    assert reason in message
    assert isinstance(info.value, ValueError)
    assert Identity.try_parse(uri) is None

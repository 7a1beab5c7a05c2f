"""ServiceDescription.of: made once per service name, and holding no Service object an xDS update replaced."""

from __future__ import annotations

import sys

from ztunnel.state.service import Service
from ztunnel.state.upstream import ServiceDescription


def test_descriptions_are_reused_per_name_and_keep_no_service_alive() -> None:
    old = Service("reviews", "default", "reviews.default.svc.cluster.local")
    before = sys.getrefcount(old)
    first = ServiceDescription.of(old)
    assert sys.getrefcount(old) == before, "the cache holds the Service (and its endpoints) alive"
    assert (first.hostname, first.name, first.namespace) == ("reviews.default.svc.cluster.local", "reviews", "default")
    new = Service("reviews", "default", "reviews.default.svc.cluster.local", ports={80: 8080})  # an xDS update
    assert ServiceDescription.of(new) is first
    renamed = Service("reviews-v2", "default", "reviews.default.svc.cluster.local")
    assert ServiceDescription.of(renamed).name == "reviews-v2"

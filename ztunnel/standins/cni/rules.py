"""istio-cni's in-pod redirection rules, applied to and removed from a pod's network namespace.

istio-cni applies this rule set to every captured pod (``istio:cni/pkg/iptables/iptables.go::AppendInpodRules``):
nat REDIRECTs of the pod's outbound TCP to 15001 and inbound TCP to 15006 (15008 excepted), optional DNS capture to
15053, all skipping packets that carry ztunnel's mark 0x539; and, for replies to connections ztunnel opened with a
spoofed source, a connmark 0x111 plus ``ip rule fwmark 0x111/0xfff lookup 100`` with a local default route in
table 100.

:func:`build_inpod_rules` is the pure rule builder (:func:`render_restore` prints it as ``iptables-restore`` input,
:func:`build_removal` computes its removal from ``iptables-save`` output); :func:`apply_inpod_rules` /
:func:`remove_inpod_rules` run ``iptables-restore --noflush`` (and ``ip6tables-restore``) and ``ip rule``/``ip route``
inside the pod's namespace through ``nsenter``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ztunnel.errors import ZtunnelError

# istio-cni's constants (cni/pkg/config/config.go).
INPOD_MARK = 0x539  # 1337: ztunnel's SO_MARK; its own packets are never redirected
INPOD_MASK = 0xFFF
INPOD_TPROXY_MARK = 0x111  # connmark of connections ztunnel accepted, restored on their replies
INPOD_TPROXY_MASK = 0xFFF
INPOD_RESTORE_MASK = 0xFFFFFFFF
ROUTE_TABLE_INBOUND = 100
RULE_PRIORITY = 32764
OUTBOUND_PORT = 15001
INBOUND_PLAINTEXT_PORT = 15006
INBOUND_PORT = 15008
DNS_PORT = 15053
# Kubelet probes are SNATed to this address on the node, so the pod rules can let them in unredirected.
PROBE_SNAT_V4 = "169.254.7.127"
PROBE_SNAT_V6 = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"

_NETNS_DIR = Path("/run/netns")

_CHAINS = ("ISTIO_PRERT", "ISTIO_OUTPUT")
_BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``-A <chain> <params>`` line of a table."""

    table: str
    chain: str
    params: str

    def __str__(self) -> str:
        return f"-A {self.chain} {self.params}"


def build_inpod_rules(*, ipv6: bool = False, dns_capture: bool = False) -> list[Rule]:
    """The in-pod rule set, in istio-cni's order (``AppendInpodRules``): mangle, nat, then raw (DNS capture only).

    The v6 variant differs only in its addresses: ``::1/128`` for localhost and the v6 probe SNAT address.
    """
    localhost = "::1/128" if ipv6 else "127.0.0.1/32"
    probe = PROBE_SNAT_V6 if ipv6 else PROBE_SNAT_V4
    mark = f"{INPOD_MARK:#x}/{INPOD_MASK:#x}"
    tproxy = f"{INPOD_TPROXY_MARK:#x}/{INPOD_TPROXY_MASK:#x}"
    restore = f"{INPOD_RESTORE_MASK:#x}"
    rules = [
        # mangle: ztunnel's marked packets arriving (its spoofed-source connections' replies) tag the connection;
        # the tag is restored on the way out so the fwmark rule routes replies back into ztunnel.
        Rule("mangle", "PREROUTING", "-j ISTIO_PRERT"),
        Rule("mangle", "OUTPUT", "-j ISTIO_OUTPUT"),
        Rule("mangle", "ISTIO_PRERT", f"-m mark --mark {mark} -j CONNMARK --set-xmark {tproxy}"),
        Rule(
            "mangle",
            "ISTIO_OUTPUT",
            f"-m connmark --mark {tproxy} -j CONNMARK --restore-mark --nfmask {restore} --ctmask {restore}",
        ),
        Rule("nat", "OUTPUT", "-j ISTIO_OUTPUT"),
        Rule("nat", "PREROUTING", "-j ISTIO_PRERT"),
        Rule("nat", "ISTIO_PRERT", f"-s {probe} -p tcp -m tcp -j ACCEPT"),
        Rule("nat", "ISTIO_OUTPUT", f"-d {probe} -p tcp -m tcp -j ACCEPT"),
        Rule(
            "nat",
            "ISTIO_PRERT",
            f"! -d {localhost} -p tcp ! --dport {INBOUND_PORT} -m mark ! --mark {mark} "
            f"-j REDIRECT --to-ports {INBOUND_PLAINTEXT_PORT}",
        ),
    ]
    if dns_capture:
        rules += [
            Rule(
                "nat",
                "ISTIO_OUTPUT",
                f"! -o lo -p udp -m mark ! --mark {mark} -m udp --dport 53 -j REDIRECT --to-port {DNS_PORT}",
            ),
            Rule(
                "nat",
                "ISTIO_OUTPUT",
                f"! -d {localhost} -p tcp --dport 53 -m mark ! --mark {mark} -j REDIRECT --to-ports {DNS_PORT}",
            ),
        ]
    rules += [
        Rule("nat", "ISTIO_OUTPUT", f"-p tcp -m mark --mark {tproxy} -j ACCEPT"),
        Rule("nat", "ISTIO_OUTPUT", f"! -d {localhost} -o lo -j ACCEPT"),
        Rule(
            "nat",
            "ISTIO_OUTPUT",
            f"! -d {localhost} -p tcp -m mark ! --mark {mark} -j REDIRECT --to-ports {OUTBOUND_PORT}",
        ),
    ]
    if dns_capture:
        # Separate conntrack zones for the pod's DNS and ztunnel's upstream DNS, so the two flows (same 5-tuple
        # after the REDIRECT) cannot clash.
        rules += [
            Rule("raw", "PREROUTING", "-j ISTIO_PRERT"),
            Rule("raw", "OUTPUT", "-j ISTIO_OUTPUT"),
            Rule("raw", "ISTIO_OUTPUT", f"-p udp -m mark --mark {mark} -m udp --dport 53 -j CT --zone 1"),
            Rule("raw", "ISTIO_PRERT", f"-p udp -m mark ! --mark {mark} -m udp --sport 53 -j CT --zone 1"),
        ]
    return rules


def render_restore(rules: Sequence[Rule]) -> str:
    """``iptables-restore`` input for ``rules``: per table, ``-N`` for each non-builtin chain in order of first use
    (istio's ``buildRestore``), the ``-A`` lines, ``COMMIT``. Tables appear in order of first use."""
    tables: dict[str, list[str]] = {}
    created: dict[str, list[str]] = {}
    for r in rules:
        tables.setdefault(r.table, [])
        chains = created.setdefault(r.table, [])
        if r.chain not in _BUILTIN_CHAINS and r.chain not in chains:
            chains.append(r.chain)
        tables[r.table].append(str(r))
    out: list[str] = []
    for table, lines in tables.items():
        out.append(f"* {table}")
        out += [f"-N {c}" for c in created[table]]
        out += lines
        out.append("COMMIT")
    return "\n".join(out) + "\n"


def build_removal(saved: str) -> str:
    """``iptables-restore --noflush`` input that removes what :func:`build_inpod_rules` added, given the pod's
    current ``iptables-save`` output: the jumps into our chains, then the chains themselves. Only what exists is
    removed, so a partly applied (or absent) rule set is cleaned up without errors. Empty when nothing is there."""
    out: list[str] = []
    table = ""
    chains: list[str] = []
    jumps: list[str] = []

    def flush() -> None:
        if table and (chains or jumps):
            out.append(f"* {table}")
            out.extend(jumps)
            out.extend(f"-F {c}" for c in chains)
            out.extend(f"-X {c}" for c in chains)
            out.append("COMMIT")

    for line in saved.splitlines():
        if line.startswith("*"):
            table, chains, jumps = line[1:].strip(), [], []
        elif line.startswith("COMMIT"):
            flush()
            table = ""
        elif line.startswith(":"):
            name = line[1:].split()[0]
            if name in _CHAINS:
                chains.append(name)
        elif line.startswith("-A "):
            parts = line.split()
            if parts[1] in _BUILTIN_CHAINS and parts[-2:-1] == ["-j"] and parts[-1] in _CHAINS:
                jumps.append("-D" + line[2:])
    return "\n".join(out) + "\n" if out else ""


class InpodRulesError(ZtunnelError, RuntimeError):
    """A command applying or removing the in-pod rules failed; the message names the command, netns and stderr."""


def netns_path(netns: str | os.PathLike[str]) -> Path:
    """A netns name (``ip netns`` style, under /run/netns) or a path (``/proc/<pid>/ns/net``, a bind mount)."""
    s = os.fspath(netns)
    return Path(s) if "/" in s else _NETNS_DIR / s


def _run_in_netns(path: Path, argv: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        raise InpodRulesError("nsenter (util-linux) is not installed; it runs the rule commands inside the pod netns")
    if shutil.which(argv[0]) is None:
        raise InpodRulesError(f"{argv[0]} is not installed (apt-get install iptables iproute2)")
    try:
        return subprocess.run(
            [nsenter, f"--net={path}", "--", *argv],
            check=False,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired as e:
        raise InpodRulesError(f"`{' '.join(argv)}` in netns {path} did not finish within 30 s") from e


def _check(path: Path, argv: Sequence[str], stdin: str | None = None, hint: str = "") -> str:
    p = _run_in_netns(path, argv, stdin)
    if p.returncode != 0:
        detail = (p.stderr or p.stdout).strip()
        raise InpodRulesError(
            f"`{' '.join(argv)}` failed in netns {path} (exit {p.returncode}): {detail}{hint}"
            + (f"\ninput was:\n{stdin}" if stdin else "")
        )
    return p.stdout


def _ipv6_usable(ipv6: bool) -> bool:
    return ipv6 and shutil.which("ip6tables-restore") is not None and os.path.exists("/proc/net/if_inet6")


def _families(ipv6: bool) -> list[tuple[str, str, str]]:
    """(ip family flag, iptables binary prefix, local default route) per address family in use."""
    fams = [("-4", "iptables", "0.0.0.0/0")]
    if _ipv6_usable(ipv6):
        fams.append(("-6", "ip6tables", "::/0"))
    return fams


def _require_netns(path: Path) -> None:
    if not path.exists():
        raise InpodRulesError(f"network namespace {path} does not exist")


def apply_inpod_rules(netns: str | os.PathLike[str], dns_capture: bool = False, ipv6: bool = True) -> None:
    """Apply the in-pod rule set and policy routing to a pod's network namespace (name or path).

    Idempotent: rules already there (from an earlier apply) are removed first, so the result is exactly one copy.
    IPv6 rules are applied too when ``ipv6`` and the host has IPv6 and ``ip6tables-restore``. On failure whatever
    was applied is removed again and :class:`InpodRulesError` says which command failed, where, and why.
    """
    path = netns_path(netns)
    _require_netns(path)
    remove_inpod_rules(path, ipv6=ipv6)
    try:
        for fam, binary, default in _families(ipv6):
            text = render_restore(build_inpod_rules(ipv6=fam == "-6", dns_capture=dns_capture))
            _check(path, [f"{binary}-restore", "--noflush", "--wait", "10"], text)
            _check(path, ["ip", fam, "rule", "add", *_rule_selector()])
            _check(
                path,
                ["ip", fam, "route", "add", "local", default, "dev", "lo", "table", str(ROUTE_TABLE_INBOUND)],
                hint=" (is the pod's lo interface up?)",
            )
    except InpodRulesError:
        with contextlib.suppress(InpodRulesError):
            remove_inpod_rules(path, ipv6=ipv6)
        raise


def _rule_selector() -> list[str]:
    return [
        "fwmark",
        f"{INPOD_TPROXY_MARK:#x}/{INPOD_TPROXY_MASK:#x}",
        "pref",
        str(RULE_PRIORITY),
        "lookup",
        str(ROUTE_TABLE_INBOUND),
    ]


def remove_inpod_rules(netns: str | os.PathLike[str], ipv6: bool = True) -> None:
    """Remove exactly what :func:`apply_inpod_rules` added (chains, jumps, the fwmark rule, the table-100 route);
    anything already gone is skipped. Other rules in the namespace are left alone."""
    path = netns_path(netns)
    _require_netns(path)
    for fam, binary, default in _families(ipv6):
        text = build_removal(_check(path, [f"{binary}-save"]))
        if text:
            _check(path, [f"{binary}-restore", "--noflush", "--wait", "10"], text)
        rules = _check(path, ["ip", fam, "rule", "show", "pref", str(RULE_PRIORITY)])
        if f"fwmark {INPOD_TPROXY_MARK:#x}/{INPOD_TPROXY_MASK:#x} lookup {ROUTE_TABLE_INBOUND}" in rules:
            _check(path, ["ip", fam, "rule", "del", *_rule_selector()])
        table = ["table", str(ROUTE_TABLE_INBOUND)]
        shown = _run_in_netns(path, ["ip", fam, "route", "show", *table])
        if shown.returncode != 0 and "does not exist" not in shown.stderr:  # no table 100 at all is fine
            raise InpodRulesError(f"`ip {fam} route show table 100` failed in netns {path}: {shown.stderr.strip()}")
        routes = shown.stdout if shown.returncode == 0 else ""
        if any(line.startswith("local default dev lo") for line in routes.splitlines()):
            _check(path, ["ip", fam, "route", "del", "local", default, "dev", "lo", *table])

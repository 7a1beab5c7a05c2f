"""The local config file (``LOCAL_XDS_PATH`` / ``LOCAL_XDS``) fuzzed.

Property: any text (any file) is either a config or a :class:`LocalConfigError` whose message starts with the file
name and names where the problem is (``workloads[2].workloadIps[0]``, or the YAML line and column); no other
exception, no hang, no message that grows with what an alias expands to.

Inputs: random text and YAML-ish token soup; valid documents generated from the schema (which must load, and
apply to the proxy state); the same documents with one field replaced by a value of the wrong type, a key removed
or an unknown key added (the error must name that field or an ancestor of it); and random bytes in a file.
"""

from __future__ import annotations

import ipaddress
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import fuzz_settings
from ztunnel.localconfig import LocalConfigError, load_local_config, parse_local_config
from ztunnel.rbac import Connection
from ztunnel.state import ProxyState
from ztunnel.state.workload import NetworkAddress

SOURCE = "fuzz.yaml"

# -- valid documents -----------------------------------------------------------------------------------------------

names = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
ipv4 = st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n)))
ipv6 = st.integers(0, 2**128 - 1).map(lambda n: str(ipaddress.IPv6Address(n)))
ips = st.one_of(ipv4, ipv4, ipv6)
ports = st.integers(0, 65535)
port_maps = st.dictionaries(ports, ports, max_size=3)
hostnames = st.builds(lambda a, b: f"{a}.{b}.svc.cluster.local", names, names)
service_keys = st.builds(lambda ns, h: f"{ns}/{h}", names, hostnames)


def optional(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A mapping with any subset of ``fields``."""
    return st.fixed_dictionaries({}, optional=fields)


gateways = st.fixed_dictionaries(
    {
        "destination": st.one_of(
            st.builds(lambda n, ip: f"{n}/{ip}", st.sampled_from(["", "net1"]), ips),
            st.fixed_dictionaries({"namespace": names, "hostname": hostnames}),
        )
    },
    optional={"hboneMtlsPort": ports},
)

workloads = st.fixed_dictionaries(
    {"namespace": names, "workloadIps": st.lists(ips, max_size=3)},
    optional={
        "uid": names.map(lambda n: f"cluster1//v1/Pod/ns/{n}"),
        "name": names,
        "serviceAccount": names,
        "trustDomain": st.sampled_from(["cluster.local", "td.example"]),
        "protocol": st.sampled_from(["TCP", "HBONE"]),
        "networkMode": st.sampled_from(["Standard", "HostNetwork"]),
        "node": names,
        "network": st.sampled_from(["", "net1"]),
        "waypoint": gateways,
        "networkGateway": gateways,
        "applicationTunnel": st.fixed_dictionaries(
            {"protocol": st.sampled_from(["NONE", "PROXY"])}, optional={"port": ports}
        ),
        "authorizationPolicies": st.lists(st.builds(lambda a, b: f"{a}/{b}", names, names), max_size=2),
        "status": st.sampled_from(["Healthy", "Unhealthy"]),
        "clusterId": names,
        "locality": optional(region=names, zone=names, subzone=names),
        "capacity": st.integers(0, 2**32 - 1),
        "workloadName": names,
        "workloadType": st.sampled_from(["deployment", "pod", "job"]),
        "canonicalName": names,
        "canonicalRevision": names,
        "hostname": names,
        "nativeTunnel": st.booleans(),
        "services": st.dictionaries(service_keys, port_maps, max_size=2),
    },
)

services = st.fixed_dictionaries(
    {"name": names, "namespace": names, "hostname": hostnames},
    optional={
        "vips": st.lists(ips.map(lambda ip: f"/{ip}"), max_size=2),
        "cidrVips": st.lists(st.sampled_from(["/10.96.0.0/12", "net1/fd00::/64"]), max_size=2),
        "ports": port_maps,
        "endpoints": st.dictionaries(
            names,
            st.fixed_dictionaries(
                {"workloadUid": names},
                optional={"port": port_maps, "status": st.sampled_from(["Healthy", "Unhealthy"])},
            ),
            max_size=2,
        ),
        "subjectAltNames": st.lists(names, max_size=2),
        "waypoint": gateways,
        "weightedWaypoints": st.lists(
            st.fixed_dictionaries({"destination": gateways, "weight": st.integers(0, 100)}), max_size=2
        ),
        "loadBalancer": optional(
            routingPreferences=st.lists(st.sampled_from(["Region", "Zone", "Subzone", "Node", "Cluster", "Network"])),
            mode=st.sampled_from(["Standard", "Strict", "Failover", "Passthrough"]),
            healthPolicy=st.sampled_from(["OnlyHealthy", "AllowAll"]),
        ),
        "ipFamilies": st.sampled_from(["Dual", "IPv4", "IPv6"]),
        "canonical": st.booleans(),
        "visibility": st.sampled_from(["Public", "Namespace"]),
    },
)

string_matches = st.one_of(
    st.just("Presence"),
    st.builds(lambda k, v: {k: v}, st.sampled_from(["Exact", "Prefix", "Suffix"]), names),
)
matches = optional(
    namespaces=st.lists(string_matches, max_size=2),
    notNamespaces=st.lists(string_matches, max_size=2),
    principals=st.lists(string_matches, max_size=2),
    serviceAccounts=st.lists(st.fixed_dictionaries({"namespace": names, "serviceAccount": names}), max_size=2),
    sourceIps=st.lists(st.one_of(ips, st.just("10.0.0.0/8")), max_size=2),
    destinationIps=st.lists(ips, max_size=2),
    destinationPorts=st.lists(ports, max_size=3),
    notDestinationPorts=st.lists(ports, max_size=3),
)
policies = st.fixed_dictionaries(
    {
        "name": names,
        "scope": st.sampled_from(["Global", "Namespace", "WorkloadSelector"]),
        "action": st.sampled_from(["Allow", "Deny"]),
    },
    optional={
        "namespace": names,
        "dryRun": st.booleans(),
        "rules": st.lists(st.lists(st.lists(matches, max_size=2), max_size=2), max_size=2),
    },
)


def _unique(items: list[dict[str, Any]], key: Any) -> list[dict[str, Any]]:
    seen, out = set(), []
    for item in items:
        k = key(item)
        if k not in seen:
            seen.add(k)
            out.append(item)
    return out


documents = st.fixed_dictionaries(
    {},
    optional={
        "workloads": st.lists(workloads, max_size=3).map(lambda ws: _unique(ws, lambda w: w.get("uid", ""))),
        "services": st.lists(services, max_size=3).map(
            lambda ss: _unique(ss, lambda s: (s["namespace"], s["hostname"]))
        ),
        "policies": st.lists(policies, max_size=2).map(
            lambda ps: _unique(ps, lambda p: (p.get("namespace", ""), p["name"]))
        ),
    },
)

# -- mutations -----------------------------------------------------------------------------------------------------

# Mappings whose keys are data (ports, service keys, workload uids), not field names: mutated whole, never entered.
_DATA_MAPS = {"ports", "services", "endpoints", "port"}

wrong_values: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from(
        [None, 0, -1, 65536, 2**32, 2**64, 1.5, True, "", "x", "²", "٨٠", "1e99", "0x10", "not/an/ip", "::1:80", [], {}]
    ),
    st.sampled_from([[1, 2], {"a": 1}, [[[]]], {"Exact": 1}, {"Exact": "a", "Prefix": "b"}, "2020-13-45"]),
    st.text(max_size=20),
    st.integers(),
)


def _paths(node: Any, path: str, out: list[tuple[str, Any, Any]]) -> None:
    """Every (path, container, key) below ``node``, written the way the loader writes paths."""
    if isinstance(node, dict):
        for k, v in node.items():
            p = f"{path}.{k}" if path else str(k)
            out.append((p, node, k))
            if k not in _DATA_MAPS:
                _paths(v, p, out)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            p = f"{path}[{i}]"
            out.append((p, node, i))
            _paths(v, p, out)


@st.composite
def broken_documents(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A valid document with one change; returns it and the path of the change."""
    doc = draw(documents)
    spots: list[tuple[str, Any, Any]] = []
    _paths(doc, "", spots)
    kind = draw(st.sampled_from(["replace", "replace", "remove", "add"]))
    if not spots or kind == "add":
        containers = [(p, c[k]) for p, c, k in spots if isinstance(c[k], dict) and k not in _DATA_MAPS]
        path, target = draw(st.sampled_from([("", doc), *containers]))
        key = draw(st.sampled_from(["bogus", "Namespace", "workloadIPs", "uid "]))
        target[key] = draw(wrong_values)
        return doc, f"{path}.{key}" if path else key
    path, container, key = draw(st.sampled_from(spots))
    if kind == "remove" and isinstance(container, dict):
        del container[key]
    else:
        container[key] = draw(wrong_values)
    return doc, path


# -- properties ----------------------------------------------------------------------------------------------------


def load(text: str) -> ProxyState | LocalConfigError:
    """Parse and apply ``text``; the error if it is refused. Anything else raised fails the test."""
    try:
        cfg = parse_local_config(text, SOURCE)
    except LocalConfigError as e:
        assert str(e).startswith(f"{SOURCE}: "), e
        assert e.problem, e
        assert len(str(e)) < 2000, f"message of {len(str(e))} characters"
        return e
    state = ProxyState()
    state.apply(cfg.update)
    # The result is usable: lookups and policy evaluation on it do not raise.
    for w in state.workloads:
        for ip in w.workload_ips:
            state.find_address(NetworkAddress(w.network, ip))
            conn = Connection(ip, 1, ip, 80, w.identity)
            state.policies.plan(w.namespace, w.authorization_policies).evaluate(conn)
    for s in state.services:
        state.find_service_by_hostname(s.hostname, s.namespace)
    return state


yaml_soup = st.lists(
    st.sampled_from(
        [
            "workloads",
            "services",
            "policies",
            ":",
            " ",
            "\n",
            "- ",
            "[",
            "]",
            "{",
            "}",
            ",",
            "&a ",
            "*a",
            "!!int ",
            "!!binary ",
            "'",
            '"',
            "#",
            "? ",
            "<<: ",
            "|",
            ">",
            "---",
            "...",
            "%YAML 1.1\n",
            "\t",
            "1",
            "0x",
            "-",
            ".",
            "namespace",
            "workloadIps",
            "ports",
            "80",
            "10.0.0.1",
            "~",
            "null",
            "true",
            "\\",
            "\x00",
            "\ufeff",
            "\ud800",
        ]
    ),
    max_size=40,
).map("".join)


@fuzz_settings(1000)
@given(st.one_of(st.text(max_size=200), yaml_soup))
def test_any_text_is_a_config_or_a_clear_error(text: str) -> None:
    load(text)


@fuzz_settings(200)
@given(documents)
def test_generated_documents_load(doc: dict[str, Any]) -> None:
    result = load(yaml.safe_dump(doc))
    assert isinstance(result, ProxyState), result
    assert len(result.workloads) == len(doc.get("workloads", []))


@fuzz_settings(500)
@given(broken_documents())
def test_one_wrong_field_is_named(case: tuple[dict[str, Any], str]) -> None:
    doc, path = case
    result = load(yaml.safe_dump(doc))
    if isinstance(result, LocalConfigError):
        # The error is at the changed field, inside it (a wrong value that is a container), or at an ancestor
        # (a required field removed, a duplicate key made, a wrong type one level up).
        where = result.path
        if result.problem.startswith("duplicate "):
            # The change made two items collide; the later one is named, with the earlier one.
            item = re.match(r"\w+\[\d+\]", path)
            assert item is not None and item.group() in str(result), (path, str(result))
            return
        assert where and (path.startswith(where) or where.startswith(path)), (where, path, str(result))


@fuzz_settings(300)
@given(st.binary(max_size=300))
def test_any_file_is_a_config_or_names_the_file(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "cfg.yaml"
        path.write_bytes(data)
        try:
            load_local_config(path)
        except LocalConfigError as e:
            assert str(e).startswith(f"{path}: ")
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as u:
                assert f"at byte {u.start}" in str(e)


# -- regressions found by the fuzzing -------------------------------------------------------------------------------


def _alias_bomb(levels: int = 7) -> str:
    s = "[&a0 [x,x,x,x,x,x,x,x,x,x]"
    for i in range(1, levels + 1):
        s += f", &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]"
    return s + "]"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # A quoted "²" passed str.isdigit() and then int() raised ValueError.
        ('workloads: [{namespace: a, workloadIps: [], capacity: "²"}]', "workloads[0].capacity: expected an integer"),
        # More than 4,300 digits: int() raised ValueError (quoted) or the YAML int constructor did (plain).
        ('workloads: [{namespace: a, workloadIps: [], capacity: "' + "9" * 5000 + '"}]', "workloads[0].capacity"),
        ("workloads: [{namespace: a, workloadIps: [], capacity: " + "9" * 5000 + "}]", "line 1, column 55"),
        # A huge hex integer is not limited by Python; repr() of it in the message raised ValueError.
        ("workloads: [{namespace: a, workloadIps: [], capacity: 0x" + "f" * 5000 + "}]", "<int too large to show>"),
        # YAML constructors raised KeyError / ValueError instead of a YAML error.
        ("a: !!bool maybe", "line 1, column 4: not valid YAML: cannot read bool 'maybe'"),
        ("a: 2020-13-45", "line 1, column 4: not valid YAML: cannot read timestamp '2020-13-45'"),
        ("a: !!int 0o9", "line 1, column 4: not valid YAML: cannot read int '0o9'"),
        ("!!int", "line 1, column 1: not valid YAML: cannot read int ''"),  # IndexError
        # Deep nesting raised RecursionError.
        ("workloads: " + "[" * 20000 + "]" * 20000, "nesting deeper than 128 levels"),
        ("a: " + "{a: " * 5000 + "1" + "}" * 5000, "nesting deeper than 128 levels"),
        # An alias bomb in a wrong-typed field: a 580 MB message after 25 s.
        ("workloads:\n- namespace: x\n  workloadIps: []\n  hostname: " + _alias_bomb(), "aliases expand the document"),
        ("workloads: &a [*a]", "aliases expand the document"),
        # serde_yaml refuses duplicate keys; PyYAML kept the last one silently.
        ("workloads: []\nworkloads: []", "line 2, column 1: not valid YAML: duplicate key 'workloads'"),
    ],
    ids=[
        "superscript-digit",
        "5000-digit-string",
        "5000-digit-int",
        "huge-hex-int",
        "bool-maybe",
        "bad-date",
        "bad-octal",
        "empty-int",
        "deep-list",
        "deep-map",
        "alias-bomb",
        "recursive-alias",
        "duplicate-key",
    ],
)
def test_regressions(text: str, message: str) -> None:
    with pytest.raises(LocalConfigError) as e:
        parse_local_config(text, SOURCE)
    assert message in str(e.value)
    assert len(str(e.value)) < 2000


def test_merge_keys_and_shared_anchors_still_load() -> None:
    cfg = parse_local_config(
        "workloads:\n- &w {namespace: ns, name: a, uid: a, workloadIps: ['10.0.0.1']}\n"
        "- {<<: *w, uid: b, workloadIps: ['10.0.0.2']}\n",
        SOURCE,
    )
    assert [w.uid for w in cfg.update.workloads] == ["a", "b"]
    assert cfg.update.workloads[1].name == "a"

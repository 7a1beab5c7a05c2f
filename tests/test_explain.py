"""``ztunnel explain`` without sockets: loading a dump (this project's shape, written by the admin server's own
writers), the recorded steps (endpoint candidates, the weighted pick, port mapping, refusals), the policy trace agreeing
with the proxy's evaluation, bad input, and the command line. End to end against real connections:
tests/test_explain_e2e.py; on upstream's dump: tests/test_explain_upstream.py."""

from __future__ import annotations

import copy
import ipaddress
import json
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ztunnel.admin import policy_json, service_json, workload_json
from ztunnel.explain import ExplainError, explain, fetch_dump, load_dump, main, read_dump, render_text
from ztunnel.identity.spiffe import Identity
from ztunnel.localconfig import LocalConfigError, load_local_config
from ztunnel.proxy.outbound import build_request
from ztunnel.rbac import (
    NOT_ALLOWED,
    Action,
    Authorization,
    Connection,
    Match,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
    _Subject,
    compile_rules,
)
from ztunnel.state import ProxyState
from ztunnel.testing import TWO_NODE

ROOT = Path(__file__).resolve().parent.parent
CLIENT = "Kubernetes//v1/Pod/default/client"
SERVER = "Kubernetes//v1/Pod/default/server"


def two_node_doc() -> dict[str, Any]:
    """examples/two-node.yaml as this project's /config_dump shows it (the admin server's writers)."""
    state = ProxyState()
    state.apply(load_local_config(TWO_NODE).update)
    return {
        "workloads": [workload_json(w) for w in state.workloads],
        "services": [service_json(s) for s in state.services],
        "policies": [policy_json(p) for p in state.policies],
        "config": {"network": "", "illegalPorts": [15001, 15006, 15008]},
        "version": {"version": "test", "component": "ztunnel"},
    }


def with_endpoints(doc: dict[str, Any]) -> dict[str, Any]:
    """Three more endpoints behind the echo service: unhealthy, unknown workload, healthy with capacity 3."""
    doc = copy.deepcopy(doc)
    base = next(w for w in doc["workloads"] if w["uid"] == SERVER)
    for name, ip, status, capacity in (("sick", "127.0.2.2", "Unhealthy", 1), ("big", "127.0.2.3", "Healthy", 3)):
        doc["workloads"].append(
            base
            | {"uid": f"{SERVER}-{name}", "name": name, "workloadIps": [ip], "status": status, "capacity": capacity}
        )
    (svc,) = doc["services"]
    for uid, status in ((f"{SERVER}-sick", "Unhealthy"), (f"{SERVER}-big", "Healthy"), ("gone", "Healthy")):
        svc["endpoints"][uid] = {"workloadUid": uid, "port": {"80": 8080}, "status": status}
    return doc


def test_load_balancing_candidates_and_the_pick_are_explained() -> None:
    dump = load_dump(with_endpoints(two_node_doc()), "test")
    report = explain(dump, "default/client", "127.10.0.10:80", seed=7)
    steps = report["outbound"]["steps"]
    why = {s["workload"]: s["message"] for s in steps if s["step"] == "candidate"}
    assert why[SERVER] == "eligible" and why[f"{SERVER}-big"] == "eligible"
    assert "unhealthy" in why[f"{SERVER}-sick"] and why["gone"] == "no workload with this uid"
    (pick,) = [s for s in steps if s["step"] == "pick"]
    assert pick["chances"] == {SERVER: 0.25, f"{SERVER}-big": 0.75}
    # The pick shown is the one the proxy's routing makes with the same generator.
    src = dump.state.workloads.find_uid(CLIENT)
    assert src is not None
    target = (ipaddress.ip_address("127.10.0.10"), 80)
    req = build_request(dump.state, src, src.workload_ips[0], target, "", random.Random(7))
    assert req.actual_destination_workload is not None
    assert pick["picked"] == req.actual_destination_workload.uid
    assert report["outbound"]["destination_workload"]["uid"] == pick["picked"]
    (port,) = [s for s in steps if s["step"] == "port"]
    assert port["target_port"] == 8080
    text = render_text(report)
    assert f"75.0%  {SERVER}-big" in text and f"25.0%  {SERVER}\n" in text.replace("  <- picked (--seed)", "")


def test_a_trace_changes_no_decision() -> None:
    """With or without a trace, the same generator state gives the same request (the trace only listens)."""
    dump = load_dump(with_endpoints(two_node_doc()), "test")
    src = dump.state.workloads.find_uid(CLIENT)
    assert src is not None
    target = (ipaddress.ip_address("127.10.0.10"), 80)
    for seed in range(50):
        plain = build_request(dump.state, src, src.workload_ips[0], target, "", random.Random(seed))
        traced = build_request(
            dump.state, src, src.workload_ips[0], target, "", random.Random(seed), trace=lambda *a, **k: None
        )
        assert plain == traced


def test_refusals_say_why() -> None:
    doc = two_node_doc()
    server = next(w for w in doc["workloads"] if w["uid"] == SERVER)
    server["network"] = "other"  # across networks, and no gateway named: nothing can reach it
    dump = load_dump(doc, "test")
    report = explain(dump, "127.0.1.1", "127.10.0.10:80")
    assert report["verdict"] == "refused" and "has no network gateway" in report["outbound"]["error"]
    assert not report["inbound"]["applies"]
    looped = explain(dump, "127.0.1.1", "127.0.0.1:15008")
    assert looped["outbound"]["error"] == "attempted recursive call to ourselves"


def test_policy_trace_agrees_with_the_proxys_evaluation() -> None:
    """For random rule sets and connections, a traced rule set holds exactly when the compiled one matches."""
    rng = random.Random(20)
    ips = ["10.0.0.1", "10.0.0.2", "10.1.0.1"]
    for _ in range(400):
        rules = tuple(
            tuple(tuple(_random_match(rng) for _ in range(rng.randrange(0, 3))) for _ in range(rng.randrange(0, 3)))
            for _ in range(rng.randrange(1, 3))
        )
        conn = Connection(
            ipaddress.ip_address(rng.choice(ips)),
            1234,
            ipaddress.ip_address(rng.choice(ips)),
            rng.choice([80, 8080, 9999]),
            _identity(rng),
        )
        compiled = compile_rules(rules)
        traced = compiled.trace(conn)
        assert any(r.held for r in traced) == compiled.matches(_Subject(conn)), (rules, conn)


def _identity(rng: random.Random) -> Identity | None:
    return rng.choice([None, Identity("cluster.local", "default", "client"), Identity("cluster.local", "x", "y")])


def _random_match(rng: random.Random) -> Match:
    fields: dict[str, Any] = {}
    if rng.random() < 0.4:
        fields["destination_ports"] = tuple(rng.sample([80, 8080, 9999], rng.randrange(1, 3)))
    if rng.random() < 0.3:
        fields["not_destination_ports"] = (rng.choice([80, 9999]),)
    if rng.random() < 0.3:
        fields["source_ips"] = (ipaddress.ip_network(rng.choice(["10.0.0.0/16", "10.1.0.1/32"])),)
    if rng.random() < 0.3:
        fields["principals"] = (StringMatch(StringMatchKind.PREFIX, rng.choice(["cluster.local/ns/default", "x"])),)
    if rng.random() < 0.3:
        fields["namespaces"] = (StringMatch(rng.choice([StringMatchKind.EXACT, StringMatchKind.PRESENCE]), "x"),)
    if rng.random() < 0.2:
        fields["service_accounts"] = (ServiceAccountMatch("default", "client"),)
    return Match(**fields)


def test_each_failing_field_is_named_with_both_values() -> None:
    doc = two_node_doc()
    doc["policies"].append(
        policy_json(
            Authorization(
                "by-sa",
                "default",
                Scope.NAMESPACE,
                Action.ALLOW,
                (
                    (
                        (Match(service_accounts=(ServiceAccountMatch("default", "other"),)),),
                        (Match(),),  # an empty match: skipped, so this clause can never hold
                    ),
                ),
            )
        )
    )
    report = explain(load_dump(doc, "test"), "default/client", "127.0.2.1:8080")
    policy = next(p for p in report["inbound"]["policies"] if p["policy"] == "default/by-sa")
    sa, empty = policy["rules"][0]["clauses"]
    assert sa["matches"][0]["why"] == "serviceAccounts: default/client is not one of [default/other]"
    assert not empty["held"] and empty["matches"][0]["why"] == "a match with no fields: skipped"
    assert report["verdict"] == "allow"  # allow-client still allows it
    text = render_text(report)
    assert "policy default/by-sa (Allow, Namespace): no match" in text
    assert "policy default/allow-client (Allow, Namespace): MATCHES <- decides" in text


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["workloads"][0].update(workloadIps=["not-an-ip"]), "workloads[0].workloadIps[0]"),
        (lambda d: d["policies"][0].update(action="Maybe"), "policies[0].action: unknown value 'Maybe'"),
        (lambda d: d["services"][0].update(ports={"80": "x"}), "services[0].ports.80"),
    ],
)
def test_a_bad_dump_names_the_field(tmp_path: Path, mutate: Any, message: str) -> None:
    doc = two_node_doc()
    mutate(doc)
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ExplainError, match=r"dump\.json: ") as e:
        read_dump(path)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("source", "target", "message"),
    [
        ("default/nobody", "127.10.0.10:80", "no workload default/nobody"),
        ("client", "127.10.0.10:80", "expected an IP address or namespace/name"),
        ("default/client", "127.10.0.10", "expected ip:port"),
        ("default/client", "nothing.example:80", "no service or workload with hostname 'nothing.example'"),
    ],
)
def test_bad_source_or_target_says_what(source: str, target: str, message: str) -> None:
    with pytest.raises(ExplainError) as e:
        explain(load_dump(two_node_doc(), "test"), source, target)
    assert message in str(e.value)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(two_node_doc()))
    assert main(["--config-dump", str(path), "--from", "default/client", "--to", "127.0.2.1:9999", "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "deny" and report["inbound"]["reason"] == "explicitly denied by: default/deny-9999"
    path.write_text(json.dumps(with_endpoints(two_node_doc())))
    picks = set()
    for seed in range(20):
        argv = ["--config-dump", str(path), "--from", "default/client", "--to", "127.10.0.10:80", "-o", "json"]
        assert main([*argv, "--seed", str(seed)]) == 0
        shown = json.loads(capsys.readouterr().out)["outbound"]["destination_workload"]["uid"]
        expected = explain(read_dump(path), "default/client", "127.10.0.10:80", seed)
        assert shown == expected["outbound"]["destination_workload"]["uid"]
        picks.add(shown)
    assert picks == {SERVER, f"{SERVER}-big"}  # the seed does change the pick
    path.write_text("{not json")
    assert main(["--config-dump", str(path), "--from", "a/b", "--to", "1.2.3.4:5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: not JSON") and "Traceback" not in err


def test_ztunnel_explain_subcommand(tmp_path: Path) -> None:
    """``ztunnel explain`` (the console script's subcommand, as the README shows it) prints the text report."""
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(two_node_doc()))
    argv = [sys.executable, "-m", "ztunnel", "explain", "--config-dump", str(path)]
    done = subprocess.run(
        [*argv, "--from", "127.0.1.1", "--to", "echo.default.svc.cluster.local:80"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "=> HBONE (mTLS) to 127.0.2.1:15008, :authority 127.0.2.1:8080" in done.stdout
    assert done.stdout.rstrip().endswith("VERDICT: allow")
    bad = subprocess.run([*argv, "--from", "127.0.1.1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--to" in bad.stderr and "Traceback" not in bad.stderr


def test_inbound_port_rules_are_the_proxys() -> None:
    """The destination's own port checks (``inbound.upstream_port``): a CONNECT to one of ztunnel's ports is refused
    with 503; an application tunnel replaces the port policy sees."""
    doc = two_node_doc()
    server = next(w for w in doc["workloads"] if w["uid"] == SERVER)
    server["workloadIps"] = ["10.0.0.2"]  # not loopback: the source's ztunnel would refuse that itself first
    own = explain(load_dump(doc, "test"), "default/client", "10.0.0.2:15008")
    assert own["verdict"] == "refused" and own["outbound"]["result"] == "hbone"
    assert own["inbound"]["status"] == 503 and own["inbound"]["reason"] == "attempted recursive call to ourselves"
    server["applicationTunnel"] = {"protocol": "NONE", "port": 15088}
    tunneled = explain(load_dump(doc, "test"), "default/client", "10.0.0.2:8080")
    assert tunneled["inbound"]["connection"]["destination"] == "10.0.0.2:15088"
    assert tunneled["inbound"]["steps"] == ["application tunnel: the workload's port 15088 instead of 8080"]


def test_an_unreachable_admin_port_says_so() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    with pytest.raises(ExplainError, match=rf"^http://127\.0\.0\.1:{port}/config_dump: cannot fetch the config dump"):
        fetch_dump(f"127.0.0.1:{port}", timeout=5)


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


def test_any_broken_field_is_an_error_or_a_report_never_a_crash() -> None:
    """Every value of the dump, in turn replaced by each of a set of values of other types (about 1,800 dumps):
    explain answers, or says what is wrong (ExplainError naming the field); no other exception escapes."""
    base = with_endpoints(two_node_doc())
    replacements: list[Any] = [None, -1, 70000, "x", "", [], {}, [1], {"a": 1}, True, 1.5]
    reports = errors = 0
    for path in _paths(base)[1:]:
        for value in replacements:
            doc = copy.deepcopy(base)
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = value
            try:
                report = explain(load_dump(doc, "fuzz"), "127.0.1.1", "127.10.0.10:80")
            except ExplainError as e:
                # Names the dump and the field, or what the broken state lacks for this --from/--to.
                assert str(e).startswith(("fuzz: ", "--from ", "--to ")), (path, value, e)
                errors += 1
                continue
            except LocalConfigError as e:
                pytest.fail(f"{path}={value!r}: a loader error escaped explain's own: {e}")
            assert report["verdict"] in ("allow", "deny", "refused", "unknown"), (path, value)
            reports += 1
    assert reports and errors  # both outcomes were reached


def test_a_source_outside_the_mesh_meets_only_the_destinations_plaintext_inbound() -> None:
    """No ztunnel captures a non-mesh source; a captured destination's 15006 checks policy without an identity and
    closes a denied connection (no HTTP status)."""
    doc = two_node_doc()
    dump = load_dump(doc, "test")
    to_server = explain(dump, "10.9.9.9", "127.0.2.1:8080")
    assert to_server["outbound"]["result"] == "not-captured" and to_server["outbound"]["next_hop"] == "127.0.2.1:8080"
    inbound = to_server["inbound"]
    assert inbound["listener"] == "inbound plaintext (15006)" and inbound["connection"]["identity"] is None
    assert to_server["verdict"] == "deny" and inbound["reason"] == NOT_ALLOWED  # allow-client needs an identity
    assert inbound["status"] is None and inbound["response_flag"] == "DENY" and "source_error" not in to_server
    text = render_text(to_server)
    assert "no identity (plaintext) from 10.9.9.9 to 127.0.2.1:8080" in text
    assert "(the connection is closed, response flag DENY)" in text
    # A workload of protocol TCP is outside the mesh too; to a VIP, kube-proxy decides, not a ztunnel.
    vip = explain(dump, "default/plain", "127.10.0.10:80")
    assert vip["outbound"]["result"] == "not-captured" and vip["verdict"] == "unknown"
    assert explain(dump, "10.9.9.9", "127.0.3.1:80")["verdict"] == "allow"  # plain to plain: nobody checks


def test_double_hbone_through_a_network_gateway() -> None:
    """A service endpoint on another network: explain shows the proxy's double HBONE request (outer tunnel to the
    gateway verified against the gateway's identity, inner one against the service's) and the destination's
    inbound half with the service port mapped, as the destination's ztunnel sees the inner CONNECT."""
    doc = two_node_doc()
    server = next(w for w in doc["workloads"] if w["uid"] == SERVER)
    server["network"] = "other"
    server["networkGateway"] = {"destination": "other/127.0.9.9", "hboneMtlsPort": 15008}
    gateway = server | {
        "uid": "Kubernetes//v1/Pod/istio-system/eastwest",
        "name": "eastwest",
        "namespace": "istio-system",
        "serviceAccount": "eastwest",
        "workloadIps": ["127.0.9.9"],
        "services": {},
    }
    gateway.pop("networkGateway")
    doc["workloads"].append(gateway)
    dump = load_dump(doc, "test")
    report = explain(dump, "default/client", "127.10.0.10:80")
    out = report["outbound"]
    assert (report["verdict"], out["result"], out["protocol"]) == ("allow", "double-hbone", "DOUBLE_HBONE")
    assert out["next_hop"] == "127.0.9.9:15008" and out["gateway"]["name"] == "istio-system/eastwest"
    assert out["authority"] == f"{out['service'].split('/', 1)[1]}:80"
    assert out["expected_identities"] == ["spiffe://cluster.local/ns/istio-system/sa/eastwest"]
    assert out["final_expected_identities"] == [server_identity(doc)]
    assert any(s["step"] == "network" and "double HBONE" in s["message"] for s in out["steps"])
    inbound = report["inbound"]
    assert inbound["applies"] and inbound["local_workload"]["uid"] == SERVER
    assert any("service port 80 is the workload's port 8080" in s for s in inbound["steps"])
    text = render_text(report)
    assert "double HBONE (mTLS inside mTLS) to 127.0.9.9:15008" in text and "through network gateway" in text


def server_identity(doc: dict[str, Any]) -> str:
    server = next(w for w in doc["workloads"] if w["uid"] == SERVER)
    return f"spiffe://cluster.local/ns/{server['namespace']}/sa/{server['serviceAccount']}"


@pytest.mark.parametrize("gateway", [False, True], ids=["hbone", "double-hbone"])
def test_the_inbound_half_reads_the_route_not_the_report_strings(
    gateway: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The destination's half takes the outbound half's decision as values (the workload, the address dialled, the
    authority's port, the service): the report's ``next_hop``, ``authority`` and ``service`` strings are for
    reading. Before, it parsed them back (``rpartition(":")``, ``split("/")``): a change of how an address is
    written for the reader (here ``10.0.0.1 port 80``) broke the inbound half."""
    doc = two_node_doc()
    if gateway:
        server = next(w for w in doc["workloads"] if w["uid"] == SERVER)
        server["network"] = "other"
        server["networkGateway"] = {"destination": "other/127.0.9.9", "hboneMtlsPort": 15008}
        gw = server | {"uid": "gw", "name": "eastwest", "namespace": "istio-system", "workloadIps": ["127.0.9.9"]}
        gw.pop("networkGateway")
        gw["services"] = {}
        doc["workloads"].append(gw)
    dump = load_dump(doc, "test")
    want = explain(dump, "default/client", "127.10.0.10:80")["inbound"]
    assert want["applies"] and want["local_workload"]["uid"] == SERVER
    monkeypatch.setattr("ztunnel.explain.format_addr", lambda host, port: f"{host} port {port}")
    report = explain(dump, "default/client", "127.10.0.10:80")
    assert report["outbound"]["next_hop"].endswith(" port 15008")  # the reader's text changed
    got = report["inbound"]
    assert got["connection"].pop("destination") == "127.0.2.1 port 8080"  # (written for the reader too)
    want["connection"].pop("destination")
    assert got == want  # the decision did not

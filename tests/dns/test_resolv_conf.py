"""``ResolvConf`` reads resolv.conf itself (no ``dns.resolver`` in a worker) and gets dnspython's answers: dnspython's
``Resolver.read_resolv_conf`` is the oracle for every file it accepts."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import dns.exception
import dns.resolver
import pytest

from ztunnel.dns.forwarder import DEFAULT_TRY_TIMEOUT, Nameserver, ResolvConf
from ztunnel.state.workload import canonical_ip

FILES = {
    "kubernetes pod": "nameserver 10.96.0.10\nsearch default.svc.cluster.local svc.cluster.local cluster.local\n"
    "options ndots:5\n",
    "several, options": "# generated\n; also a comment\nnameserver 1.1.1.1\nnameserver 2606:4700::1111\n"
    "options timeout:3 attempts:2 rotate edns0\n",
    "domain then search: search wins": "domain example.org\nsearch a.example b.example.\nnameserver 9.9.9.9\n",
    "search then domain: domain wins": "search a.example\ndomain example.org\nnameserver 9.9.9.9\n",
    "the last search wins": "search one.example\nsearch two.example three.example\nnameserver 8.8.8.8\n",
    "zone id, bad timeout, short lines": "nameserver fe80::1%eth0\noptions timeout:x timeout\nsearch\n"
    "nameserver 127.0.0.53 # stub\n",
    "timeout 0 is the default": "nameserver 127.0.0.1\noptions timeout:0\n",
    "indented comment is a line": "  # nameserver 1.2.3.4\nnameserver 127.0.0.1\n",
}


def dnspython(path: Path) -> ResolvConf:
    """What the forwarder read before: dnspython's reading, in ResolvConf's terms, but for one rule: when the last
    ``search``/``domain`` line is a ``domain``, that domain is the search list (glibc's and upstream's reading;
    dnspython keeps it apart as ``Resolver.domain``)."""
    r = dns.resolver.Resolver(configure=False)
    r.read_resolv_conf(str(path))
    servers = tuple(Nameserver(canonical_ip(ipaddress.ip_address(str(ns).split("%")[0]))) for ns in r.nameservers)
    keys = [line.split()[0] for line in path.read_text().splitlines() if line.split()[:1] in (["search"], ["domain"])]
    search = (r.domain,) if keys and keys[-1] == "domain" else tuple(r.search)
    return ResolvConf(servers, search, float(r.timeout) if r.timeout else DEFAULT_TRY_TIMEOUT)


def test_a_domain_alone_is_the_search_list() -> None:
    """As glibc and upstream's resolver (resolv-conf's get_last_search_or_domain): ``domain`` without a later
    ``search`` is the search list, so names asked under it are stripped to their alias in dedicated mode."""
    conf = ResolvConf.parse("domain example.com\nnameserver 1.1.1.1\n")
    assert [n.to_text() for n in conf.search] == ["example.com."]


@pytest.mark.parametrize("text", FILES.values(), ids=FILES.keys())
def test_read_as_dnspython_reads_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "resolv.conf"
    path.write_text(text)
    ours = ResolvConf.load(path)
    assert ours.nameservers  # every sample has some
    assert ours == dnspython(path)


def test_the_samples_differ() -> None:
    """The oracle comparison is not between empty answers: the samples give different search lists and timeouts."""
    parsed = [ResolvConf.parse(t) for t in FILES.values()]
    assert len({p.search for p in parsed}) >= 4
    assert {p.timeout for p in parsed} == {2.0, 3.0}


def test_a_bad_nameserver_is_skipped_alone(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        conf = ResolvConf.parse("nameserver dns.example\nnameserver 10.0.0.1\n", "/etc/resolv.conf")
    assert conf.nameservers == ResolvConf.parse("nameserver 10.0.0.1\n").nameservers
    assert "ignoring nameserver 'dns.example' in /etc/resolv.conf" in caplog.text


def test_no_file_or_no_nameserver_is_no_upstream(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert ResolvConf.load(tmp_path / "missing") == ResolvConf((), (), DEFAULT_TRY_TIMEOUT)
        assert ResolvConf.parse("search a.example\noptions timeout:7\n") == ResolvConf((), (), DEFAULT_TRY_TIMEOUT)
    assert caplog.text.count("no upstream nameservers") == 2


@pytest.mark.parametrize(
    ("text", "search"),
    [
        (
            "search a..b good.example\nsearch kept.example\nsearch x" + "y" * 63 + ".example\nnameserver 10.0.0.1\n",
            ["kept.example."],
        ),
        ("search kept.example\ndomain a..b\nnameserver 10.0.0.1\n", ["kept.example."]),
    ],
    ids=["a bad search line", "a bad domain line"],
)
def test_a_bad_search_or_domain_line_is_skipped_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, search: list[str]
) -> None:
    path = tmp_path / "resolv.conf"
    path.write_text(text)
    with pytest.raises(dns.exception.DNSException):  # dnspython refuses the whole file
        dnspython(path)
    with caplog.at_level(logging.WARNING):
        conf = ResolvConf.load(path)
    assert [str(n) for n in conf.search] == search
    assert conf.nameservers == (Nameserver(canonical_ip(ipaddress.ip_address("10.0.0.1"))),)
    assert (
        f"ignoring 'search a..b good.example' in {path}" in caplog.text
        or f"ignoring 'domain a..b' in {path}" in caplog.text
    )


def test_a_timeout_of_zero_or_less_is_the_default() -> None:
    for value in ("-1", "0"):
        assert ResolvConf.parse(f"nameserver 10.0.0.1\noptions timeout:{value}\n").timeout == DEFAULT_TRY_TIMEOUT
    assert ResolvConf.parse("nameserver 10.0.0.1\noptions timeout:4\n").timeout == 4.0

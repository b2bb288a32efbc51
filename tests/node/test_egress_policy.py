"""Egress policy decisions (aenv/node/egress.py), address by address. No sandbox needed."""

from __future__ import annotations

import ipaddress

import pytest

from aenv.errors import InvalidRequest
from aenv.node.egress import EgressPolicy

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)

PUBLIC = ipaddress.ip_address("8.8.8.8")
PRIVATE = ipaddress.ip_address("10.1.2.3")


def decide(policy: EgressPolicy, host: str, addr: str) -> str | None:
    return policy.check(host, ipaddress.ip_address(addr))


@pytest.mark.parametrize(
    "addr",
    ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1", "169.254.169.254", "fe80::1", "0.0.0.0", "224.0.0.1", "::"],
)
def test_loopback_link_local_and_friends_are_never_reachable(addr: str) -> None:
    wide_open = EgressPolicy.of(True, {"allowOut": ["0.0.0.0/0", "::/0", "localhost", addr]})
    reason = decide(wide_open, "localhost", addr)
    assert reason is not None and "never reachable" in reason


def test_internet_means_public_addresses_only() -> None:
    policy = EgressPolicy.of(True, None)
    assert decide(policy, "dns.google", str(PUBLIC)) is None
    assert "private address" in (decide(policy, "intranet", str(PRIVATE)) or "")
    assert "private address" in (decide(policy, "x", "192.168.1.1") or "")
    assert "private address" in (decide(policy, "x", "fd00::5") or "")


def test_allow_out_names_private_ranges_and_domains() -> None:
    policy = EgressPolicy.of(False, {"allowOut": ["10.0.0.0/8", "pypi.org", "*.pythonhosted.org"]})
    assert decide(policy, "intranet", str(PRIVATE)) is None
    assert decide(policy, "pypi.org", "151.101.0.223") is None
    assert decide(policy, "files.pythonhosted.org", "151.101.64.223") is None
    assert decide(policy, "PyPI.org.", "151.101.0.223") is None  # names compare case-insensitively
    assert decide(policy, "evilpypi.org", "151.101.0.223") is not None
    assert decide(policy, "pythonhosted.org.evil.com", "151.101.128.223") is not None


def test_no_internet_allows_only_the_allow_list() -> None:
    policy = EgressPolicy.of(False, {"allowOut": ["8.8.8.8"]})
    assert decide(policy, "dns.google", "8.8.8.8") is None
    assert "no internet access" in (decide(policy, "one.one", "1.1.1.1") or "")


def test_deny_out_beats_internet_and_allow_out_beats_deny_out() -> None:
    policy = EgressPolicy.of(True, {"denyOut": ["8.8.0.0/16"]})
    assert "denyOut" in (decide(policy, "dns.google", "8.8.8.8") or "")
    assert decide(policy, "one.one", "1.1.1.1") is None
    everything = EgressPolicy.of(True, {"denyOut": ["0.0.0.0/0"], "allowOut": ["example.com"]})
    assert everything.check("x", ipaddress.ip_address("2606:4700::1111")) is not None  # all traffic is IPv6 too
    assert decide(everything, "example.com", "93.184.216.34") is None


@pytest.mark.parametrize(
    "network",
    [{"allowOut": ["not a domain!"]}, {"denyOut": ["example.com"]}, {"allowOut": ["a..b"]}, {"denyOut": ["300.1.1.1"]}],
)
def test_bad_rules_are_refused(network: dict[str, list[str]]) -> None:
    with pytest.raises(InvalidRequest):
        EgressPolicy.of(True, network)

"""trainguard.leader: which URLs are controller base URLs, when two spellings name one
controller, and that a leader header is followed only within the list."""

from __future__ import annotations

import pytest

from trainguard.leader import follow, leader_named, split_urls, url_key, url_problem


@pytest.mark.parametrize(
    "url",
    ["http://ctl:8800", "https://ctl.example.internal", "http://10.0.0.2:80/tg/", "http://[::1]:9"],
    ids=["host-port", "https-name", "ip-with-path", "ipv6"],
)
def test_base_urls_are_accepted(url: str) -> None:
    assert url_problem(url) is None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("http://ctl:80", "http://CTL/"),
        ("https://ctl", "https://ctl:443"),
        ("http://ctl:8800/tg/", "http://ctl:8800/tg"),
    ],
    ids=["default-port-and-case", "https-default-port", "trailing-slash"],
)
def test_two_spellings_of_one_controller_share_a_key(a: str, b: str) -> None:
    assert url_key(a) == url_key(b)


def test_different_ports_schemes_or_paths_are_different_controllers() -> None:
    keys = {url_key(u) for u in ("http://c:1", "http://c:2", "https://c:1", "http://c:1/x")}
    assert len(keys) == 4


def test_follow_returns_the_list_entry_as_spelled_and_never_a_url_outside_it() -> None:
    urls = ["http://ctl-a:8800/", "http://ctl-b:8800"]
    assert follow("http://CTL-A:8800", urls) == "http://ctl-a:8800/"
    assert follow(" http://ctl-b:8800/ ", urls) == "http://ctl-b:8800"
    assert follow("http://attacker:8800", urls) is None
    assert follow("http://ctl-b:8801", urls) is None
    assert follow("ctl-b:8800", urls) is None  # not a URL at all
    assert follow("", urls) is None
    assert follow(None, urls) is None


def test_leader_named_is_none_for_an_empty_or_absent_header() -> None:
    assert leader_named(None) is None
    assert leader_named("  ") is None
    assert leader_named(" http://a ") == "http://a"


def test_split_urls_keeps_empty_entries_so_a_stray_comma_is_reported() -> None:
    assert split_urls("http://a, http://b") == ["http://a", "http://b"]
    assert split_urls("http://a,") == ["http://a", ""]

"""controller.url or controller.urls: one controller or several, strictly; a bad entry is
named by its index; the --controller flag takes a comma-separated list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainguard.agent.config as config_mod
from trainguard.agent.config import load_config
from trainguard.agent.main import main
from trainguard.leader import MAX_CONTROLLER_URLS
from trainguard.strict import ConfigError


@pytest.fixture(autouse=True)
def no_default_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.yaml"))


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return str(p)


def test_a_url_list_is_tried_in_the_order_written(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "controller:\n  urls: [http://ctl-a:8800, 'http://ctl-b:8800/']\n  token_file: /t\n",
    )
    config, _ = load_config(path)
    assert config.controller.resolved_urls() == ("http://ctl-a:8800", "http://ctl-b:8800/")


def test_one_url_is_unchanged_and_no_url_is_export_only(tmp_path: Path) -> None:
    config, _ = load_config(write(tmp_path, "controller:\n  url: http://c:1\n  token_file: /t\n"))
    assert config.controller.resolved_urls() == ("http://c:1",)
    config, _ = load_config(write(tmp_path, "controller: {}\n"))
    assert config.controller.resolved_urls() == ()


LONG = "http://h/" + "x" * 600


@pytest.mark.parametrize(
    ("controller", "key", "reason"),
    [
        ("url: http://a\n  urls: [http://b]", "controller.urls", "not both"),
        ("urls: [http://a, ftp://b]", "controller.urls[1]", "must start with http://"),
        ("urls: [http://a, '']", "controller.urls[1]", "must start with http://"),
        ("urls: ['http://a b']", "controller.urls[0]", "spaces or control characters"),
        ("urls: ['http://u:pw@a']", "controller.urls[0]", "must not hold credentials"),
        ("urls: ['http://a?x=1']", "controller.urls[0]", "without ?query"),
        ("urls: ['http://a:99999']", "controller.urls[0]", "invalid port"),
        ("urls: ['http://']", "controller.urls[0]", "has no host"),
        (f"urls: ['{LONG}']", "controller.urls[0]", "too long"),
        ("urls: [http://A:80/, http://a]", "controller.urls[1]", "same controller as entry 0"),
        (
            "urls: [" + ", ".join(f"http://c{i}" for i in range(MAX_CONTROLLER_URLS + 1)) + "]",
            "controller.urls",
            "too many URLs",
        ),
        ("urls: http://a", "controller.urls", "expected a list"),
        ("urls: [3]", "controller.urls[0]", "expected a string"),
        ("url: 'http://u:pw@a'", "controller.url", "must not hold credentials"),
    ],
    ids=[
        "url-and-urls",
        "bad-scheme",
        "empty-entry",
        "space",
        "credentials",
        "query",
        "bad-port",
        "no-host",
        "too-long",
        "same-controller-twice",
        "too-many",
        "not-a-list",
        "not-a-string",
        "single-url-with-credentials",
    ],
)
def test_a_bad_controller_list_names_the_key_and_reason(
    tmp_path: Path, controller: str, key: str, reason: str
) -> None:
    path = write(tmp_path, f"controller:\n  {controller}\n  token_file: /t\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert f"{path}: {key}: " in str(e.value)
    assert reason in str(e.value)


def test_a_url_list_needs_a_token_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"controller\.token_file: is required"):
        load_config(write(tmp_path, "controller:\n  urls: [http://a, http://b]\n"))


def test_a_client_certificate_needs_every_controller_on_https(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "controller:\n  urls: [https://a, http://b]\n"
        "  tls_cert_file: /c.pem\n  tls_key_file: /k.pem\n",
    )
    with pytest.raises(ConfigError, match=r"controller\.tls_cert_file: .*'http://b'"):
        load_config(path)


def test_the_controller_flag_takes_a_comma_separated_list_over_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "controller:\n  url: http://old:1\n  token_file: /t\n")
    argv = ["--config", path, "--check-config", "--controller", "http://a:1, http://b:2"]
    assert main(argv) == 0
    controller = json.loads(capsys.readouterr().out)["config"]["controller"]
    assert (controller["url"], controller["urls"]) == ("", ["http://a:1", "http://b:2"])
    assert main(["--config", path, "--check-config", "--controller", "http://c:3"]) == 0
    controller = json.loads(capsys.readouterr().out)["config"]["controller"]
    assert (controller["url"], controller["urls"]) == ("http://c:3", [])


def test_a_stray_comma_in_the_flag_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--controller", "http://a:1,", "--token-file", "/t"]) == 2
    assert "controller.urls[1]: must start with http://" in capsys.readouterr().err

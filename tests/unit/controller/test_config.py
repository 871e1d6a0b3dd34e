"""Controller config: defaults, strictness (file, key, reason), invariants, the example."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.controller.config import load_config
from trainguard.strict import ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "controller.yaml"


def _write(tmp_path, text: str) -> str:
    p = tmp_path / "controller.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_are_sane(tmp_path):
    config = load_config(_write(tmp_path, "{}"))
    assert (config.api.host, config.api.port, config.tick_interval_s) == ("127.0.0.1", 8800, 1.0)
    assert config.api.max_body_bytes == 4 * 1024 * 1024
    assert config.rules and config.notify.webhooks == []


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("tick_intervall_s: 1", "tick_intervall_s", "did you mean 'tick_interval_s'"),
        ("api: {port: 70000}", "api.port", "0..65535"),
        ("api: {tls_cert_file: /x}", "api.tls_key_file", "go together"),
        ("stale_after_s: 0.5", "stale_after_s", "must exceed tick_interval_s"),
        ("safety: {breaker_threshold: 0}", "safety.breaker_threshold", ">= 1"),
        ("actions: {backoff_initial_s: 10, backoff_max_s: 1}", "actions.backoff_max_s", ">="),
        (
            "notify: {slack: {webhook_url: {file: a, env: B}}}",
            "notify.slack.webhook_url.file",
            "exactly one",
        ),
        ("notify: {webhooks: [{name: slack, url: 'http://x'}]}", "notify.webhooks", "reserved"),
        ("notify: {webhooks: [{name: a, url: 'ftp://x'}]}", "notify.webhooks[0].url", "http"),
        ("rules: []", "rules", "at least one"),
    ],
    ids=[
        "typo",
        "port",
        "tls-pair",
        "stale-vs-tick",
        "breaker",
        "backoff",
        "secret-both",
        "reserved-name",
        "webhook-url",
        "no-rules",
    ],
)
def test_bad_config_names_file_key_and_reason(tmp_path, text, key, reason):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == path
    assert info.value.key == key
    assert reason in info.value.reason


def test_overrides_apply_over_the_file(tmp_path):
    config = load_config(_write(tmp_path, "api: {port: 9000}"), overrides={"api.port": 0})
    assert config.api.port == 0


def test_documented_example_loads():
    config = load_config(str(EXAMPLE))
    assert config.safety.drain_budget >= 1


def test_credential_paths_expand_credentials_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", "/run/credentials/trainguard-controller.service")
    config = load_config(
        _write(
            tmp_path,
            "api:\n"
            "  tokens_file: ${CREDENTIALS_DIRECTORY}/tokens\n"
            "  tls_cert_file: ${CREDENTIALS_DIRECTORY}/tls.crt\n"
            "  tls_key_file: ${CREDENTIALS_DIRECTORY}/tls.key\n"
            "notify:\n"
            "  slack: {webhook_url: {file: '${CREDENTIALS_DIRECTORY}/slack-webhook'}}\n"
            "  webhooks: [{name: bus, url: 'http://x', secret: {env: BUS_SECRET}}]\n",
        )
    )
    creds = "/run/credentials/trainguard-controller.service"
    assert config.api.tokens_file == f"{creds}/tokens"
    assert (config.api.tls_cert_file, config.api.tls_key_file) == (
        f"{creds}/tls.crt",
        f"{creds}/tls.key",
    )
    assert config.notify.slack is not None
    assert config.notify.slack.webhook_url.file == f"{creds}/slack-webhook"


def test_a_secret_file_reads_from_the_credentials_directory(tmp_path, monkeypatch):
    (tmp_path / "pd-key").write_text("routing-key\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    config = load_config(
        _write(
            tmp_path,
            "notify: {pagerduty: {routing_key: {file: '${CREDENTIALS_DIRECTORY}/pd-key'}}}",
        )
    )
    assert config.notify.pagerduty is not None
    assert config.notify.pagerduty.routing_key.read() == "routing-key"


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("api: {tokens_file: '${CREDENTIALS_DIRECTORY}/tokens'}", "api.tokens_file", "not set"),
        (
            "notify: {slack: {webhook_url: {file: '${CREDENTIALS_DIRECTORY}/s'}}}",
            "notify.slack.webhook_url.file",
            "not set",
        ),
        ("api: {tokens_file: '$HOME/tokens'}", "api.tokens_file", "only ${CREDENTIALS_DIRECTORY}"),
        (
            "api: {tokens_file: '${CREDENTIAL_DIRECTORY}/tokens'}",
            "api.tokens_file",
            "only ${CREDENTIALS_DIRECTORY}",
        ),
    ],
    ids=["unset-tokens", "unset-secret", "other-variable", "misspelt-variable"],
)
def test_credential_paths_fail_clearly(tmp_path, monkeypatch, text, key, reason):
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.source, info.value.key) == (path, key)
    assert reason in info.value.reason


@pytest.mark.parametrize(
    "value", ["-1", ".nan", "3600.5", ".inf"], ids=["negative", "nan", "past-an-hour", "inf"]
)
def test_store_page_after_s_outside_0_to_3600_is_refused_naming_the_key(tmp_path, value):
    path = _write(tmp_path, f"store: {{page_after_s: {value}}}")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "store.page_after_s"
    assert "0..3600" in info.value.reason


@pytest.mark.parametrize(("value", "expected"), [("0", 0.0), ("3600", 3600.0), ("2.5", 2.5)])
def test_store_page_after_s_within_bounds_is_taken(tmp_path, value, expected):
    assert load_config(_write(tmp_path, "{}")).store.page_after_s == 10.0
    config = load_config(_write(tmp_path, f"store: {{page_after_s: {value}}}"))
    assert config.store.page_after_s == expected

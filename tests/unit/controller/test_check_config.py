"""`trainguard-controller check-config CONFIG`: the checks a start makes, without the store or
the port; exit 0 and one summary line, or 2 and the error a start prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.controller.auth import hash_token
from trainguard.controller.main import main


def _write(tmp_path: Path, extra: str = "", tokens: str | None = None) -> Path:
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text(
        tokens
        if tokens is not None
        else f'tokens:\n  - {{name: ops, role: operator, sha256: "{hash_token("t")}"}}\n'
    )
    config = tmp_path / "controller.yaml"
    config.write_text(
        f"store:\n  path: {tmp_path / 'never.db'}\napi:\n  tokens_file: {tokens_file}\n{extra}"
    )
    return config


def test_a_good_config_prints_one_summary_line_and_opens_no_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path)
    assert main(["check-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"ok: {config}: api=http://127.0.0.1:8800 ")
    assert "tokens=1" in out and "backend=torchrun" in out and "rules=" in out
    assert not (tmp_path / "never.db").exists()


@pytest.mark.parametrize(
    ("extra", "tokens", "needle"),
    [
        ("tick_interval_sec: 1\n", None, "tick_interval_sec"),
        ("", "tokens:\n  - {name: a, role: agent, sha256: " + '"' + "0" * 64 + '"}\n', "node"),
        ("rules: [/nonexistent/rules]\n", None, "/nonexistent/rules"),
        ("api:\n  tls_cert_file: /no/cert.pem\n  tls_key_file: /no/key.pem\n", None, "cert"),
    ],
    ids=["unknown-key", "unbound-agent-token", "missing-rules", "missing-tls-files"],
)
def test_a_bad_config_exits_2_with_the_error_a_start_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, tokens: str | None, needle: str
) -> None:
    config = _write(tmp_path, tokens=tokens)
    if extra.startswith("api:"):  # a second api: section would be a YAML error
        text = config.read_text().replace("api:\n", extra, 1)
        config.write_text(text)
    else:
        config.write_text(config.read_text() + extra)
    assert main(["check-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainguard-controller: bad configuration: ") and needle in err


def test_the_same_error_as_a_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path)
    config.write_text(config.read_text() + "tick_interval_sec: 1\n")
    assert main(["check-config", str(config)]) == 2
    checked = capsys.readouterr().err
    assert main(["--config", str(config)]) == 2
    assert capsys.readouterr().err == checked


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    for sub in ("check-config", "install-unit", "targets", "backup", "restore"):
        assert f"  {sub} " in out, sub

"""`agentctl token issue`: a new token bound to a node, its tokens-file line, the 0600 token
file and the atomic append to a tokens file."""

from __future__ import annotations

import io
import re
import stat
from pathlib import Path

import pytest

from trainguard.controller.auth import Principal, hash_token, load_tokens
from trainguard.controller.cli import main
from trainguard.controller.cli.errors import EXIT


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err, stdin=io.StringIO())
    return code, out.getvalue(), err.getvalue()


def _line_token(line: str) -> str:
    m = re.search(r'sha256: "([0-9a-f]{64})"', line)
    assert m, line
    return m.group(1)


def test_issue_prints_the_token_once_and_the_line_with_its_hash() -> None:
    code, out, err = _run("token", "issue", "node-12")
    assert code == 0, err
    token = out.strip()
    assert len(token) >= 40 and "\n" not in token
    (line,) = [x for x in err.splitlines() if x.startswith("- {")]
    assert line.startswith("- {name: agent-node-12, role: agent, node: node-12, sha256: ")
    assert _line_token(line) == hash_token(token)
    assert token not in err
    assert _run("token", "issue", "node-12")[1].strip() != token  # random each time


def test_issue_out_writes_a_new_0600_file_and_the_line_to_stdout(tmp_path: Path) -> None:
    out_file = tmp_path / "node-12.token"
    code, out, _ = _run("token", "issue", "node-12", "--name", "n12", "--out", str(out_file))
    assert code == 0
    token = out_file.read_text().strip()
    assert stat.S_IMODE(out_file.stat().st_mode) == 0o600
    assert out.startswith("- {name: n12, role: agent, node: node-12,")
    assert token not in out and _line_token(out) == hash_token(token)
    # never overwritten
    code, _, err = _run("token", "issue", "node-12", "--out", str(out_file))
    assert code == EXIT["usage"] and "exists" in err
    assert out_file.read_text().strip() == token


def test_issue_appends_to_a_tokens_file_that_then_loads(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        "# ours\ntokens:\n"
        f'  - {{name: ops, role: operator, sha256: "{hash_token("op")}"}}  # keep me\n'
    )
    tokens.chmod(0o640)
    out_file = tmp_path / "n12.token"
    code, _, err = _run(
        "token", "issue", "node-12", "--out", str(out_file), "--tokens-file", str(tokens)
    )
    assert code == 0, err
    text = tokens.read_text()
    assert text.startswith("# ours\n") and "# keep me" in text
    assert stat.S_IMODE(tokens.stat().st_mode) == 0o640
    store = load_tokens(tokens)
    token = out_file.read_text().strip()
    assert store.authenticate(token) == Principal("agent-node-12", "agent", "node-12")
    assert store.authenticate("op") == Principal("ops", "operator")
    assert list(tmp_path.glob(".tokens.yaml.*")) == []


@pytest.mark.parametrize(
    ("text", "args", "needle"),
    [
        pytest.param(
            "tokens:\n  - {name: agent-node-12, role: agent, node: node-12, sha256: "
            + '"'
            + "a" * 64
            + '"}\n',
            ("--name", "other"),
            "node node-12 has a token already",
            id="node-taken",
        ),
        pytest.param(
            "tokens:\n  - {name: agent-node-12, role: viewer, sha256: " + '"' + "a" * 64 + '"}\n',
            (),
            "named agent-node-12 exists",
            id="name-taken",
        ),
        pytest.param("tokens: []\n", (), "cannot append", id="flow-style-list"),
        pytest.param("nodes: []\n", (), "no `tokens:` list", id="not-a-tokens-file"),
    ],
)
def test_append_refused_writes_nothing_and_hands_out_no_token(
    tmp_path: Path, text: str, args: tuple[str, ...], needle: str
) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(text)
    out_file = tmp_path / "t"
    code, out, err = _run(
        "token", "issue", "node-12", *args, "--out", str(out_file), "--tokens-file", str(tokens)
    )
    assert code == EXIT["usage"]
    assert needle in err
    assert tokens.read_text() == text
    assert not out_file.exists() and out == ""


@pytest.mark.parametrize("node", ["", "-x", "node 12", "n{1}", "a:b"])
def test_issue_refuses_a_node_name_it_cannot_write_plainly(node: str) -> None:
    code, out, err = _run("token", "issue", node)
    assert code == EXIT["usage"] and out == ""
    assert "node" in err


def test_unreadable_ca_file_is_a_usage_error(tmp_path: Path) -> None:
    code, _, err = _run(
        "--url", "https://127.0.0.1:1", "--ca-file", str(tmp_path / "no.pem"), "get", "nodes"
    )
    assert code == EXIT["usage"]
    assert "CA file" in err


def test_issue_for_a_hostlist_writes_a_token_file_per_node_and_appends_every_line(
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n")
    out_dir = tmp_path / "tokens"
    code, out, err = _run(
        "token", "issue", "node-[01-03],gpu7", "--out-dir", str(out_dir),
        "--tokens-file", str(tokens),
    )  # fmt: skip
    assert code == 0, err
    assert len(out.splitlines()) == 4 and "SIGHUP" in err
    store = load_tokens(tokens)
    for node in ("node-01", "node-02", "node-03", "gpu7"):
        token_file = out_dir / f"{node}.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert token not in out + err
        assert store.authenticate(token) == Principal(name=f"agent-{node}", role="agent", node=node)


def test_issue_for_a_hostlist_with_one_node_taken_writes_nothing(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n")
    _run("token", "issue", "node-02", "--out", str(tmp_path / "n2"), "--tokens-file", str(tokens))
    assert "node-02" in tokens.read_text()
    before = tokens.read_text()
    code, out, err = _run(
        "token", "issue", "node-[01-03]", "--out-dir", str(tmp_path / "d"),
        "--tokens-file", str(tokens),
    )  # fmt: skip
    assert code == EXIT["usage"] and out == ""
    assert "node-02" in err
    assert tokens.read_text() == before and not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["node-[01-03]"], "--out-dir"),
        (["node-[01-03]", "--out", "x", "--out-dir", "d"], "--out-dir"),
        (["node-[03-01]"], "range"),
        (["node-[01-03"], "brackets"),
    ],
    ids=["no-out-dir", "out-with-several", "reversed-range", "unbalanced"],
)
def test_issue_for_a_hostlist_refuses_what_it_cannot_do(args: list[str], needle: str) -> None:
    code, out, err = _run("token", "issue", *args)
    assert code == EXIT["usage"] and out == ""
    assert needle in err

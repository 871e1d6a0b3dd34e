"""Tokens file loading, hashing, role checks and agent tokens bound to one node."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.controller.auth import Principal, TokenStore, hash_token, load_tokens
from trainguard.strict import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "tokens.yaml"
    p.write_text(text)
    return p


def test_hash_token_is_hex_sha256() -> None:
    assert hash_token("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_loaded_tokens_authenticate_by_hash_and_token_file(tmp_path: Path) -> None:
    (tmp_path / "agent.token").write_text("agent-secret\n")
    p = _write(
        tmp_path,
        f"tokens:\n"
        f"  - {{name: ops-alice, role: operator, sha256: {hash_token('alice-secret').upper()}}}\n"
        f"  - {{name: agent-node-1, role: agent, node: node-1, token_file: agent.token}}\n",
    )
    store = load_tokens(p)
    assert store.authenticate("alice-secret") == Principal("ops-alice", "operator")
    assert store.authenticate("agent-secret") == Principal("agent-node-1", "agent", "node-1")
    assert store.authenticate("alice-secret ") is None
    assert store.authenticate("") is None


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        pytest.param(
            "tokens:\n  - {name: a, role: operator, sha: x}\n", "tokens[0].sha", id="unknown-key"
        ),
        pytest.param(
            "tokens:\n  - {name: a, role: root, sha256: " + "a" * 64 + "}\n",
            "tokens[0].role",
            id="bad-role",
        ),
        pytest.param(
            "tokens:\n  - {name: a, role: viewer, sha256: abc}\n", "64 hexadecimal", id="short-hash"
        ),
        pytest.param("tokens:\n  - {name: a, role: viewer}\n", "exactly one of", id="no-secret"),
        pytest.param(
            "tokens:\n  - {name: a, role: viewer, sha256: " + "a" * 64 + "}\n"
            "  - {name: a, role: operator, sha256: " + "b" * 64 + "}\n",
            "duplicate name",
            id="duplicate-name",
        ),
        pytest.param(
            "tokens:\n  - {name: a, role: viewer, sha256: " + "a" * 64 + "}\n"
            "  - {name: b, role: operator, sha256: " + "a" * 64 + "}\n",
            "same token",
            id="duplicate-token",
        ),
        pytest.param(
            "tokens:\n  - {name: a, role: viewer, token_file: missing}\n",
            "cannot read",
            id="missing-token-file",
        ),
        pytest.param("tokns: []\n", "tokns", id="typo-top-level"),
        pytest.param(
            "tokens:\n  - {name: a, role: operator, node: node-1, sha256: " + "a" * 64 + "}\n",
            "only an agent token is bound to a node",
            id="operator-with-node",
        ),
        pytest.param(
            "tokens:\n  - {name: a, role: agent, node: ' ', sha256: " + "a" * 64 + "}\n",
            "tokens[0].node",
            id="blank-node",
        ),
        pytest.param(
            "tokens:\n  - {name: agents, role: agent, sha256: " + "a" * 64 + "}\n",
            "allow_shared_agent_tokens",
            id="shared-agent-token-without-the-option",
        ),
    ],
)
def test_bad_tokens_file_fails_with_file_key_and_reason(
    tmp_path: Path, body: str, needle: str
) -> None:
    p = _write(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        load_tokens(p)
    assert str(p) in str(e.value)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("role", "allowed"),
    [
        pytest.param("agent", {"report"}, id="agent"),
        pytest.param("operator", {"read", "write"}, id="operator"),
        pytest.param("viewer", {"read"}, id="viewer"),
    ],
)
def test_role_permissions(role: str, allowed: set[str]) -> None:
    p = Principal("x", role)  # type: ignore[arg-type]
    assert {perm for perm in ("report", "read", "write") if p.may(perm)} == allowed  # type: ignore[arg-type]


def test_store_from_plaintext_matches_only_exact_token() -> None:
    store = TokenStore.from_plaintext({"s3cret": ("ops", "operator")})
    assert store.authenticate("s3cret") == Principal("ops", "operator")
    assert store.authenticate("s3cre") is None
    assert len(store) == 1


def test_token_file_may_name_the_credentials_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "ops.token").write_text("ops-secret\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    p = _write(
        tmp_path,
        "tokens:\n"
        "  - {name: ops, role: operator, token_file: '${CREDENTIALS_DIRECTORY}/ops.token'}\n",
    )
    assert load_tokens(p).authenticate("ops-secret") == Principal("ops", "operator")
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(ConfigError) as e:
        load_tokens(p)
    assert e.value.key == "tokens[0].token_file"
    assert "CREDENTIALS_DIRECTORY is not set" in e.value.reason


def test_shared_agent_token_loads_only_behind_the_option(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "tokens:\n"
        f"  - {{name: agents, role: agent, sha256: {hash_token('shared')}}}\n"
        f"  - {{name: agent-node-2, role: agent, node: node-2, sha256: {hash_token('n2')}}}\n",
    )
    with pytest.raises(ConfigError) as e:
        load_tokens(p)
    assert e.value.key == "tokens[0].node"
    assert "agentctl token issue" in e.value.reason
    store = load_tokens(p, allow_shared_agent_tokens=True)
    assert store.authenticate("shared") == Principal("agents", "agent", None)
    assert store.authenticate("n2") == Principal("agent-node-2", "agent", "node-2")
    assert store.shared_agent_tokens() == ["agents"]


def test_entries_carry_the_bound_node_to_another_store() -> None:
    store = TokenStore.from_plaintext(
        {"t1": ("agent-node-1", "agent", "node-1"), "op": ("ops", "operator")}
    )
    copy = TokenStore(store.entries())
    assert copy.authenticate("t1") == Principal("agent-node-1", "agent", "node-1")
    assert copy.authenticate("op") == Principal("ops", "operator", None)
    assert copy.shared_agent_tokens() == []


def test_many_node_tokens_each_authenticate_as_their_own_node() -> None:
    store = TokenStore.from_plaintext(
        {f"tok-{i}": (f"agent-node-{i}", "agent", f"node-{i}") for i in range(2048)}
    )
    assert store.authenticate("tok-1234") == Principal("agent-node-1234", "agent", "node-1234")
    assert store.authenticate("tok-2048") is None


def test_replace_with_swaps_the_whole_token_set_in_place() -> None:
    store = TokenStore.from_plaintext({"old": ("agent-a", "agent", "a")})
    store.replace_with(TokenStore.from_plaintext({"new": ("agent-b", "agent", "b")}))
    assert store.authenticate("old") is None
    assert store.authenticate("new") == Principal(name="agent-b", role="agent", node="b")
    assert len(store) == 1

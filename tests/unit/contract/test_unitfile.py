"""install-unit: ExecStart rendering (pure) and the subcommand against a fake install prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.unitfile import UnitError, install_unit_main, render_unit, shipped_docs

TEMPLATE = """# comment ExecStart=/not/this
[Service]
Type=notify
ExecStart=/usr/local/bin/trainguard-agent --config /etc/trainguard/agent.yaml
Restart=always
"""


def test_render_replaces_only_the_program_of_execstart() -> None:
    out = render_unit(TEMPLATE, executable="/opt/tg/bin/trainguard-agent")
    assert out == TEMPLATE.replace("/usr/local/bin/", "/opt/tg/bin/")


def test_render_keeps_a_program_without_arguments_on_its_line() -> None:
    out = render_unit("ExecStart=/usr/bin/x\nRestart=no\n", executable="/venv/bin/x")
    assert out == "ExecStart=/venv/bin/x\nRestart=no\n"


@pytest.mark.parametrize(
    ("path", "written"),
    [
        ("/opt/my venv/bin/x", '"/opt/my venv/bin/x"'),
        ("/opt/100%/bin/x", "/opt/100%%/bin/x"),
        ('/opt/a"b/bin/x', '"/opt/a\\"b/bin/x"'),
    ],
    ids=["space-is-quoted", "percent-is-not-a-specifier", "quote-is-escaped"],
)
def test_render_escapes_what_systemd_would_misread(path: str, written: str) -> None:
    out = render_unit("ExecStart=/usr/bin/x --flag\n", executable=path)
    assert out == f"ExecStart={written} --flag\n"


@pytest.mark.parametrize(
    ("template", "executable", "reason"),
    [
        (TEMPLATE, "bin/trainguard-agent", "absolute"),
        ("[Service]\nType=notify\n", "/x", "found 0"),
        ("ExecStart=/a\nExecStart=/b\n", "/x", "found 2"),
        (TEMPLATE, "/opt/a\nb", "line break"),
    ],
    ids=["relative", "no-execstart", "two-execstart", "newline"],
)
def test_render_refuses_what_it_cannot_render(template: str, executable: str, reason: str) -> None:
    with pytest.raises(UnitError, match=reason):
        render_unit(template, executable=executable)


def _prefix(tmp_path: Path) -> Path:
    """A fake install prefix: bin/trainguard-agent and share/trainguard/systemd/ unit."""
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    script = prefix / "bin" / "trainguard-agent"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    share = prefix / "share" / "trainguard" / "systemd"
    share.mkdir(parents=True)
    (share / "trainguard-agent.service").write_text(TEMPLATE)
    return prefix


def test_install_writes_the_unit_for_the_prefix_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix, dest = _prefix(tmp_path), tmp_path / "units"
    dest.mkdir()
    args = ["--prefix", str(prefix), "--dest", str(dest)]
    assert install_unit_main(args, prog="trainguard-agent") == 0
    unit = dest / "trainguard-agent.service"
    assert f"ExecStart={prefix}/bin/trainguard-agent --config" in unit.read_text()
    assert unit.stat().st_mode & 0o777 == 0o644
    assert capsys.readouterr().out.startswith(f"wrote {unit}")
    assert install_unit_main(args, prog="trainguard-agent") == 0
    assert capsys.readouterr().out.startswith(f"unchanged {unit}")
    assert [p.name for p in dest.iterdir()] == [unit.name]  # no temporary file left


def test_dry_run_prints_the_unit_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix, dest = _prefix(tmp_path), tmp_path / "units"
    dest.mkdir()
    assert (
        install_unit_main(
            ["--venv", str(prefix), "--dest", str(dest), "--dry-run"], prog="trainguard-agent"
        )
        == 0
    )
    assert capsys.readouterr().out == render_unit(
        TEMPLATE, executable=str(prefix / "bin" / "trainguard-agent")
    )
    assert list(dest.iterdir()) == []


def test_unit_file_option_renders_another_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = _prefix(tmp_path)
    mine = tmp_path / "mine.service"
    mine.write_text("[Service]\nExecStart=/x --mine\n")
    argv = ["--prefix", str(prefix), "--unit-file", str(mine), "--dry-run"]
    assert install_unit_main(argv, prog="trainguard-agent") == 0
    assert f"ExecStart={prefix}/bin/trainguard-agent --mine" in capsys.readouterr().out


def test_a_prefix_without_the_script_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = _prefix(tmp_path)
    (prefix / "bin" / "trainguard-agent").chmod(0o644)  # there, but not executable
    assert install_unit_main(["--prefix", str(prefix)], prog="trainguard-agent") == 2
    assert "no executable trainguard-agent in:" in capsys.readouterr().err


def test_a_prefix_without_the_template_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = _prefix(tmp_path)
    (prefix / "share/trainguard/systemd/trainguard-agent.service").unlink()
    assert install_unit_main(["--prefix", str(prefix)], prog="trainguard-agent") == 2
    assert "no trainguard-agent.service in:" in capsys.readouterr().err


def test_an_unwritable_destination_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = _prefix(tmp_path)
    argv = ["--prefix", str(prefix), "--dest", str(tmp_path / "absent")]
    assert install_unit_main(argv, prog="trainguard-agent") == 1
    assert "cannot write" in capsys.readouterr().err


DOCUMENTED = (
    "[Unit]\nDocumentation=file:///usr/share/doc/trainguard/deploy.md https://example.org/x\n"
    + TEMPLATE
)


def test_render_points_the_shipped_docs_at_the_installations_copy() -> None:
    out = render_unit(DOCUMENTED, executable="/x", docs=Path("/opt/my tg/share/doc/trainguard"))
    (line,) = [ln for ln in out.splitlines() if ln.startswith("Documentation=")]
    # a URI: the space is percent-encoded; a link that is not a shipped doc is kept
    assert line == (
        "Documentation=file:///opt/my%20tg/share/doc/trainguard/deploy.md https://example.org/x"
    )
    assert render_unit(DOCUMENTED, executable="/x").startswith(DOCUMENTED.splitlines()[0])


def test_install_names_the_prefixs_docs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix, dest = _prefix(tmp_path), tmp_path / "units"
    dest.mkdir()
    (prefix / "share/trainguard/systemd/trainguard-agent.service").write_text(DOCUMENTED)
    args = ["--prefix", str(prefix), "--dest", str(dest)]
    assert install_unit_main(args, prog="trainguard-agent") == 2  # no docs in the prefix
    assert "deploy.md" in capsys.readouterr().err
    docs = prefix / "share/doc/trainguard"
    docs.mkdir(parents=True)
    (docs / "deploy.md").write_text("# deploy\n")
    assert install_unit_main(args, prog="trainguard-agent") == 0
    text = (dest / "trainguard-agent.service").read_text()
    assert f"Documentation={(docs / 'deploy.md').as_uri()} https://example.org/x\n" in text


@pytest.mark.parametrize("unit", ["trainguard-agent.service", "trainguard-controller.service"])
def test_the_shipped_units_name_docs_that_exist_in_the_checkout(unit: str) -> None:
    repo = Path(__file__).resolve().parents[3]
    names = shipped_docs((repo / "systemd" / unit).read_text())
    assert names and all((repo / "docs" / name).is_file() for name in names), names

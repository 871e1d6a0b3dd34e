"""`install-unit`: write a shipped systemd unit whose ExecStart runs this installation's script
and whose Documentation= names this installation's copy of the docs.

The units ship in the wheel as data files under `<prefix>/share/trainguard/systemd/`, the docs
under `<prefix>/share/doc/trainguard/` (where importlib.resources cannot see them), so the
template and the docs are found through the installed distribution's RECORD, which also
names the console script: a virtualenv, `pip --user` and `/usr/local` installs all get an
absolute ExecStart and Documentation= files that exist. `render_unit` is pure.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

UNIT_DIR = "/etc/systemd/system"
SHARE_SUBDIR = Path("share/trainguard/systemd")
DOCS_SUBDIR = Path("share/doc/trainguard")
# What a shipped unit's Documentation= names: the docs of an install under /usr, which
# install-unit re-points at this installation's copy.
SHIPPED_DOCS_URI = f"file:///usr/{DOCS_SUBDIR}/"

EXIT_OK = 0
EXIT_WRITE_FAILED = 1
EXIT_USAGE = 2


class UnitError(ValueError):
    """A unit template that cannot be rendered, or an installation that lacks a piece."""


def shipped_docs(template: str) -> list[str]:
    """The doc files (names) the unit's Documentation= lines name under SHIPPED_DOCS_URI."""
    return [
        uri.removeprefix(SHIPPED_DOCS_URI)
        for line in template.splitlines()
        if line.startswith("Documentation=")
        for uri in line[len("Documentation=") :].split()
        if uri.startswith(SHIPPED_DOCS_URI)
    ]


def render_unit(template: str, *, executable: str, docs: Path | None = None) -> str:
    """The unit text with the program of its one `ExecStart=` replaced by `executable`, and
    with each shipped doc its Documentation= names re-pointed into directory `docs`.

    Arguments after the program and every other line are kept as they are.
    """
    if docs is not None:
        if not docs.is_absolute():
            raise UnitError(f"Documentation= needs an absolute path, got {str(docs)!r}")
        template = "".join(_docs_line(line, docs) for line in template.splitlines(True))
    if not os.path.isabs(executable):
        raise UnitError(f"ExecStart needs an absolute path, got {executable!r}")
    lines = template.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if line.startswith("ExecStart=")]
    if len(found) != 1:
        raise UnitError(f"expected exactly one ExecStart= line, found {len(found)}")
    i = found[0]
    value = lines[i][len("ExecStart=") :]
    _program, sep, rest = value.lstrip().partition(" ")
    if not sep:  # the program alone: keep the line ending
        rest = value[len(value.rstrip("\r\n")) :]
    lines[i] = f"ExecStart={_quote(executable)}{sep}{rest}"
    return "".join(lines)


def _docs_line(line: str, docs: Path) -> str:
    if not line.startswith("Documentation="):
        return line
    body = line[len("Documentation=") :]
    ending = body[len(body.rstrip("\r\n")) :]
    uris = [
        (docs / u.removeprefix(SHIPPED_DOCS_URI)).as_uri() if u.startswith(SHIPPED_DOCS_URI) else u
        for u in body.split()
    ]
    return "Documentation=" + " ".join(uris) + ending


def _quote(path: str) -> str:
    """The path as systemd reads an ExecStart program: `%` is a specifier, whitespace and
    quotes need a quoted word."""
    if any(c in path for c in "\n\r\0"):
        raise UnitError(f"a path with a line break or NUL cannot go into a unit: {path!r}")
    path = path.replace("%", "%%")
    if any(c.isspace() or c in "\"'\\" for c in path):
        return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return path


def _installed_files() -> list[Path]:
    """Every file the installed `trainguard` distribution recorded, as absolute paths."""
    try:
        dist = importlib.metadata.distribution("trainguard")
    except importlib.metadata.PackageNotFoundError:
        return []
    return [Path(os.path.normpath(str(dist.locate_file(f)))) for f in dist.files or ()]


def _script_candidates(script: str, *, prefix: Path | None) -> Iterator[Path]:
    if prefix is not None:
        yield prefix / "bin" / script
        return
    recorded = _installed_files()
    yield from (f for f in recorded if f.name == script and f.parent.name == "bin")
    yield Path(sysconfig.get_path("scripts")) / script
    yield Path(sys.executable).parent / script


def _template_candidates(unit: str, *, prefix: Path | None) -> Iterator[Path]:
    if prefix is not None:
        yield prefix / SHARE_SUBDIR / unit
        return
    recorded = _installed_files()
    yield from (f for f in recorded if f.name == unit and f.parent.match(str(SHARE_SUBDIR)))
    yield Path(sysconfig.get_path("data")) / SHARE_SUBDIR / unit
    # a source checkout (an editable install records no data files): <checkout>/systemd/
    yield Path(__file__).resolve().parents[1] / "systemd" / unit


def _docs_candidates(*, prefix: Path | None) -> Iterator[Path]:
    if prefix is not None:
        yield prefix / DOCS_SUBDIR
        return
    recorded = _installed_files()
    yield from (f.parent for f in recorded if f.parent.match(str(DOCS_SUBDIR)))
    yield Path(sysconfig.get_path("data")) / DOCS_SUBDIR
    # a source checkout (an editable install records no data files): <checkout>/docs/
    yield Path(__file__).resolve().parents[1] / "docs"


def find_docs(names: Sequence[str], *, prefix: Path | None) -> Path:
    """The directory of this installation's (or `prefix`'s) docs that holds every file of
    `names`."""
    tried = list(dict.fromkeys(_docs_candidates(prefix=prefix)))
    for path in tried:
        if all((path / name).is_file() for name in names):
            return path.absolute()
    raise UnitError(f"no {', '.join(names)} in: {', '.join(str(p) for p in tried)}")


def find_script(script: str, *, prefix: Path | None) -> Path:
    """The absolute path of console script `script` of this installation (or of `prefix`)."""
    tried = list(dict.fromkeys(_script_candidates(script, prefix=prefix)))
    for path in tried:
        if path.is_file() and os.access(path, os.X_OK):
            return path.absolute()
    raise UnitError(f"no executable {script} in: {', '.join(str(p) for p in tried)}")


def find_template(unit: str, *, prefix: Path | None) -> Path:
    """The shipped unit file `unit` of this installation (or of `prefix`)."""
    tried = list(dict.fromkeys(_template_candidates(unit, prefix=prefix)))
    for path in tried:
        if path.is_file():
            return path
    raise UnitError(f"no {unit} in: {', '.join(str(p) for p in tried)}")


def _write(path: Path, text: str) -> bool:
    """Write `text` to `path` (mode 0644) by one rename; False if it already held it."""
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _parser(prog: str, unit: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{prog} install-unit",
        description=f"Write {unit} with ExecStart= running this installation's {prog} "
        "(a virtualenv's included) and Documentation= naming its docs. It does not run "
        "systemctl.",
    )
    p.add_argument(
        "--prefix",
        "--venv",
        type=Path,
        help="the virtualenv or install prefix to run (PREFIX/bin/"
        f"{prog}, template from PREFIX/{SHARE_SUBDIR}, docs in PREFIX/{DOCS_SUBDIR}); "
        "default: this installation",
    )
    p.add_argument(
        "--unit-file", type=Path, help="render this unit file instead of the shipped one"
    )
    p.add_argument("--dest", type=Path, default=Path(UNIT_DIR), help=f"default {UNIT_DIR}")
    p.add_argument("--dry-run", action="store_true", help="print the unit, write nothing")
    return p


def install_unit_main(argv: Sequence[str], *, prog: str) -> int:
    """`<prog> install-unit ...`: exit 0 written (or printed), 1 cannot write, 2 usage or a
    missing script or template."""
    unit = f"{prog}.service"
    args = _parser(prog, unit).parse_args(argv)
    prefix = args.prefix.absolute() if args.prefix is not None else None
    try:
        script = find_script(prog, prefix=prefix)
        template = args.unit_file or find_template(unit, prefix=prefix)
        try:
            text = template.read_text(encoding="utf-8")
        except OSError as e:
            raise UnitError(f"cannot read {template}: {e.strerror or e}") from None
        names = shipped_docs(text)
        docs = find_docs(names, prefix=prefix) if names else None
        rendered = render_unit(text, executable=str(script), docs=docs)
    except UnitError as e:
        print(f"{prog}: install-unit: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        sys.stdout.write(rendered)
        return EXIT_OK
    dest = args.dest / unit
    try:
        changed = _write(dest, rendered)
    except OSError as e:
        print(f"{prog}: install-unit: cannot write {dest}: {e.strerror or e}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    state = "wrote" if changed else "unchanged"
    print(f"{state} {dest} (ExecStart={script}, from {template})")
    print(f"next: systemctl daemon-reload && systemctl enable --now {prog}")
    return EXIT_OK


__all__ = [
    "UNIT_DIR",
    "UnitError",
    "find_docs",
    "find_script",
    "find_template",
    "install_unit_main",
    "render_unit",
    "shipped_docs",
]

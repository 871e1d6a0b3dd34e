"""`trainguard-ckpt`: the command line over sources.py and export.py (parse, run, print).

Exit status: 0 done; 2 a usage error, or a checkpoint that is corrupt, partial, another job's
(`--job`) or not a trainguard checkpoint, named by path and field on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.trainer.ckpttool.sources import Entry, Source, open_source
from trainguard.trainer.manifest import (
    CheckpointInvalid,
    DeltaLink,
    ForeignCheckpoint,
    Manifest,
    check_job,
    delta_link,
    info_of,
    manifest_milestones,
    read_manifest,
)
from trainguard.trainer.retention import CheckpointInfo, RetentionPolicy, Tier, select

__all__ = ["COMMANDS", "build_parser", "main"]

PROG = "trainguard-ckpt"
COMMANDS = ("ls", "verify", "show", "prune", "export", "drill")
# --keep-* flag -> the RetentionPolicy field it sets
_POLICY_FLAGS = {
    "keep_last": "recent_last",
    "keep_hours": "recent_hours",
    "keep_daily": "daily_days",
    "keep_weekly": "weekly_weeks",
}


class ToolError(Exception):
    """A refusal with its message (exit 2)."""


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--job", help="refuse checkpoints of any other job (exit 2)")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint (s3:// sources)")
    p.add_argument("--region", help="S3 region (s3:// sources)")
    return p


def _policy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "retention (default: the policy the job recorded in its newest manifest)"
    )
    g.add_argument("--keep-last", type=int, help="recent tier: the newest K checkpoints")
    g.add_argument("--keep-hours", type=float, help="recent tier: everything from the last H hours")
    g.add_argument("--keep-daily", type=int, help="daily tier: one a day for D days")
    g.add_argument("--keep-weekly", type=int, help="weekly tier: one a week for W weeks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="List, verify, show, prune, export and restore-drill trainguard checkpoints "
        "(a checkpoint directory or s3://BUCKET/PREFIX).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common()
    src = "checkpoint directory (ckpt_dir) or s3://BUCKET/PREFIX"
    p = sub.add_parser("ls", parents=[common], help="every checkpoint: step, time, size, tier")
    p.add_argument("source", help=src)
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check every file's checksum (default: on for a directory, off for S3)",
    )
    _policy_flags(p)
    p = sub.add_parser("verify", parents=[common], help="every file against its manifest")
    p.add_argument("source", help=src)
    p.add_argument("steps", nargs="*", type=int, metavar="STEP", help="default: every one")
    p = sub.add_parser("show", parents=[common], help="one checkpoint's manifest, size and tier")
    p.add_argument("source", help=src)
    p.add_argument("step", type=int, metavar="STEP")
    _policy_flags(p)
    p = sub.add_parser("prune", parents=[common], help="delete what no retention tier keeps")
    p.add_argument("source", help=src)
    p.add_argument("--dry-run", action="store_true", help="print what would go, delete nothing")
    _policy_flags(p)
    p = sub.add_parser("export", parents=[common], help="model weights as one safetensors file")
    p.add_argument("source", help=src)
    p.add_argument("--step", type=int, help="default: the newest verified checkpoint")
    p.add_argument("--format", choices=("safetensors",), default="safetensors")
    p.add_argument("--out", required=True, type=Path, help="the file to write")
    p = sub.add_parser(
        "drill",
        parents=[common],
        help="restore drill: the newest verified checkpoint into a directory a job resumes from",
    )
    p.add_argument("source", help=src + " (usually the second-region replica)")
    p.add_argument("--into", required=True, type=Path, help="ckpt_dir to restore into")
    p.add_argument("--step", type=int, help="default: the newest verified checkpoint")
    p.add_argument(
        "--max-age-s",
        type=float,
        help="fail (exit 2) when the restored checkpoint is older than this: the recovery "
        "point objective",
    )
    return parser


# --- what the commands share ---------------------------------------------------------------


def _check_job(args: argparse.Namespace, manifest: Manifest, where: str) -> None:
    if args.job:
        check_job(manifest, job=args.job, where=where)


def _policy(args: argparse.Namespace, entries: Sequence[Entry]) -> RetentionPolicy:
    """The job's recorded policy (newest readable manifest), with the --keep-* flags over it."""
    base = RetentionPolicy()
    for e in entries:
        if e.manifest is not None and "retention" in e.manifest.extra:
            where = f"{e.where}/manifest.json: extra.retention"
            try:
                base = RetentionPolicy.from_json(e.manifest.extra["retention"], where=where)
            except ValueError as err:
                raise ToolError(str(err)) from None
            break
    changes = {
        field: getattr(args, flag)
        for flag, field in _POLICY_FLAGS.items()
        if getattr(args, flag, None) is not None
    }
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as err:
        text = str(err)
        for flag, field in _POLICY_FLAGS.items():
            text = text.replace(f"retention.{field}:", "--" + flag.replace("_", "-"))
        raise ToolError(text) from None


def _tiers(
    entries: Sequence[Entry], *, policy: RetentionPolicy, now: float, newest_good: int | None
) -> dict[int, tuple[Tier, ...]]:
    infos = [
        CheckpointInfo(step=e.step, created_at=None)
        if e.manifest is None
        else info_of(e.manifest, step=e.step)  # a delta's base included: it keeps it
        for e in entries
    ]
    return select(policy=policy, checkpoints=infos, now=now, newest_good_step=newest_good)


def _newest_verified(source: Source, entries: Sequence[Entry]) -> int | None:
    for e in entries:
        if e.manifest is None:
            continue
        try:
            source.verify(e.step)
        except CheckpointInvalid:
            continue
        return e.step
    return None


def _iso(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _tier_text(tiers: Sequence[Tier], milestones: Sequence[str]) -> str:
    if not tiers:
        return "(prune)"
    words = [f"milestone:{'+'.join(milestones)}" if t is Tier.MILESTONE else str(t) for t in tiers]
    return ",".join(words)


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    cells = [[h for _, h in columns]] + [[str(r[k]) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _print(args: argparse.Namespace, data: Any, table: str) -> None:
    if args.output == "json":
        print(json.dumps(data, indent=1, sort_keys=True))
    else:
        print(table)


def _row(
    entry: Entry, tiers: tuple[Tier, ...], verified: bool | None, problem: str
) -> dict[str, Any]:
    m = entry.manifest
    milestones = list(manifest_milestones(m)) if m is not None else []
    link = _link(m)
    return {
        "step": entry.step,
        "where": entry.where,
        "created_at": m.created_at if m is not None else None,
        "created": _iso(m.created_at if m is not None else None),
        "size_bytes": entry.size_bytes,
        "size": _size(entry.size_bytes) if m is not None else "-",
        "world_size": m.world_size if m is not None else None,
        "world": m.world_size if m is not None else "-",
        "job": (m.job or "-") if m is not None else "-",
        "format": m.format if m is not None else "-",
        "base_step": link.base_step if link is not None else None,
        "kind": "-" if m is None else (f"delta of {link.base_step}" if link else "full"),
        "verified": verified,
        "ok": "-" if verified is None else ("yes" if verified else "NO"),
        "problem": problem,
        "milestones": milestones,
        "tiers": [str(t) for t in tiers],
        "tier": _tier_text(tiers, milestones),
    }


_LS_COLUMNS = (
    ("step", "STEP"),
    ("created", "CREATED"),
    ("size", "SIZE"),
    ("world", "WORLD"),
    ("kind", "KIND"),
    ("job", "JOB"),
    ("ok", "VERIFIED"),
    ("tier", "TIER"),
)
_JSON_DROP = ("created", "size", "world", "ok", "tier", "kind")


def _link(m: Manifest | None) -> DeltaLink | None:
    """A delta's link to its base (None: full, unreadable, or a malformed link, which
    verification reports)."""
    if m is None:
        return None
    try:
        return delta_link(m)
    except CheckpointInvalid:
        return None


def _json_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in _JSON_DROP} for r in rows]


# --- the commands --------------------------------------------------------------------------


def _ls(args: argparse.Namespace, source: Source, now: float) -> int:
    entries = source.entries()
    for e in entries:
        if e.manifest is not None:
            _check_job(args, e.manifest, e.where)
    verify = args.verify if args.verify is not None else not args.source.startswith("s3://")
    verified: dict[int, bool | None] = {}
    problems = {e.step: e.problem for e in entries}
    for e in entries:
        if not verify:
            verified[e.step] = None if e.manifest is not None else False
            continue
        try:
            source.verify(e.step)
            verified[e.step] = True
        except CheckpointInvalid as err:
            verified[e.step], problems[e.step] = False, str(err)
    if verify:
        newest_good = next((s for s, ok in verified.items() if ok), None)
    else:  # unverified: the newest readable one stands in for the newest verified
        newest_good = next((e.step for e in entries if e.manifest is not None), None)
    policy = _policy(args, entries)
    tiers = _tiers(entries, policy=policy, now=now, newest_good=newest_good)
    rows = [_row(e, tiers[e.step], verified[e.step], problems[e.step]) for e in entries]
    table = _table(rows, _LS_COLUMNS) if rows else f"no checkpoints in {source.where}"
    notes = [f"{r['step']}: {r['problem']}" for r in rows if r["problem"]]
    if notes and args.output == "table":
        table += "\n" + "\n".join(notes)
    data = {
        "source": source.where,
        "policy": policy.to_json(),
        "newest_good_step": newest_good,
        "checkpoints": _json_rows(rows),
    }
    _print(args, data, table)
    return 0


def _verify(args: argparse.Namespace, source: Source, now: float) -> int:
    entries = source.entries()
    steps = args.steps or [e.step for e in entries]
    results: list[dict[str, Any]] = []
    for step in steps:
        try:
            manifest = source.verify(step)
            _check_job(args, manifest, f"{source.where}: step {step}")
            results.append({"step": step, "ok": True, "problem": ""})
        except CheckpointInvalid as err:
            results.append({"step": step, "ok": False, "problem": str(err)})
    bad = [r for r in results if not r["ok"]]
    table = _table(
        [{**r, "ok": "yes" if r["ok"] else "NO"} for r in results],
        (("step", "STEP"), ("ok", "VERIFIED"), ("problem", "PROBLEM")),
    )
    if not results:
        table = f"no checkpoints in {source.where}"
    _print(args, {"source": source.where, "checkpoints": results}, table)
    for r in bad:
        print(f"{PROG}: error: step {r['step']}: {r['problem']}", file=sys.stderr)
    return 2 if bad or not results else 0


def _show(args: argparse.Namespace, source: Source, now: float) -> int:
    entries = source.entries()
    entry = next((e for e in entries if e.step == args.step), None)
    if entry is None:
        raise ToolError(f"{source.where}: no checkpoint of step {args.step}")
    if entry.manifest is None:
        raise ToolError(entry.problem)
    _check_job(args, entry.manifest, entry.where)
    newest_good = next((e.step for e in entries if e.manifest is not None), None)
    tiers = _tiers(entries, policy=_policy(args, entries), now=now, newest_good=newest_good)
    row = _row(entry, tiers[entry.step], None, "")
    m = entry.manifest
    data = {**_json_rows([row])[0], "manifest": m.to_json()}
    lines = [
        f"step:        {m.step}",
        f"where:       {entry.where}",
        f"job:         {m.job or '-'}",
        f"created:     {row['created']}",
        f"world size:  {m.world_size}",
        f"format:      {m.format}",
        *_chain_lines(m),
        f"size:        {row['size']} ({entry.size_bytes} bytes in {len(m.files)} files)",
        f"tier:        {row['tier']}",
        f"version:     {m.trainguard_version}",
        f"request id:  {m.request_id or '-'}",
        f"extra:       {json.dumps(m.extra, sort_keys=True)}",
        "files:",
        *(f"  {name}  {meta['size']}  {meta['sha256']}" for name, meta in sorted(m.files.items())),
    ]
    _print(args, data, "\n".join(lines))
    return 0


def _chain_lines(m: Manifest) -> list[str]:
    """The chain of a delta: its base, parent, position and the base manifest it was written
    on (`verify STEP` checks every link)."""
    link = _link(m)
    if link is None:
        return ["chain:       full checkpoint"]
    return [
        f"chain:       delta {link.index} of base step {link.base_step} "
        f"(parent step {link.parent_step}, codec {link.codec})",
        f"base sha256: {link.base_manifest_sha256} (its manifest.json)",
    ]


def _prune(args: argparse.Namespace, source: Source, now: float) -> int:
    entries = source.entries()
    newest_good = _newest_verified(source, entries)
    if newest_good is None:
        raise ToolError(f"{source.where}: no checkpoint verifies; nothing pruned")
    policy = _policy(args, entries)
    gone = source.prune(policy=policy, now=now, newest_good_step=newest_good, dry_run=True)
    if not args.dry_run and gone:
        gone = source.prune(policy=policy, now=now, newest_good_step=newest_good, dry_run=False)
    verb = "would delete" if args.dry_run else "deleted"
    by_step = {e.step: e for e in entries}
    rows = [
        {
            "step": s,
            "where": by_step[s].where if s in by_step else "-",
            "created": _iso(m.created_at if (m := by_step[s].manifest) is not None else None)
            if s in by_step
            else "-",
        }
        for s in gone
    ]
    table = (
        f"{verb} {len(rows)} checkpoint(s) of {source.where} (newest verified: step {newest_good})"
    )
    if rows:
        table += "\n" + _table(rows, (("step", "STEP"), ("created", "CREATED"), ("where", "WHERE")))
    data = {
        "source": source.where,
        "dry_run": bool(args.dry_run),
        "policy": policy.to_json(),
        "newest_good_step": newest_good,
        "deleted": [r["step"] for r in rows],
    }
    _print(args, data, table)
    return 0


def _export(args: argparse.Namespace, source: Source, now: float) -> int:
    # Deferred heavy dependency: torch (export.py) is needed by export alone.
    from trainguard.trainer.ckpttool.export import (  # noqa: PLC0415
        ExportError,
        model_weights,
        write_safetensors,
    )

    step = args.step
    if step is None:
        step = _newest_verified(source, source.entries())
        if step is None:
            raise ToolError(f"{source.where}: no checkpoint verifies; nothing to export")
    with source.fetch(step) as directory:
        manifest = read_manifest(directory)
        _check_job(args, manifest, f"{source.where}: step {step}")
        try:
            weights = model_weights(directory, manifest)
            if not weights:
                raise ExportError(f"{directory}: the checkpoint holds no model tensors")
            size = write_safetensors(
                args.out,
                weights,
                metadata={
                    "format": "pt",
                    "trainguard_job": manifest.job,
                    "trainguard_step": str(manifest.step),
                    "trainguard_world_size": str(manifest.world_size),
                },
            )
        except ExportError as err:
            raise ToolError(str(err)) from None
    data = {"step": step, "out": str(args.out), "tensors": len(weights), "bytes": size}
    _print(args, data, f"step {step}: {len(weights)} tensors, {_size(size)} -> {args.out}")
    return 0


def _drill(args: argparse.Namespace, source: Source, now: float) -> int:
    # Deferred heavy dependency: torch (export.py) decodes the restored tensors.
    from trainguard.trainer.ckpttool.drill import DrillError, restore  # noqa: PLC0415

    if args.max_age_s is not None and not 0 < args.max_age_s <= 366 * 86400:
        raise ToolError(f"--max-age-s must be in (0, {366 * 86400}], got {args.max_age_s:g}")
    step = args.step
    if step is None:
        step = _newest_verified(source, source.entries())
        if step is None:
            raise ToolError(f"{source.where}: no checkpoint verifies; nothing to restore")
    try:
        result = restore(
            source,
            step=step,
            into=args.into,
            job=args.job,
            now=now,
            max_age_s=args.max_age_s,
        )
    except DrillError as err:
        raise ToolError(str(err)) from None
    data = result.to_json()
    table = "\n".join(
        [
            f"restored:    step {result.step} from {source.where}",
            f"into:        {result.path}",
            f"job:         {result.job or '-'}",
            f"created:     {_iso(result.created_at)} (age {result.age_s:.0f} s)",
            f"size:        {_size(result.bytes)} in {result.files} files, every checksum verified",
            f"tensors:     {result.tensors} model tensors decoded",
            f"restore:     {result.restore_s:.1f} s",
            f"resume with: ckpt_dir={result.path.parent}",
        ]
    )
    _print(args, data, table)
    return 0


_RUN = {
    "ls": _ls,
    "verify": _verify,
    "show": _show,
    "prune": _prune,
    "export": _export,
    "drill": _drill,
}


def main(argv: Sequence[str] | None = None, *, clock: Clock = SYSTEM_CLOCK) -> int:
    args = build_parser().parse_args(argv)
    try:
        source = open_source(args.source, endpoint_url=args.endpoint_url, region_name=args.region)
        return _RUN[args.command](args, source, clock.now())
    except (CheckpointInvalid, ForeignCheckpoint, ToolError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

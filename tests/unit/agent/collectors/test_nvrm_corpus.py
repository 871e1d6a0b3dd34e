"""Real NVIDIA driver lines (tests/fixtures/kmsg/nvrm_corpus.yaml) through the kernel log parser
and the shipped XID catalog: every form of every record gives the expected event and class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard.agent.collectors.xid import KernelLogParser
from trainguard.xid_catalog import XidCatalog

CORPUS = Path(__file__).resolve().parents[3] / "fixtures" / "kmsg" / "nvrm_corpus.yaml"
CASES: list[dict[str, Any]] = yaml.safe_load(CORPUS.read_text())["cases"]
NOW = 1_700_000_000.0


@pytest.fixture(scope="module")
def catalog() -> XidCatalog:
    return XidCatalog.load()


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_corpus_line_gives_the_expected_event(case, catalog):
    parser = KernelLogParser()

    events = [e for line in case["lines"] for e in parser.feed(line, now=NOW)]

    got = []
    for e in events:
        item: dict[str, Any] = {"kind": e.kind, "bus": e.pci_bus_id}
        if e.kind == "xid":
            info = catalog.classify(e.code, e.message)
            item.update(code=e.code, severity=info.severity, action=info.action)
        got.append(item)
    want = [{k: v for k, v in x.items() if k != "known"} for x in case["expect"]]
    assert got == want
    for e, x in zip(events, case["expect"], strict=True):
        if "known" in x:
            assert (e.code in catalog) is x["known"]


def test_corpus_covers_every_form_the_issue_names():
    ids = {c["id"] for c in CASES}
    for needed in (
        "fallen-kmsg-one-record-escaped",
        "fallen-dmesg-indented-continuation",
        "fallen-journal-lines",
        "fallen-gpu-line-no-domain",
        "user-written-kmsg-record-is-not-an-xid",
        "xid154-reset-to-none",
        "xid145-rlw-remap-nonfatal",
    ):
        assert needed in ids


def test_user_written_records_are_counted_not_parsed():
    parser = KernelLogParser()

    assert parser.feed("12,1,1,-;NVRM: Xid (PCI:0000:18:00): 48, x", now=NOW) == []
    assert parser.feed("4,2,2,-;NVRM: Xid (PCI:0000:18:00): 48, x", now=NOW) != []
    assert parser.non_kernel_records_total == 1

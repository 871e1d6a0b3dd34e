"""XidCatalog: the shipped rules/xid_catalog.yaml, and strict loading of broken tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.strict import ConfigError
from trainguard.xid_catalog import ACTIONS, XidCatalog, default_catalog_path

REPO = Path(__file__).resolve().parents[3]
REQUIRED = [
    8,
    13,
    31,
    32,
    38,
    43,
    44,
    45,
    46,
    48,
    61,
    62,
    63,
    64,
    68,
    69,
    74,
    78,
    79,
    92,
    94,
    95,
    109,
    110,
    119,
    120,
    121,
    122,
    123,
    124,
    140,
    143,
    *range(144, 151),
    154,
]


@pytest.fixture(scope="module")
def catalog() -> XidCatalog:
    return XidCatalog.load()


def test_default_path_is_the_repo_rules_file():
    assert default_catalog_path().resolve() == REPO / "rules" / "xid_catalog.yaml"


def test_shipped_catalog_covers_the_codes_operators_meet(catalog):
    missing = [c for c in REQUIRED if c not in catalog]

    assert missing == []
    assert all(catalog.get(c).name and catalog.get(c).description for c in REQUIRED)
    assert {catalog.get(c).action for c in catalog.codes()} <= set(ACTIONS)


@pytest.mark.parametrize(
    ("code", "severity", "action"),
    [
        pytest.param(13, "application", "restart_job", id="13-graphics-exception"),
        pytest.param(31, "application", "restart_job", id="31-mmu-fault"),
        pytest.param(38, "informational", "none", id="38-firmware-watchdog-ignore"),
        pytest.param(43, "informational", "none", id="43-channel-reset-ignore"),
        pytest.param(44, "informational", "none", id="44-ctxsw-fault-ignore"),
        pytest.param(46, "fatal", "reset_gpu", id="46-gpu-stopped"),
        pytest.param(45, "application", "none", id="45-preemptive-cleanup"),
        pytest.param(48, "fatal", "reset_gpu", id="48-dbe"),
        pytest.param(63, "informational", "none", id="63-row-remap-event"),
        pytest.param(64, "fatal", "drain", id="64-row-remap-failure"),
        pytest.param(74, "fatal", "drain", id="74-nvlink"),
        pytest.param(79, "fatal", "reboot_node", id="79-fallen-off-bus"),
        pytest.param(94, "application", "restart_job", id="94-contained-ecc"),
        pytest.param(95, "fatal", "reset_gpu", id="95-uncontained-ecc"),
        pytest.param(109, "fatal", "reset_gpu", id="109-ctxsw-timeout"),
        pytest.param(110, "fatal", "reset_gpu", id="110-security-fault"),
        pytest.param(119, "fatal", "reset_gpu", id="119-gsp-timeout"),
    ],
)
def test_classification_of_key_codes(catalog, code, severity, action):
    info = catalog.get(code)

    assert (info.code, info.severity, info.action) == (code, severity, action)


def test_every_shipped_entry_cites_its_source(catalog):
    for code in catalog.codes():
        info = catalog.get(code)
        assert info.source.startswith("NVIDIA XID catalog: "), code
        if info.decided_by is None and info.source.endswith(("RESET_GPU", "RESTART_APP")):
            expected = "reset_gpu" if info.source.endswith("RESET_GPU") else "restart_job"
            assert info.action == expected or info.differs, f"{code}: departs without a reason"


_CHANGED = "GPU recovery action changed from "


@pytest.mark.parametrize(
    ("code", "message", "severity", "action"),
    [
        pytest.param(145, "RLW_REMAP Nonfatal XC0 i0 Link 00 (0x4 0x1)", "informational", "none"),
        pytest.param(145, "RLW, nonfatal, cross-contain=0, Link 3", "informational", "none"),
        pytest.param(145, "RLW_REMAP Non-fatal XC0", "informational", "none", id="non-fatal"),
        pytest.param(145, "RLW_REMAP Fatal XC0 i0 Link 00", "fatal", "reset_gpu"),
        pytest.param(145, "RLW_REMAP", "fatal", "reset_gpu", id="no-word-keeps-entry"),
        pytest.param(48, "Nonfatal", "fatal", "reset_gpu", id="word-ignored-elsewhere"),
        pytest.param(
            154,
            _CHANGED + "0x1 (GPU Reset Required) to 0x0 (None)",
            "informational",
            "none",
            id="154-to-none",
        ),
        pytest.param(
            154,
            _CHANGED + "0x0 (None) to 0x2 (Node Reboot Required)",
            "fatal",
            "reboot_node",
            id="154-to-reboot",
        ),
        pytest.param(
            154, _CHANGED + "0x0 (None) to 0x3 (Drain P2P)", "fatal", "drain", id="154-to-drain"
        ),
        pytest.param(
            154,
            _CHANGED + "0x0 (None) to 0x4 (Drain and Reset)",
            "fatal",
            "reset_gpu",
            id="154-to-drain-and-reset",
        ),
        pytest.param(
            154,
            _CHANGED + "0x0 (None) to 0x9 (Future)",
            "fatal",
            "reset_gpu",
            id="154-unknown-action-keeps-entry",
        ),
    ],
)
def test_the_line_decides_where_the_entry_says_so(catalog, code, message, severity, action):
    info = catalog.classify(code, message)

    assert (info.severity, info.action) == (severity, action)


def test_fatal_codes_are_exactly_the_fatal_entries(catalog):
    fatal = catalog.fatal_codes()

    assert {48, 74, 79, 95, 119}.issubset(fatal)
    assert fatal.isdisjoint({13, 31, 43, 45, 63, 94})
    assert fatal == {c for c in catalog.codes() if catalog.get(c).severity == "fatal"}


def test_unknown_code_is_an_informational_unknown_entry(catalog):
    info = catalog.get(999)

    assert (info.code, info.severity, info.action, info.known) == (
        999,
        "informational",
        "none",
        False,
    )
    assert catalog.get(79).known is True


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "xids.yaml"
    p.write_text(text)
    return p


GOOD_ENTRY = "    name: X\n    severity: fatal\n    action: drain\n    description: d\n"


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        pytest.param(
            "version: 1\nxids:\n  79:\n    name: X\n    severity: deadly\n    action: drain\n",
            "xids.79.severity",
            "must be one of",
            id="bad-severity",
        ),
        pytest.param(
            "version: 1\nxids:\n  79:\n    name: X\n    severity: fatal\n    action: panic\n",
            "xids.79.action",
            "must be one of",
            id="bad-action",
        ),
        pytest.param(
            "version: 1\nxids:\n  48:\n" + GOOD_ENTRY + "    sevrity: fatal\n",
            "xids.48.sevrity",
            "unknown key",
            id="unknown-entry-key",
        ),
        pytest.param(
            "version: 1\nxids:\n  48:\n    severity: fatal\n    action: drain\n",
            "xids.48.name",
            "required key is missing",
            id="missing-name",
        ),
        pytest.param(
            "version: 1\nxids:\n  48:\n    name: ' '\n    severity: fatal\n    action: drain\n",
            "xids.48.name",
            "must not be empty",
            id="empty-name",
        ),
        pytest.param(
            "version: 1\nxids:\n  seventy-nine:\n" + GOOD_ENTRY,
            "xids.seventy-nine",
            "must be an integer",
            id="non-integer-code",
        ),
        pytest.param(
            "version: 1\nxids:\n  0:\n" + GOOD_ENTRY, "xids.0", "must be 1..", id="code-zero"
        ),
        pytest.param("version: 1\nxid:\n  79:\n" + GOOD_ENTRY, "xid", "unknown key", id="typo-top"),
        pytest.param("version: 2\nxids:\n  79:\n" + GOOD_ENTRY, "version", "unsupported", id="v2"),
        pytest.param("version: 1\nxids: {}\n", "xids", "non-empty", id="empty-table"),
    ],
)
def test_broken_catalog_fails_naming_file_key_and_reason(tmp_path, text, key, reason):
    path = _write(tmp_path, text)

    with pytest.raises(ConfigError) as err:
        XidCatalog.load(path)

    assert err.value.source == str(path)
    assert err.value.key == key
    assert reason in err.value.reason


def test_duplicate_code_is_rejected_not_silently_overridden(tmp_path):
    path = _write(tmp_path, "version: 1\nxids:\n  79:\n" + GOOD_ENTRY + "  79:\n" + GOOD_ENTRY)

    with pytest.raises(ConfigError, match="duplicate key 79") as err:
        XidCatalog.load(path)
    assert err.value.source == str(path)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        XidCatalog.load(tmp_path / "nope.yaml")


def test_custom_catalog_reclassifies_a_code(tmp_path):
    path = _write(
        tmp_path,
        "version: 1\nxids:\n  13:\n    name: Graphics engine exception\n"
        "    severity: fatal\n    action: drain\n    description: >-\n      treat as\n"
        "      hardware here\n",
    )

    catalog = XidCatalog.load(str(path))

    assert catalog.fatal_codes() == frozenset({13})
    assert catalog.get(13).description == "treat as hardware here"


def test_catalog_loads_from_another_working_directory(tmp_path):
    code = "from trainguard.xid_catalog import XidCatalog; print(len(XidCatalog.load()))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )

    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= len(REQUIRED)

"""Crash safety with the real process: `kill -9` of trainguard-controller while a
notification is in flight, restart, and every action completes exactly once (the webhook case
on both store backends)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.fakes.http_receiver import Receiver
from tests.helpers import wait_for
from tests.integration.controller_proc import (
    OP,
    dbe_rules,
    post_gpu_report,
    start_controller,
    write_config,
)
from tests.integration.postgres_proc import BOTH_STORES


def config(tmp_path: Path, notify_yaml: str, store_location: str | None = None) -> Path:
    store = None
    extra = f"notify:\n{notify_yaml}"
    if store_location is not None:
        store = {"url" if "://" in store_location else "path": store_location}
        if "://" in store_location:
            # a lone controller on PostgreSQL holds the lease: the one restarted after a
            # kill -9 leads once the killed one's lease ran out (2 s here, 10 by default)
            extra += "ha:\n  lease_s: 2\n"
    return write_config(
        tmp_path,
        rules=dbe_rules(["notify", "drain"]),
        tick_interval_s=0.2,
        stale_after_s=30,
        extra_yaml=extra,
        store=store,
    )


def leads(url: str) -> bool:
    """The controller acts: it holds the lease (PostgreSQL) or has none to hold (SQLite)."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    for line in r.text.splitlines():
        if line.startswith("trainguard_controller_leader "):
            return float(line.split()[1]) == 1
    return True


def incident_actions(url: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/incidents/1", headers=OP, timeout=10)
    return r.json()["actions"] if r.status_code == 200 else []


def all_done(url: str, expected: int) -> bool:
    actions = incident_actions(url)
    return len(actions) >= expected and all(
        a["state"] in ("succeeded", "failed", "skipped") for a in actions
    )


@pytest.mark.slow
@BOTH_STORES
def test_kill9_mid_webhook_delivery_resends_same_key_and_drains_once(
    tmp_path, controllers, store_location
):
    hold = threading.Event()
    with Receiver() as rx:
        rx.hold = hold
        cfg = config(
            tmp_path,
            f"  webhooks:\n    - {{name: hook, url: '{rx.url}/hook', timeout_s: 60}}\n",
            store_location,
        )
        first = start_controller(cfg, log_path=tmp_path / "first.log")
        controllers.append(first)
        post_gpu_report(first.url, node="node-1", dbe=1, seq=1)
        assert rx.arrived.wait(30), "the webhook delivery never started"
        first.kill()  # the delivery is in flight: its row is `running` in the store
        rx.hold = None
        hold.set()

        second = start_controller(cfg, log_path=tmp_path / "second.log")
        controllers.append(second)
        wait_for(lambda: leads(second.url), timeout_s=30, what="the restarted controller to lead")
        post_gpu_report(second.url, node="node-1", dbe=1, seq=2)
        wait_for(lambda: all_done(second.url, 2), timeout_s=30, what="the plan to finish")

        keys = [r.headers["x-trainguard-idempotency-key"] for r in rx.requests]
        assert keys == ["1:0:notify:hook", "1:0:notify:hook"]  # re-sent, same key: once
        actions = {a["kind"]: a for a in incident_actions(second.url)}
        assert actions["notify"]["state"] == "succeeded"
        assert actions["drain"]["state"] == "succeeded" and actions["drain"]["attempts"] == 1
        node = httpx.get(f"{second.url}/v1/nodes/node-1", headers=OP, timeout=10).json()
        assert node["state"] == "drained"
        detail = httpx.get(f"{second.url}/v1/incidents/1", headers=OP, timeout=10).json()
        assert any(t["kind"] == "action_resumed" for t in detail["timeline"])


@pytest.mark.slow
def test_kill9_mid_slack_delivery_is_not_resent_and_pages_elsewhere(tmp_path, controllers):
    hold = threading.Event()
    with Receiver() as rx:
        rx.hold = hold
        (tmp_path / "slack_url").write_text(f"{rx.url}/slack\n")
        cfg = config(
            tmp_path,
            f"  slack: {{webhook_url: {{file: {tmp_path / 'slack_url'}}}, timeout_s: 60}}\n"
            f"  webhooks:\n    - {{name: hook, url: '{rx.url}/hook', timeout_s: 60}}\n",
        )
        first = start_controller(cfg, log_path=tmp_path / "first.log")
        controllers.append(first)
        post_gpu_report(first.url, node="node-1", dbe=1, seq=1)
        assert rx.arrived.wait(30), "the slack delivery never started"
        assert [r.path for r in rx.requests] == ["/slack"]
        first.kill()
        rx.hold = None
        hold.set()

        second = start_controller(cfg, log_path=tmp_path / "second.log")
        controllers.append(second)
        post_gpu_report(second.url, node="node-1", dbe=1, seq=2)
        wait_for(lambda: all_done(second.url, 4), timeout_s=30, what="the plan to finish")

        assert sorted(r.path for r in rx.requests) == ["/hook", "/hook", "/slack"]
        hook_keys = sorted(
            r.headers["x-trainguard-idempotency-key"] for r in rx.requests if r.path == "/hook"
        )
        assert hook_keys == ["1:0:notify:hook", "1:page:a1:notify:hook"]
        slack = next(a for a in incident_actions(second.url) if a["params"]["channel"] == "slack")
        assert slack["state"] == "failed" and "at most once" in slack["result"]

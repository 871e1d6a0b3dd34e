"""The controller's configuration: nested frozen dataclasses loaded strictly from YAML.

Every field states its unit and why its default. Invariants are checked at load so a bad
file fails with `FILE: key: reason`. Secrets (Slack URL, PagerDuty routing key, webhook HMAC
secret) are never values in this file: the config names a file or an environment variable.
A secret's path may start with `${CREDENTIALS_DIRECTORY}`, expanded at load: under systemd
that is where `LoadCredential=` puts the files a `DynamicUser=` service could not read itself.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from trainguard.controller.backends.config import BackendConfig, SlurmBackendConfig
from trainguard.controller.storeurl import POSTGRES_SCHEMES, url_password_problem
from trainguard.rules import shipped_dir
from trainguard.strict import ConfigError, Invalid, apply_overrides, build, load_file

DEFAULT_CONFIG_PATH = "/etc/trainguard/controller.yaml"

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise Invalid(key, f"must be > 0, got {value}")


def _within(key: str, value: float, lo: float, hi: float) -> None:
    """Invalid(key) unless lo <= value <= hi, naming the bounds."""
    if not lo <= value <= hi:
        raise Invalid(key, f"must be within {_bound(lo)}..{_bound(hi)}, got {value}")


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


CREDENTIALS_VAR = "CREDENTIALS_DIRECTORY"
_CREDENTIALS_REF = "${" + CREDENTIALS_VAR + "}"


def expand_credentials(path: str, *, key: str, environ: Mapping[str, str] | None = None) -> str:
    """`path` with `${CREDENTIALS_DIRECTORY}` replaced by that variable's value (systemd sets
    it for a unit with `LoadCredential=`); raises Invalid(key) if it is unset, or if the path
    names any other `$` variable (only this one is expanded: a typo must not pass)."""
    if "$" not in path:
        return path
    if "$" in path.replace(_CREDENTIALS_REF, ""):
        raise Invalid(key, f"only {_CREDENTIALS_REF} is expanded in a path, got {path!r}")
    directory = (os.environ if environ is None else environ).get(CREDENTIALS_VAR, "")
    if not directory:
        raise Invalid(
            key,
            f"{path!r} uses {_CREDENTIALS_REF}, but {CREDENTIALS_VAR} is not set "
            "(systemd sets it for a unit with LoadCredential=)",
        )
    return path.replace(_CREDENTIALS_REF, directory.rstrip("/"))


def default_rules_paths() -> list[str]:
    """The shipped rules directory (package data of `trainguard.rules`)."""
    return [str(shipped_dir())]


# The longest grace a stop_job command carries (trainguard.command_args.StopJobArgs).
STOP_GRACE_MAX_S = 3600.0


@dataclass(frozen=True)
class Secret:
    """Where a secret comes from: a file (first line, stripped) or an environment variable.

    Exactly one of the two is set. The value is read when a notifier is built, never logged.
    """

    file: str | None = None  # may start with ${CREDENTIALS_DIRECTORY}
    env: str | None = None

    def __post_init__(self) -> None:
        if (self.file is None) == (self.env is None):
            raise Invalid("file", "set exactly one of file or env")
        if self.file is not None:
            object.__setattr__(self, "file", expand_credentials(self.file, key="file"))

    def read(self) -> str:
        if self.file is not None:
            try:
                value = Path(self.file).read_text(encoding="utf-8").strip()
            except OSError as e:
                raise ConfigError(self.file, "", f"cannot read secret: {e.strerror or e}") from None
            if not value:
                raise ConfigError(self.file, "", "secret file is empty")
            return value
        assert self.env is not None
        env_value = os.environ.get(self.env, "").strip()
        if not env_value:
            raise ConfigError("(environment)", self.env, "secret variable is unset or empty")
        return env_value


DEFAULT_STORE_PATH = "/var/lib/trainguard/controller.db"


@dataclass(frozen=True)
class StoreConfig:
    """Where the controller keeps its state: one SQLite file (the default, nothing to run) or
    a PostgreSQL database (`url`) for sites that run one (docs/controller.md, "Store")."""

    # One SQLite file (WAL). /var/lib is where a systemd StateDirectory= lives.
    path: str = DEFAULT_STORE_PATH
    # PostgreSQL instead of SQLite: a libpq URL without a password,
    # postgresql://USER@HOST:PORT/DATABASE (a socket directory: postgresql:///DB?host=/run/x).
    url: str | None = None
    # The PostgreSQL password: a file holding it (first line), never the URL or this file.
    # May start with ${CREDENTIALS_DIRECTORY} (systemd LoadCredential=). Unset: libpq's own
    # PGPASSWORD / PGPASSFILE (~/.pgpass) from the environment, or none (peer, cert auth).
    password_file: str | None = None
    # Seconds to wait for PostgreSQL to answer a connection attempt (libpq connect_timeout).
    # 10: a server on the site's network answers in far less; past it, start fails (exit 2).
    connect_timeout_s: int = 10
    # PostgreSQL only: seconds the store may stay unreachable before this controller pages
    # every notify channel (and resolves the page when it is back). 10: a server restart for
    # a minor upgrade takes less; a lost database server pages within seconds of its loss.
    page_after_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.path:
            raise Invalid("path", "must not be empty")
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in POSTGRES_SCHEMES:
                raise Invalid(
                    "url", f"must be a postgresql:// URL, got scheme {parts.scheme or '(none)'!r}"
                )
            problem = url_password_problem(self.url)
            if problem is not None:  # the URL is not repeated: it holds the password
                raise Invalid(
                    "url",
                    f"{problem}: a password never goes into the config file; put it in the "
                    "file store.password_file names, or in PGPASSWORD / ~/.pgpass",
                )
            if self.path != DEFAULT_STORE_PATH:
                raise Invalid("url", "set store.url (PostgreSQL) or store.path (SQLite), not both")
        if self.password_file is not None:
            if self.url is None:
                raise Invalid("password_file", "only with store.url (PostgreSQL)")
            object.__setattr__(
                self, "password_file", expand_credentials(self.password_file, key="password_file")
            )
        _within("connect_timeout_s", self.connect_timeout_s, 1, 300)
        _within("page_after_s", self.page_after_s, 0, 3600)

    @property
    def location(self) -> str:
        """What `Store` opens: the PostgreSQL URL if set, else the SQLite file."""
        return self.url if self.url is not None else self.path

    def read_password(self) -> str | None:
        """The password from `password_file` (first line, stripped); None without one."""
        if self.password_file is None:
            return None
        return Secret(file=self.password_file).read()


@dataclass(frozen=True)
class ConnectionsConfig:
    """Bounds on the API's connections and request bodies (controller/connlimits.py,
    docs/security.md "Connections and bodies")."""

    # Connections open at once; when full, the one idle longest is closed for a new one (none
    # idle: 503). 0 = the open-file limit less 256 (LimitNOFILE=65536 in the systemd unit);
    # a value above that limit is lowered to it.
    max_open: int = 0
    # Seconds a request may take to send its headers (from its first byte; a new connection's
    # first request from the connect): a slowloris or a connection that never sends a request
    # is closed (408). 10 s: a report's headers are one packet.
    header_timeout_s: float = 10.0
    # Seconds a request may take to send its body after its headers: 30 s moves the 4 MiB
    # body limit over a 1.1 Mbit/s link.
    body_timeout_s: float = 30.0
    # Seconds an idle keep-alive connection stays open. 75 s: agents post every second and
    # keep their connection; agentctl and scrapers reconnect.
    idle_timeout_s: float = 75.0
    # Requests in flight at once per credential (token; the peer address without one): an
    # agent sends one at a time, agentctl a few. Beyond it: 429.
    per_credential_requests: int = 16
    # Body bytes in flight per credential (the declared Content-Length counts from the
    # headers, before the body is read): two full-size reports. Beyond it: 429.
    per_credential_body_bytes: int = 8 * 1024 * 1024
    # Body bytes in flight from every caller together: 256 MiB (64 full-size reports at
    # once; a 2,000-node cluster's reports are a few KiB each). Beyond it: 503.
    total_body_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        _within("max_open", self.max_open, 0, 1_000_000)
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            _positive(name, getattr(self, name))
        if self.per_credential_requests < 1:
            raise Invalid(
                "per_credential_requests", f"must be >= 1, got {self.per_credential_requests}"
            )
        _positive("per_credential_body_bytes", self.per_credential_body_bytes)
        if self.total_body_bytes < self.per_credential_body_bytes:
            raise Invalid(
                "total_body_bytes",
                f"must be >= per_credential_body_bytes ({self.per_credential_body_bytes})",
            )


@dataclass(frozen=True)
class ApiConfig:
    # Loopback by default: exposing the API is a deliberate choice (with TLS below).
    host: str = "127.0.0.1"
    # 8800: clear of Prometheus (9090), agents (9500) and common web ports. 0 = free port.
    port: int = 8800
    # YAML list of {name, role, sha256 | token_file, node}; mode 0600. Under the systemd unit:
    # ${CREDENTIALS_DIRECTORY}/tokens (LoadCredential=tokens:/etc/trainguard/tokens.yaml).
    tokens_file: str = "/etc/trainguard/tokens.yaml"
    # Largest accepted request body, bytes: a report of a full 8-GPU node with a 500-event
    # backlog is far below 4 MiB; larger bodies are refused with 413.
    max_body_bytes: int = 4 * 1024 * 1024
    # PEM certificate and key; both or neither (plain HTTP behind a TLS proxy).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # PEM CA bundle for client certificates (mutual TLS; needs tls_cert_file): a client
    # certificate it signed whose subject CN (or, without a CN, its one DNS subjectAltName)
    # is a node name speaks as that node's agent, no token needed. Clients without a
    # certificate (agentctl, token agents) still connect. See docs/security.md.
    tls_client_ca_file: str | None = None
    # Migration aid, off by default: accept agent tokens bound to no node (`node:` missing),
    # each of which may speak for ANY node. Logged as a WARNING at start and at each node's
    # first report through such a token. See docs/security.md "Migrating".
    allow_shared_agent_tokens: bool = False
    # Processes that serve the port (HTTP, token check, body limit) and hand report bodies to
    # the controller process, which decodes and ingests them (controller/ingest/).
    # 0 = the controller process serves everything itself. See BENCHMARKS.md "Controller scale".
    ingest_workers: int = 0
    # Most nodes this controller registers: a report from a new node beyond it is refused
    # (403 naming the limit, nothing stored), so a caller with an agent credential cannot
    # grow the store and the live state without end. 10,000 is 5x a 2,000-node cluster.
    max_nodes: int = 10_000
    # Most silences active at once: one more is refused (403 naming the limit), so a caller
    # with a writer credential cannot grow the silence table, and every incident's silence
    # check, without end. 1,000 is far more than operators keep (a few per maintenance).
    max_silences: int = 1000
    # Job names a node may introduce: a name the job table does not hold (a job started
    # outside the controller, or an invented one) takes one of its node's places while the
    # node reports it; one beyond the node's or the controller's budget is refused (the
    # report is taken without it, counted and audited). A name no node has reported for
    # unknown_job_expire_s is forgotten. Keeps a node from growing the live job view that
    # every report and tick walks. 64 is far more than the jobs one node runs at once.
    max_unknown_jobs_per_node: int = 64
    max_unknown_jobs: int = 10_000
    unknown_job_expire_s: float = 900.0
    # Connections and bodies in flight (see ConnectionsConfig).
    connections: ConnectionsConfig = field(default_factory=ConnectionsConfig)

    def __post_init__(self) -> None:
        for name in ("tokens_file", "tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, expand_credentials(value, key=name))
        _within("ingest_workers", self.ingest_workers, 0, 64)
        _within("port", self.port, 0, 65535)
        _positive("max_body_bytes", self.max_body_bytes)
        if self.connections.per_credential_body_bytes < self.max_body_bytes:
            raise Invalid(
                "connections.per_credential_body_bytes",
                f"must be >= max_body_bytes ({self.max_body_bytes}): one full body must pass",
            )
        _within("max_nodes", self.max_nodes, 1, 1_000_000)
        _within("max_silences", self.max_silences, 1, 100_000)
        _within("max_unknown_jobs_per_node", self.max_unknown_jobs_per_node, 0, 100_000)
        _within("max_unknown_jobs", self.max_unknown_jobs, 0, 1_000_000)
        _positive("unknown_job_expire_s", self.unknown_job_expire_s)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise Invalid("tls_key_file", "tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise Invalid(
                "tls_client_ca_file", "client certificates need TLS: set tls_cert_file too"
            )


@dataclass(frozen=True)
class SafetyConfig:
    # Record decisions and intended actions, execute nothing: for a first rollout.
    dry_run: bool = False
    # At most this many nodes drained automatically per window; beyond it we page a person
    # instead. 2 per hour bounds the damage of a bad rule on a 2,000-node cluster.
    drain_budget: int = 2
    # The budget's sliding window, seconds.
    drain_budget_window_s: float = 3600.0
    # More than this many distinct nodes tripping the same rule within the window is a
    # cluster problem (fabric, driver rollout, bad rule): page once, drain nothing.
    breaker_threshold: int = 3
    # The breaker's sliding window, seconds. 10 min: a shared cause shows up together.
    breaker_window_s: float = 600.0
    # Rules whose whole point is that the node stopped reporting: a drain for them is
    # allowed on stale data (every other drain needs fresh data).
    stale_exempt_rules: list[str] = field(default_factory=lambda: ["node_silent"])

    def __post_init__(self) -> None:
        if self.drain_budget < 0:
            raise Invalid("drain_budget", f"must be >= 0, got {self.drain_budget}")
        _positive("drain_budget_window_s", self.drain_budget_window_s)
        if self.breaker_threshold < 1:
            raise Invalid("breaker_threshold", f"must be >= 1, got {self.breaker_threshold}")
        _positive("breaker_window_s", self.breaker_window_s)


@dataclass(frozen=True)
class SlackConfig:
    # The incoming-webhook URL is itself the credential, so it comes from a secret.
    webhook_url: Secret
    # Incidents below this severity are not posted (info is for the timeline only).
    min_severity: Severity = "warning"
    # Seconds for one POST; the worker retries, so keep it short.
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _positive("timeout_s", self.timeout_s)


@dataclass(frozen=True)
class PagerDutyConfig:
    # Events API v2 integration key.
    routing_key: Secret
    # Events API v2 endpoint; overridable for a proxy or a test receiver.
    url: str = "https://events.pagerduty.com/v2/enqueue"
    # Only incidents at or above this severity page; escalations (budget, breaker,
    # permanent action failure) always page.
    min_severity: Severity = "critical"
    # `source` field of the event: which controller raised it.
    source: str = "trainguard-controller"
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise Invalid("url", f"must start with http:// or https://, got {self.url!r}")
        _positive("timeout_s", self.timeout_s)


# Labels the controller sets on its alerts itself (controller/rules/export.py alert_labels):
# the exported alert's own, the targets' identity labels and `source`.
ALERT_LABELS_OF_TRAINGUARD = frozenset(
    "alertname severity scope source node gpu link device port job rank".split()
)


# notify.alertmanager.resend_s bounds: under 10 s floods Alertmanager for nothing; over an
# hour leaves a restarted Alertmanager without the page for too long.
RESEND_MIN_S = 10.0
RESEND_MAX_S = 3600.0
# A re-sent alert's endsAt is this many resend intervals ahead (Prometheus: 4).
RESEND_HOLD_INTERVALS = 4


@dataclass(frozen=True)
class AlertmanagerChannelConfig:
    # Alertmanager's base URL (its API v2 is under /api/v2/alerts). Incidents go there as
    # alerts labelled like the exported Prometheus alert of the same rule and target, so
    # Alertmanager groups both into one notification with one PagerDuty dedup key.
    url: str
    # Only incidents at or above this severity are sent; escalations always are.
    min_severity: Severity = "info"
    # Extra labels on every alert: the `external_labels` your Prometheus adds to its alerts
    # (e.g. cluster), so routes and group_by on them see the controller's alerts too.
    labels: dict[str, str] = field(default_factory=dict)
    # How long Alertmanager keeps an incident's alert firing when no resolve comes (a
    # controller gone for good), s. A resolve ends it at once. 24 h: far past a restart or
    # an HA failover, short enough that a lost resolve does not page for days.
    hold_s: float = 86400.0
    # How often the leader re-sends every open incident's alert(s), s (as Prometheus's
    # resend_delay): Alertmanager keeps alerts in memory only, so a restarted Alertmanager,
    # a lost POST or an HA peer that never saw one gets the page back within one interval.
    # A re-sent alert's endsAt is RESEND_HOLD_INTERVALS intervals ahead: alerts no longer
    # re-sent (the controller gone) resolve by themselves after that.
    resend_s: float = 60.0
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise Invalid("url", f"must start with http:// or https://, got {self.url!r}")
        for name in self.labels:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise Invalid("labels", f"invalid label name {name!r}")
            if name in ALERT_LABELS_OF_TRAINGUARD:
                raise Invalid("labels", f"{name!r} is set by trainguard itself")
        _positive("hold_s", self.hold_s)
        if not RESEND_MIN_S <= self.resend_s <= RESEND_MAX_S:
            raise Invalid(
                "resend_s",
                f"must be between {RESEND_MIN_S:g} and {RESEND_MAX_S:g} s, got {self.resend_s}",
            )
        _positive("timeout_s", self.timeout_s)


@dataclass(frozen=True)
class WebhookConfig:
    # Channel name: appears in metrics labels and idempotency keys, so short and stable.
    name: str
    url: str
    # HMAC-SHA256 key for X-Trainguard-Signature; optional (then no signature header).
    secret: Secret | None = None
    min_severity: Severity = "info"
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise Invalid("name", f"must be letters, digits, '-' or '_', got {self.name!r}")
        if not self.url.startswith(("http://", "https://")):
            raise Invalid("url", f"must start with http:// or https://, got {self.url!r}")
        _positive("timeout_s", self.timeout_s)


@dataclass(frozen=True)
class NotifyConfig:
    # Every channel is optional; with none configured, `notify` actions succeed as no-ops
    # (recorded in the timeline) so a rule never fails for lack of a channel.
    slack: SlackConfig | None = None
    pagerduty: PagerDutyConfig | None = None
    webhooks: list[WebhookConfig] = field(default_factory=list)
    # Incidents as alerts to Alertmanager, which then pages (docs/deploy.md, "Paging").
    alertmanager: AlertmanagerChannelConfig | None = None
    # Link shown in notifications, e.g. the dashboard or the API URL; empty = none.
    base_url: str = ""

    def __post_init__(self) -> None:
        names = [w.name for w in self.webhooks]
        for reserved in ("slack", "pagerduty", "alertmanager"):
            if reserved in names:
                raise Invalid("webhooks", f"name {reserved!r} is reserved")
        if len(set(names)) != len(names):
            raise Invalid("webhooks", "webhook names must be unique")


@dataclass(frozen=True)
class ActionsConfig:
    # Tries per action step before it fails for good (transient errors only; permanent
    # errors fail at once). 5 tries with the backoff below span about a minute.
    max_attempts: int = 5
    # First retry delay, seconds, doubled per attempt up to backoff_max_s.
    backoff_initial_s: float = 2.0
    backoff_max_s: float = 60.0
    # A queued agent command with no result after this long is reported failed, seconds.
    # Agents report every second; 5 minutes covers a checkpoint of a large model.
    command_timeout_s: float = 300.0
    # Drain: seconds the agent gives job processes between SIGTERM and SIGKILL.
    drain_stop_grace_s: float = 30.0
    # While a remediation acts on a node, its agent reports this often instead of at its own
    # interval (the report's answer says `report_in_s`), so each command and its result cost
    # a fraction of a report interval, not one each: a node with a command queued or in
    # flight, and for fast_reports_window_s after; every spare while a remediation step is
    # open (a warm standby may be assigned). 0 = off (every node at its own interval).
    # At most fast_reports_max_nodes nodes report fast at once (the others keep their own
    # interval): 128 at 0.1 s is at most ~1,300 extra reports a second, within what one
    # controller ingests (BENCHMARKS.md "Controller scale").
    fast_reports_s: float = 0.1
    fast_reports_window_s: float = 5.0
    fast_reports_max_nodes: int = 128

    def __post_init__(self) -> None:
        if not (self.fast_reports_s == 0 or 0.05 <= self.fast_reports_s <= 10):
            raise Invalid(
                "fast_reports_s", f"must be 0 (off) or within 0.05..10, got {self.fast_reports_s}"
            )
        _within("fast_reports_max_nodes", self.fast_reports_max_nodes, 0, 100_000)
        _within("fast_reports_window_s", self.fast_reports_window_s, 0, 600)
        if self.max_attempts < 1:
            raise Invalid("max_attempts", f"must be >= 1, got {self.max_attempts}")
        _positive("backoff_initial_s", self.backoff_initial_s)
        if self.backoff_max_s < self.backoff_initial_s:
            raise Invalid("backoff_max_s", "must be >= actions.backoff_initial_s")
        _positive("command_timeout_s", self.command_timeout_s)
        _positive("drain_stop_grace_s", self.drain_stop_grace_s)
        if self.drain_stop_grace_s > STOP_GRACE_MAX_S:
            raise Invalid(
                "drain_stop_grace_s",
                f"must be <= {STOP_GRACE_MAX_S:g} (a stop_job's grace),"
                f" got {self.drain_stop_grace_s}",
            )


# The most restarts the restart-loop breaker may wait for (jobs.restart_loop_restarts): the
# step reads that many earlier restart rows of the job.
RESTART_LOOP_MAX = 100


@dataclass(frozen=True)
class JobsConfig:
    # Rendezvous port of attempt N when the job spec names none: base + N % span. Rotating
    # means a new attempt never binds a port the last one may still hold in TIME_WAIT.
    rdzv_port_base: int = 29500
    rdzv_port_span: int = 16
    # How long a proactive checkpoint may take before the latest committed one is used, s.
    # The trainer's async save only blocks for the snapshot; 30 s covers agreement + write.
    checkpoint_timeout_s: float = 30.0
    # Seconds the agent gives a job's processes between SIGTERM and SIGKILL on a restart or
    # stop (the trainer takes an emergency checkpoint on SIGTERM).
    stop_grace_s: float = 30.0
    # How long a restart waits for the old attempt's processes to report exited beyond the
    # grace, s; a node that does not answer by then is not waited for.
    stop_timeout_s: float = 30.0
    # How long a restarted job may take to show a step past its checkpoint, s (rendezvous,
    # imports, checkpoint load). Then the restart fails and a person is paged.
    progress_timeout_s: float = 300.0
    # How long a job may stay in `starting` (since its attempt began) while no step is
    # starting it (after a restart step failed, or a controller restart), s; then it crashes
    # with that reason and job_process_failed opens an incident. Longer than
    # progress_timeout_s, which bounds a start a restart step still watches.
    start_timeout_s: float = 600.0
    # With no spare and no shrink possible, how long a replace waits for a spare to appear
    # before paging, s (a job spec may override it). 5 min: a spare being repaired or booted.
    spare_wait_s: float = 300.0
    # collect_stacks waits this long for the agents' stack dumps before going on, s.
    stacks_timeout_s: float = 10.0
    # After the controller (re)starts, a node it has not heard from yet is neither reporting
    # nor silent but unknown, and the steps that act on it (checkpoint, drain, replace,
    # restart, stop, grow) wait for its next report for at most this long, s; then it counts
    # as silent. 40 s: an agent that lost the controller retries with a back-off capped at
    # 30 s (agent reporter.backoff_max_s) and a 5 s request timeout, so a live node reports
    # within it even after a long outage. A node that was already silent when the controller
    # stopped is silent at once. Must be >= node_silent_after_s.
    resume_grace_s: float = 40.0
    # Fencing: attempt N+1 of a job starts only when every node of attempt N confirmed its
    # stop or has been silent (no report) for longer than this, s. 6 s = just past
    # node_silent_after_s (5 s): by then the node_silent rule has declared the node lost and it
    # is being replaced, so waiting longer only delays the restart (a dead node's MTTR pays
    # every second of it). Safety does not rest on the lease's length: a node silent longer is
    # dead or cut off, its ranks cannot commit (the trainer's EPOCH fence) and its agent stops
    # the stale attempt when it reports again (ReportResponse.job_attempts). Must exceed
    # node_silent_after_s.
    attempt_lease_s: float = 6.0
    # The restart-loop breaker: a job that a rule's restart or rollback restarted this many
    # times within restart_loop_window_s without checkpoint progress (each restart resumed
    # from a step no newer than the one before) is not restarted again but held, and pages.
    # 3 in 30 min: a job that crashes again at once is caught after three tries in a few
    # minutes, while one whose hardware failed three times in a day keeps going. 0: never.
    restart_loop_restarts: int = 3
    restart_loop_window_s: float = 1800.0
    # In-process recovery (a job spec's recovery.in_process, controller.actions.inprocess):
    # the new world's rendezvous store runs in its rank 0 at in_process_store_port_base +
    # epoch % in_process_store_port_span (rotating, as rdzv ports do: an older world's store
    # may still hold its port). Kept apart from the rdzv ports.
    in_process_store_port_base: int = 29600
    in_process_store_port_span: int = 16
    # How long the survivors and the standby may take, from the rejoin sent, until every rank
    # of the new world reports a trained step under the new epoch, s; then the full restart
    # from the checkpoint takes over. 60 s: the rejoin itself takes seconds; past this the
    # fast path has lost its point.
    in_process_deadline_s: float = 60.0
    # The membership's timeout_s: bound on the new world's rendezvous and collectives, s.
    in_process_rejoin_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.in_process_store_port_base <= 65535 - self.in_process_store_port_span:
            raise Invalid("in_process_store_port_base", "base + span must be a valid TCP port")
        if self.in_process_store_port_span < 1:
            raise Invalid(
                "in_process_store_port_span",
                f"must be >= 1, got {self.in_process_store_port_span}",
            )
        if not 0 < self.in_process_rejoin_timeout_s <= 3600:
            raise Invalid(
                "in_process_rejoin_timeout_s",
                f"must be in (0, 3600], got {self.in_process_rejoin_timeout_s}",
            )
        if not 1 <= self.rdzv_port_base <= 65535 - self.rdzv_port_span:
            raise Invalid("rdzv_port_base", "base + span must be a valid TCP port")
        if self.rdzv_port_span < 1:
            raise Invalid("rdzv_port_span", f"must be >= 1, got {self.rdzv_port_span}")
        for name in (
            "checkpoint_timeout_s",
            "stop_grace_s",
            "stop_timeout_s",
            "progress_timeout_s",
            "start_timeout_s",
            "stacks_timeout_s",
            "resume_grace_s",
            "attempt_lease_s",
            "in_process_deadline_s",
        ):
            _positive(name, getattr(self, name))
        if self.spare_wait_s < 0:
            raise Invalid("spare_wait_s", f"must be >= 0, got {self.spare_wait_s}")
        if self.stop_grace_s > STOP_GRACE_MAX_S:
            raise Invalid(
                "stop_grace_s",
                f"must be <= {STOP_GRACE_MAX_S:g} (a stop_job's grace), got {self.stop_grace_s}",
            )
        if not 0 <= self.restart_loop_restarts <= RESTART_LOOP_MAX:
            raise Invalid(
                "restart_loop_restarts",
                f"must be in [0, {RESTART_LOOP_MAX}], got {self.restart_loop_restarts}",
            )
        if not (
            math.isfinite(self.restart_loop_window_s)
            and 60.0 <= self.restart_loop_window_s <= 7 * 86400.0
        ):
            raise Invalid(
                "restart_loop_window_s",
                f"must be in [60, 604800] s, got {self.restart_loop_window_s}",
            )


@dataclass(frozen=True)
class LifecycleConfig:
    """The node lifecycle (docs/controller.md "Node lifecycle"): the preflight a node passes
    before it goes back into service."""

    # How long a preflight may take to answer before the node stays drained, s. The checks
    # take seconds (a burn of preflight_burn_s per GPU, an all-reduce); 10 min covers an agent
    # that is still coming back from a reboot.
    preflight_timeout_s: float = 600.0
    # Seconds of compute burn per GPU. 2 s is enough for a matmul's result and rate to settle.
    preflight_burn_s: float = 2.0
    # Fraction below the reference figures (compute, bandwidth) that still passes.
    preflight_tolerance: float = 0.1
    # The checkpoint directory the ckpt_storage check writes to; empty: the agent's own.
    preflight_ckpt_dir: str = ""
    # A spare joins a job only after a passing preflight: a result at most this old is taken
    # as it is, an older one (or none) runs a preflight first, s. 0: every time.
    spare_preflight_max_age_s: float = 3600.0
    # Keep the free spares' passes fresh ahead of need (a preflight when the last pass is older
    # than half of spare_preflight_max_age_s), so a swap seldom waits for one.
    spare_preflight_ahead: bool = True
    # Lemon nodes: a node with this many hardware incidents (a plan that drains it, or an xid /
    # ecc / gpu lost rule) within lemon_window_s is retired for RMA the next time it is drained
    # or leaves the spare pool. 0: never.
    lemon_incidents: int = 3
    lemon_window_s: float = 30 * 86400.0
    # After a drain for a hardware incident whose XIDs the catalog answers with reset_gpu or
    # reboot_node: diagnose (a preflight), repair (that reset or reboot, through the agent),
    # validate (a preflight), and back into service; a failure keeps the node drained with
    # the reason. On by default: a reset is refused while anything uses the GPU, a reboot has
    # its own gates below, and a node returns only after a passing validation. Off: a drained
    # node waits for `agentctl node return`.
    auto_repair: bool = True
    # The role a node repaired by the lifecycle comes back in: "spare" (the hot-spare pool; its
    # job has moved on) or "active" (general service).
    repair_return_role: Literal["spare", "active"] = "spare"
    # How long the agent may take to answer a repair command, s. A GPU reset takes seconds;
    # the answer to a reboot comes before the reboot (the validation's preflight_timeout_s
    # waits for the node to come back).
    repair_timeout_s: float = 300.0
    # May the lifecycle reboot a node (the catalog's reboot_node, or a GPU that no longer
    # answers NVML)? Off: such a node stays drained, saying it needs a reboot. The agent must
    # also allow it (its repair.allow_reboot).
    reboot_enabled: bool = False
    # At most reboot_max lifecycle reboots in any reboot_window_s across the cluster: a bad
    # driver or firmware push makes every node ask for one, and that should reach a person,
    # not reboot the fleet. A node over the limit stays drained, saying so.
    reboot_max: int = 2
    reboot_window_s: float = 3600.0

    def __post_init__(self) -> None:
        _positive("preflight_timeout_s", self.preflight_timeout_s)
        if not 0 < self.repair_timeout_s <= 3600:
            raise Invalid("repair_timeout_s", f"must be in (0, 3600], got {self.repair_timeout_s}")
        if not 0 <= self.reboot_max <= 1000:
            raise Invalid("reboot_max", f"must be in [0, 1000], got {self.reboot_max}")
        if not 0 < self.reboot_window_s <= 7 * 86400.0:
            raise Invalid(
                "reboot_window_s", f"must be in (0, 604800] (a week), got {self.reboot_window_s}"
            )
        if self.repair_return_role not in ("spare", "active"):
            raise Invalid(
                "repair_return_role",
                f"must be 'spare' or 'active', got {self.repair_return_role!r}",
            )
        if not 0 < self.preflight_burn_s <= 600:
            raise Invalid("preflight_burn_s", f"must be in (0, 600], got {self.preflight_burn_s}")
        if not 0 <= self.preflight_tolerance < 1:
            raise Invalid(
                "preflight_tolerance", f"must be in [0, 1), got {self.preflight_tolerance}"
            )
        if not (
            math.isfinite(self.spare_preflight_max_age_s) and self.spare_preflight_max_age_s >= 0
        ):
            raise Invalid("spare_preflight_max_age_s", "must be a finite number >= 0")
        if self.lemon_incidents < 0:
            raise Invalid("lemon_incidents", f"must be >= 0, got {self.lemon_incidents}")
        _positive("lemon_window_s", self.lemon_window_s)
        if "\0" in self.preflight_ckpt_dir:
            raise Invalid("preflight_ckpt_dir", "must not contain NUL bytes")


@dataclass(frozen=True)
class EconomicsConfig:
    """The checkpoint interval advice (docs/controller.md "Checkpoint interval"): the priors
    it starts from until the cluster has a history of its own."""

    # A node's MTBF before the cluster has history, s. 8000 h is Llama 3's hardware rate
    # (about 330 hardware interruptions in 54 days on 2048 nodes of 8 GPUs).
    node_mtbf_prior_s: float = 8000 * 3600.0
    # How many node incidents the prior weighs as: with fewer seen, the prior dominates.
    node_mtbf_prior_incidents: float = 3.0
    # The hardware incidents counted (and the node-time they are counted over), s.
    mtbf_window_s: float = 30 * 86400.0
    # A job's restart time until one of its restarts was measured, s (detect + restart).
    restart_prior_s: float = 600.0
    # `checkpoint.interval: auto` (controller.ckptauto): how often a running job's advice is
    # looked at, s (at most one change per look: the advice moves with hours of history, a
    # change every minute would only churn), and by how much the optimal interval must
    # differ from the one in force to be sent (a fraction: 0.1 = 10 %).
    auto_interval_check_s: float = 300.0
    auto_interval_change: float = 0.1

    def __post_init__(self) -> None:
        for key, value in (
            ("node_mtbf_prior_s", self.node_mtbf_prior_s),
            ("mtbf_window_s", self.mtbf_window_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise Invalid(key, f"must be a finite number > 0, got {value}")
        if not 0 < self.node_mtbf_prior_incidents <= 1000:
            raise Invalid(
                "node_mtbf_prior_incidents",
                f"must be in (0, 1000], got {self.node_mtbf_prior_incidents}",
            )
        if not (math.isfinite(self.restart_prior_s) and self.restart_prior_s >= 0):
            raise Invalid("restart_prior_s", "must be a finite number >= 0")
        if not (math.isfinite(self.auto_interval_check_s) and 1 <= self.auto_interval_check_s):
            raise Invalid("auto_interval_check_s", "must be a finite number >= 1")
        if not 0 <= self.auto_interval_change < 1:
            raise Invalid(
                "auto_interval_change", f"must be in [0, 1), got {self.auto_interval_change}"
            )


@dataclass(frozen=True)
class CostConfig:
    """What failures cost in money (docs/controller.md "Cost of failures")."""

    # Price of one GPU-hour, in the operator's currency; unset: GPU-hours only.
    gpu_hour: float | None = None

    def __post_init__(self) -> None:
        if self.gpu_hour is not None and not (
            math.isfinite(self.gpu_hour) and 0 < self.gpu_hour <= 1_000_000
        ):
            raise Invalid("gpu_hour", f"must be a number in (0, 1000000], got {self.gpu_hour}")


_DAY_S = 86400.0


@dataclass(frozen=True)
class RetentionConfig:
    """How long the store keeps each kind of row, in days; 0 keeps it forever. Older rows are
    deleted by the maintenance job (controller/maintenance.py), never what an open incident
    or an unfinished step still needs (docs/controller.md, "Retention")."""

    # Agent events (XIDs, NaN, exits, command results), days after the controller received
    # them. 14: two weeks covers looking back over a recurring fault; the incident timeline
    # keeps what a decision was based on. While a node has an unresolved incident, its events
    # age from the incident's opening, so its evidence stays.
    events_days: float = 14.0
    # Agent commands, days after their result came back (a command still waiting for its
    # result is never deleted). 14: as long as the events that carried the results.
    commands_days: float = 14.0
    # Resolved incidents with their timelines and actions, days after they resolved. 90: a
    # quarter of history for MTTR and recurring-node reviews. Unresolved incidents, and
    # incidents with a step not in a final state, are never deleted.
    incidents_days: float = 90.0
    # Finished steps of no incident (operator drains, job submissions and restarts), days
    # after their last change. 90: as long as the incidents they stand beside.
    operator_actions_days: float = 90.0
    # Audit log (who did what through the API), days. 180: the longest, because it answers
    # "who drained this node" in reviews and access audits long after the fact.
    audit_days: float = 180.0
    # Rows deleted per transaction. 5,000 small rows take a few ms, so the API and the tick
    # wait that long at most for the store while retention runs.
    batch_rows: int = 5000

    def __post_init__(self) -> None:
        for name in (
            "events_days",
            "commands_days",
            "incidents_days",
            "operator_actions_days",
            "audit_days",
        ):
            if getattr(self, name) < 0:
                raise Invalid(name, f"must be >= 0 (0 keeps forever), got {getattr(self, name)}")
        _within("batch_rows", self.batch_rows, 1, 100_000)

    def max_age_s(self, table: str) -> float | None:
        """Seconds rows of `table` (events, commands, incidents, operator_actions, audit) are
        kept; None: forever."""
        days = float(getattr(self, f"{table}_days"))
        return None if days == 0 else days * _DAY_S


@dataclass(frozen=True)
class MaintenanceConfig:
    """The store's maintenance jobs: retention with incremental vacuum, and WAL checkpoints."""

    # false: no job runs and the store grows without bound (a test or a short-lived demo).
    enabled: bool = True
    # Seconds between retention runs (each followed by an incremental vacuum). 3600: a
    # 2,048-node cluster adds a few thousand rows an hour, one or two batches' worth.
    retention_interval_s: float = 3600.0
    # Free pages given back to the filesystem per retention run (4 KiB each). 65536 = 256 MiB:
    # more than an hour of deletions frees, while bounding the I/O of one run.
    vacuum_max_pages: int = 65536
    # Seconds between WAL checkpoints that truncate the -wal file to 0 bytes. 300: SQLite's
    # own checkpoints keep the WAL near 4 MiB but never shrink it after a burst.
    checkpoint_interval_s: float = 300.0
    retention: RetentionConfig = field(default_factory=RetentionConfig)

    def __post_init__(self) -> None:
        _positive("retention_interval_s", self.retention_interval_s)
        _positive("checkpoint_interval_s", self.checkpoint_interval_s)
        if self.vacuum_max_pages < 0:
            raise Invalid("vacuum_max_pages", f"must be >= 0, got {self.vacuum_max_pages}")


@dataclass(frozen=True)
class HaConfig:
    """Two or more controllers on one PostgreSQL store, one leading (docs/controller.md,
    "High availability"). Off: one controller, nothing below applies."""

    # true: contend for the leader lease in the store; the leader acts, the others serve
    # reads and answer writes 503 naming the leader. Needs store.url (PostgreSQL).
    enabled: bool = False
    # This controller's API as agents and agentctl reach it (https://ctl-1.example:8800):
    # what a standby names in X-Trainguard-Leader when this one leads. Required when enabled.
    advertise_url: str = ""
    # How long a lease lasts without a renewal, seconds (on the database's clock). 10: a
    # leader that stops (kill -9, a lost machine) is replaced within about lease_s plus one
    # renew interval; shorter makes a slow database or a GC pause a failover.
    lease_s: float = 10.0
    # Seconds between renewals (and a standby's tries). Default lease_s / 3: two renewals can
    # fail before the lease runs out. Must be at most lease_s / 2.
    renew_interval_s: float | None = None

    def __post_init__(self) -> None:
        _within("lease_s", self.lease_s, 2.0, 300.0)
        if self.renew_interval_s is None:
            object.__setattr__(self, "renew_interval_s", self.lease_s / 3)
        elif not 0.1 <= self.renew_interval_s <= self.lease_s / 2:
            raise Invalid(
                "renew_interval_s",
                f"must be within 0.1..lease_s/2 ({self.lease_s / 2:g}), "
                f"got {self.renew_interval_s}",
            )
        if self.enabled:
            parts = urlsplit(self.advertise_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise Invalid(
                    "advertise_url",
                    "must be this controller's http(s)://HOST:PORT as agents reach it, got "
                    f"{self.advertise_url!r}",
                )

    @property
    def renew_every_s(self) -> float:
        """renew_interval_s with its default filled in."""
        return float(self.renew_interval_s or self.lease_s / 3)


@dataclass(frozen=True)
class RuleBudgetConfig:
    """What the rules may cost the tick: a cost model checked at load (controller/rules/
    cost.py, docs/rules.md "Cost") and each rule's evaluation time measured every tick
    (controller/rules/overrun.py)."""

    # The cluster a rule's cost is sized for (at most api.max_nodes): 2,048 nodes, the size
    # the tick's benchmark holds to 250 ms (BENCHMARKS.md), each an 8-GPU node with 18 NVLinks
    # per GPU (H100 SXM), 8 IB ports and 8 ranks (one per GPU). Set it to your cluster's size.
    nodes: int = 2048
    gpus_per_node: int = 8
    nvlinks_per_gpu: int = 18
    ib_ports_per_node: int = 8
    ranks_per_node: int = 8
    # Percent of a counter's series that hold history at once: a counter keeps points only
    # while it counts (errors, events). 1% of the NVLinks of 2,048 nodes erroring together is
    # already a fabric-wide incident.
    moving_counters_percent: float = 1.0
    # Most history points one rule may scan per tick at that size (docs/rules.md "Cost").
    # The costliest shipped rule scans about 0.55 M (NVLink error rates); 1.5 M admits it
    # with room and refuses a 15 min max_over_time over every GPU's temperature (3 M, about
    # 4 s a tick at 2,048 nodes).
    max_cost_per_rule: int = 1_500_000
    # Most for all rules together: the shipped set scans about 1.1 M.
    max_cost_total: int = 5_000_000
    # Seconds one rule's evaluation may take in one tick; past it the rule is cut for that
    # tick (its targets keep their state) and the tick counts an overrun.
    eval_budget_s: float = 0.5
    # Consecutive overrunning ticks that disable a rule (evaluation skipped until the next
    # reload, an incident opened). 3: one slow tick (a GC pause, a burst of reports) is not it.
    overrun_ticks: int = 3
    # Seconds all rules may take in one tick; the rules after it wait for the next tick. Well
    # under the watchdog's 10 s, so rule cost never gets the controller restarted.
    tick_budget_s: float = 3.0

    def __post_init__(self) -> None:
        _within("nodes", self.nodes, 1, 1_000_000)
        _within("moving_counters_percent", self.moving_counters_percent, 0, 100)
        for name in ("gpus_per_node", "nvlinks_per_gpu", "ib_ports_per_node", "ranks_per_node"):
            value = getattr(self, name)
            _within(name, value, 1, 1024)
        _positive("max_cost_per_rule", self.max_cost_per_rule)
        if self.max_cost_total < self.max_cost_per_rule:
            raise Invalid(
                "max_cost_total", f"must be >= max_cost_per_rule ({self.max_cost_per_rule})"
            )
        _positive("eval_budget_s", self.eval_budget_s)
        if self.overrun_ticks < 1:
            raise Invalid("overrun_ticks", f"must be >= 1, got {self.overrun_ticks}")
        if not self.eval_budget_s <= self.tick_budget_s <= 5.0:
            raise Invalid(
                "tick_budget_s",
                f"must be within eval_budget_s ({self.eval_budget_s})..5 s: the watchdog"
                " expects a tick within 10 s",
            )


@dataclass(frozen=True)
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(frozen=True)
class ControllerConfig:
    store: StoreConfig = field(default_factory=StoreConfig)
    maintenance: MaintenanceConfig = field(default_factory=MaintenanceConfig)
    # Rule files or directories (every *.yaml inside); default: the shipped rules.
    rules: list[str] = field(default_factory=default_rules_paths)
    # XID classification table (fatal / application / informational); empty = the shipped one.
    xid_catalog: str = ""
    api: ApiConfig = field(default_factory=ApiConfig)
    # Seconds between rule evaluations. 1 s matches the agents' report interval: a fault
    # is evaluated on the tick after it arrives, inside the 2 s detection target.
    tick_interval_s: float = 1.0
    # Data older than this, seconds, is stale: no rule acts on it (except the node-silent
    # rule). 10 s = several missed reports, not one slow one.
    stale_after_s: float = 10.0
    # A node with no report for this long, seconds, is shown as not reporting. 5 s is the
    # published detection target for a lost node.
    node_silent_after_s: float = 5.0
    # Seconds of signal history kept per node for rate()/increase(); covers 15 min windows.
    history_s: float = 900.0
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    # The checkpoint interval advice's priors (docs/controller.md "Checkpoint interval").
    economics: EconomicsConfig = field(default_factory=EconomicsConfig)
    # The price of a GPU-hour, for the cost of failures in money.
    cost: CostConfig = field(default_factory=CostConfig)
    # Where jobs run: torchrun launched by the agents (default) or Slurm (docs/slurm.md).
    backend: BackendConfig = field(default_factory=BackendConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # Leader election between controllers on one PostgreSQL store; off by default.
    ha: HaConfig = field(default_factory=HaConfig)
    # What rules may cost the tick, at load and at run time.
    rule_budget: RuleBudgetConfig = field(default_factory=RuleBudgetConfig)

    def __post_init__(self) -> None:
        _positive("tick_interval_s", self.tick_interval_s)
        if self.ha.enabled and self.store.url is None:
            raise Invalid(
                "ha.enabled",
                "needs store.url (PostgreSQL): the controllers share the store and its lease",
            )
        _positive("node_silent_after_s", self.node_silent_after_s)
        _positive("history_s", self.history_s)
        if self.jobs.resume_grace_s < self.node_silent_after_s:
            raise Invalid(
                "jobs.resume_grace_s",
                f"must be >= node_silent_after_s ({self.node_silent_after_s}): a node is not"
                " silent before that",
            )
        if self.jobs.attempt_lease_s <= self.node_silent_after_s:
            raise Invalid(
                "jobs.attempt_lease_s",
                f"must exceed node_silent_after_s ({self.node_silent_after_s}): the lease runs"
                " past the point a node is first seen silent",
            )
        if self.stale_after_s <= self.tick_interval_s:
            raise Invalid("stale_after_s", f"must exceed tick_interval_s ({self.tick_interval_s})")
        if not self.rules:
            raise Invalid("rules", "must name at least one rule file or directory")


def load_config(path: str | None, *, overrides: dict[str, Any] | None = None) -> ControllerConfig:
    """Load the controller config (then dotted-key `overrides` from flags); raises ConfigError.

    `path=None` uses DEFAULT_CONFIG_PATH if it exists, else the defaults plus overrides.
    """
    overrides = overrides or {}
    if path is None:
        if Path(DEFAULT_CONFIG_PATH).exists():
            return load_file(ControllerConfig, DEFAULT_CONFIG_PATH, overrides=overrides)
        source = "(flags)"
        data = apply_overrides({}, overrides, source=source)
        return build(ControllerConfig, data, source=source)
    return load_file(ControllerConfig, path, overrides=overrides)


__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_STORE_PATH",
    "HaConfig",
    "LifecycleConfig",
    "SEVERITY_RANK",
    "ALERT_LABELS_OF_TRAINGUARD",
    "AlertmanagerChannelConfig",
    "ActionsConfig",
    "ApiConfig",
    "BackendConfig",
    "CREDENTIALS_VAR",
    "ConfigError",
    "ConnectionsConfig",
    "ControllerConfig",
    "CostConfig",
    "EconomicsConfig",
    "JobsConfig",
    "LogConfig",
    "MaintenanceConfig",
    "NotifyConfig",
    "PagerDutyConfig",
    "RetentionConfig",
    "RuleBudgetConfig",
    "SafetyConfig",
    "Secret",
    "SlackConfig",
    "SlurmBackendConfig",
    "StoreConfig",
    "WebhookConfig",
    "default_rules_paths",
    "expand_credentials",
    "load_config",
]

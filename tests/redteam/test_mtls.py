"""Client certificates as node credentials (mutual TLS), against a real controller process
served over HTTPS (in-process and by ingest workers), with a CA, a server certificate for
127.0.0.1 and node certificates made here; and agentctl trusting the self-signed controller
certificate with --ca-file."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.helpers import wait_for
from tests.integration.agent_proc import AgentProcess
from tests.integration.controller_proc import (
    OP,
    OP_TOKEN,
    ControllerProcess,
    dbe_rules,
    write_config,
)
from trainguard.protocol import Report, encode_json

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


class CA:
    """A certificate authority made for one test."""

    def __init__(self, directory: Path, name: str) -> None:
        self.dir = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            self._builder(subject, self.key.public_key(), issuer=subject)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = directory / f"{name}.pem"
        self.pem.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    @staticmethod
    def _builder(subject: x509.Name, public_key: Any, *, issuer: x509.Name) -> Any:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def issue(
        self, filename: str, *, cn: str | None, dns: tuple[str, ...] = (), ip: str | None = None
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "trainguard-test")]
        if cn is not None:
            attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        if ip is not None:
            sans.append(x509.IPAddress(ipaddress.ip_address(ip)))
        builder = self._builder(x509.Name(attrs), key.public_key(), issuer=self.cert.subject)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        out = Issued(self.dir / f"{filename}.pem", self.dir / f"{filename}.key")
        out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        os.chmod(out.key, 0o600)
        return out


@dataclass
class Tls:
    controller: ControllerProcess
    url: str
    ca: CA
    dir: Path

    def client(
        self, cert: Issued | None = None, *, headers: dict[str, str] | None = None
    ) -> httpx.Client:
        ctx = ssl.create_default_context(cafile=str(self.ca.pem))
        if cert is not None:
            ctx.load_cert_chain(str(cert.cert), str(cert.key))
        return httpx.Client(base_url=self.url, verify=ctx, headers=headers or {}, timeout=10)

    def nodes(self) -> list[str]:
        with self.client(headers=OP) as c:
            r = c.get("/v1/nodes")
            assert r.status_code == 200, r.text
            return sorted(n["name"] for n in r.json())


def _report(node: str) -> bytes:
    return encode_json(Report(node=node, instance="i1", seq=1, sent_at=time.time()))


@pytest.fixture(params=[0, 2], ids=["in-process", "ingest-workers"])
def tls(
    request: pytest.FixtureRequest, tmp_path: Path, controllers: list[ControllerProcess]
) -> Iterator[Tls]:
    ca = CA(tmp_path, "test-ca")
    server = ca.issue("server", cn="controller", ip="127.0.0.1")
    cfg = write_config(tmp_path, rules=dbe_rules(), agent_tokens={"node-3": "tok-node-3"})
    # the api section is one flow mapping: the TLS keys go into it
    tls_keys = (
        f"tls_cert_file: {server.cert}, tls_key_file: {server.key}, tls_client_ca_file: {ca.pem}, "
    )
    cfg.write_text(cfg.read_text().replace("api: {", "api: {" + tls_keys, 1))
    proc = ControllerProcess(
        cfg, log_path=tmp_path / "controller.log", args=["--ingest-workers", str(request.param)]
    )
    controllers.append(proc)
    proc.wait_listening(timeout_s=60)
    assert proc.url.startswith("https://"), proc.log()
    t = Tls(proc, proc.url, ca, tmp_path)
    yield t
    assert proc.popen.poll() is None, proc.log()
    with t.client() as c:
        assert c.get("/healthz").status_code == 200
        assert "trainguard_controller_reports_total" in c.get("/metrics").text


def test_node_certificate_reports_for_its_node_without_a_token(tls: Tls) -> None:
    node1 = tls.ca.issue("node-1", cn="node-1")
    with tls.client(node1) as c:
        r = c.post("/v1/reports", content=_report("node-1"))
    assert r.status_code == 200, r.text
    assert tls.nodes() == ["node-1"]


def test_node_certificate_posting_for_another_node_is_403_and_stores_nothing(tls: Tls) -> None:
    node1 = tls.ca.issue("node-1", cn="node-1")
    with tls.client(node1) as c:
        r = c.post("/v1/reports", content=_report("node-2"))
    assert r.status_code == 403, r.text
    assert r.json()["detail"] == {
        "credential": "cert:node-1",
        "bound_node": "node-1",
        "node": "node-2",
    }
    assert tls.nodes() == []
    with tls.client(headers=OP) as c:
        audit = c.get("/v1/audit").json()
    assert [(a["actor"], a["action"], a["target"]) for a in audit] == [
        ("cert:node-1", "report_refused", "node-2")
    ]


def test_certificate_named_by_its_only_dns_san(tls: Tls) -> None:
    node4 = tls.ca.issue("node-4", cn=None, dns=("node-4",))
    with tls.client(node4) as c:
        assert c.post("/v1/reports", content=_report("node-4")).status_code == 200
        assert c.post("/v1/reports", content=_report("node-5")).status_code == 403


def test_certificate_from_another_ca_is_refused_at_the_handshake(tls: Tls) -> None:
    rogue = CA(tls.dir, "rogue-ca").issue("rogue-node-1", cn="node-1")
    with tls.client(rogue) as c, pytest.raises(httpx.HTTPError):
        c.post("/v1/reports", content=_report("node-1"))
    assert tls.nodes() == []


def test_no_certificate_and_no_token_is_401_and_tokens_still_work(tls: Tls) -> None:
    with tls.client() as c:
        assert c.post("/v1/reports", content=_report("node-3")).status_code == 401
    with tls.client(headers={"Authorization": "Bearer tok-node-3"}) as c:
        assert c.post("/v1/reports", content=_report("node-3")).status_code == 200
        assert c.post("/v1/reports", content=_report("node-1")).status_code == 403
    assert tls.nodes() == ["node-3"]


def test_a_node_certificate_is_no_operator(tls: Tls) -> None:
    node1 = tls.ca.issue("node-1", cn="node-1")
    with tls.client(node1) as c:
        assert c.get("/v1/nodes").status_code == 401
        assert c.post("/v1/nodes/node-1/drain").status_code == 401


def test_agentctl_trusts_the_self_signed_controller_with_ca_file(tls: Tls) -> None:
    token_file = tls.dir / "op.token"
    token_file.write_text(OP_TOKEN + "\n")
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    env["XDG_CONFIG_HOME"] = str(tls.dir / "xdg")
    base = [str(BIN / "agentctl"), "--url", tls.url, "--token-file", str(token_file)]

    def run(
        *args: str, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, **(extra_env or {})},
            check=False,
        )

    untrusted = run("get", "nodes", "-o", "json")
    assert untrusted.returncode == 5, untrusted.stderr  # cannot connect: certificate unknown
    by_flag = run("--ca-file", str(tls.ca.pem), "get", "nodes", "-o", "json")
    assert by_flag.returncode == 0, by_flag.stderr
    assert by_flag.stdout.strip() == "[]"
    by_env = run("get", "nodes", "-o", "json", extra_env={"TRAINGUARD_CA_FILE": str(tls.ca.pem)})
    assert by_env.returncode == 0, by_env.stderr
    config = tls.dir / "agentctl.yaml"
    config.write_text(f"ca_file: {tls.ca.pem.name}\n")  # relative to the config file
    by_config = run("--config", str(config), "get", "nodes", "-o", "json")
    assert by_config.returncode == 0, by_config.stderr


def test_a_real_agent_reports_with_its_node_certificate_and_no_token(
    tls: Tls, short_tmp: Path
) -> None:
    node1 = tls.ca.issue("agent-node-1", cn="node-1")
    cfg = short_tmp / "agent.yaml"
    cfg.write_text(
        "controller:\n"
        f"  url: {tls.url}\n"
        f"  ca_file: {tls.ca.pem}\n"
        f"  tls_cert_file: {node1.cert}\n"
        f"  tls_key_file: {node1.key}\n"
    )
    agent = AgentProcess(short_tmp, "--config", str(cfg), "--kmsg-path", "")
    try:
        wait_for(lambda: tls.nodes() == ["node-1"], timeout_s=30, what="node-1 to report")
        assert "report_failed" not in agent.log()
    finally:
        assert agent.terminate() == 0, agent.log()


def test_an_agent_certificate_for_another_node_is_refused(tls: Tls, short_tmp: Path) -> None:
    other = tls.ca.issue("agent-node-9", cn="node-9")
    cfg = short_tmp / "agent.yaml"
    cfg.write_text(
        "controller:\n"
        f"  url: {tls.url}\n"
        f"  ca_file: {tls.ca.pem}\n"
        f"  tls_cert_file: {other.cert}\n"
        f"  tls_key_file: {other.key}\n"
    )
    agent = AgentProcess(short_tmp, "--config", str(cfg), "--kmsg-path", "")  # node-1
    try:
        wait_for(lambda: "403" in agent.log(), timeout_s=30, what="the controller's 403")
        assert tls.nodes() == []
    finally:
        agent.terminate()

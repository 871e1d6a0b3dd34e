"""agentctl: the operator's command line. It talks only to the controller's REST API.
(The modules: app the entry and its table of commands, parser the command tree, settings,
client, session, format and jsonpath (`-o`), values (flag types), wait (`--wait`), errors;
reads (get, describe, --watch), nodes, silences, jobs, rules, tokens: the commands.)

URL, token and CA file come from flags (`--url`, `--token-file`, `--ca-file`), then the
environment (`TRAINGUARD_URL`, `TRAINGUARD_TOKEN`, `TRAINGUARD_CA_FILE`), then
`~/.config/trainguard/agentctl.yaml` (`url` or `urls`, `token_file`, `ca_file`; strict). `rules
check|export`, `token hash|issue` and `completion` work offline; rules default to the
shipped ones. Reads print as `-o table|wide|json|yaml|name|jsonpath=...` (`--no-headers`).
Several controllers (an HA leader and standbys): the URL may be a comma-separated list; a
request goes to the first that answers, and a standby's 503 naming the leader is retried
once at the leader when it is one of the listed URLs (trainguard.leader).
Exit codes: 0 ok, 1 error or request failed, 2 usage, 3 not found, 4 unauthorized or
forbidden, 5 cannot connect, 130 interrupted (Ctrl-C).
"""

from trainguard.controller.cli.app import main

__all__ = ["main"]

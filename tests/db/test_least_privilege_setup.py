"""operations.md, Several hosts: the gateway may run as a role that only reads and writes the tables, their owner
applying the migrations with the `portico` commands the page names. Followed as written, with the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.postgres_support import PASSWORD_ENV

MODELS = "models: [{id: a, endpoint: /v1/chat/completions, provider: {kind: llamacpp}}]\n"


def _portico(config: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", "--config", str(config), *command],
                          capture_output=True, text=True, timeout=60)


def _config(path: Path, url: str) -> Path:
    path.write_text(f"keys: {{store: '{url}', password_env: {PASSWORD_ENV}}}\n{MODELS}")
    return path


def test_the_owner_prepares_the_database_for_a_role_that_only_reads_and_writes(postgres_server, tmp_path):
    """The page said `portico keys list` under the owner's URL applies the migrations: it applies the keys' only,
    and the role's `portico serve` (and `usage`) then stopped: "the database's usage schema could not be brought to
    this Portico's ... permission denied for schema public". `portico usage` applies the usage ledger's; the page
    now names both commands."""
    url = postgres_server.new_database()
    database = url.rsplit("/", 1)[1]
    owner = _config(tmp_path / "owner.yaml", url)
    role = _config(tmp_path / "role.yaml", url.replace("postgres@", f"{database}_rw@"))
    with postgres_server.connect(database) as conn:
        conn.execute(f"CREATE ROLE {database}_rw LOGIN PASSWORD '{postgres_server.password}'")
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")

    def grant() -> None:
        with postgres_server.connect(database) as conn:
            conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {database}_rw")

    assert _portico(owner, "keys", "list").returncode == 0
    grant()
    refused = _portico(role, "usage")
    assert refused.returncode == 1
    assert "the database's usage schema could not be brought to this Portico's" in refused.stderr
    assert _portico(owner, "usage").returncode == 0  # the second of the two commands the page names
    grant()
    for command in (("keys", "create", "--name", "n", "--all-models"), ("keys", "list"), ("usage",)):
        done = _portico(role, *command)
        assert done.returncode == 0, (command, done.stderr)

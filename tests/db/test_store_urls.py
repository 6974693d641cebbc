"""keys.store takes the PostgreSQL URLs libpq takes for a control plane shared by several hosts: a list of hosts (a
primary and its standbys, `target_session_attrs=read-write` to follow a failover) and a Unix-socket directory given as
`?host=`. Each was refused at start-up as "not a URL" or as missing a host, though libpq connects with it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.envoy import free_ports
from server.config import ConfigError, load_config
from server.keys import hash_secret, open_key_store
from tests.postgres_support import PASSWORD_ENV, USER

ONE_MODEL = "models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}]"


async def _store_answers(tmp_path, url: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\nkeys: {{store: '{url}', password_env: {PASSWORD_ENV}}}\n")
    store = await open_key_store(load_config(path).key_database)
    try:
        key, secret = await store.create("shared", all_models=True)
        assert (await store.find_active(hash_secret(secret))).id == key.id
    finally:
        await store.close()


async def test_a_list_of_hosts_reaches_the_one_that_answers(tmp_path, postgres_server, postgres_url):
    """libpq tries the hosts in order: the first, a port nobody listens on (a primary that failed), is passed over."""
    database = postgres_url.rsplit("/", 1)[1]
    (dead,) = free_ports(1)
    await _store_answers(tmp_path, f"postgresql://{USER}@127.0.0.1:{dead},127.0.0.1:{postgres_server.port}/{database}"
                                   "?target_session_attrs=read-write")


async def test_a_unix_socket_directory_given_as_host(tmp_path, postgres_server, postgres_url):
    database = postgres_url.rsplit("/", 1)[1]
    await _store_answers(tmp_path, f"postgresql://{USER}@/{database}?host={postgres_server.directory}"
                                   f"&port={postgres_server.port}")


@pytest.mark.parametrize("url, message", [
    ("postgresql://portico:s3cret-pw@db1:5432,db2:5432/portico", r"no password in the URL"),
    ("postgresql://portico@db1:5432,db2:5432/", r"needs a host and a database name"),
    ("postgresql://portico@db1:5432,db2:abc/portico", r"keys\.store: "),
    ("postgresql://portico@/portico", r"needs a host and a database name"),
    ("postgresql://portico@db/portico?sslmod=require", r"keys\.store: not a URL libpq can read .*query parameter"),
])
def test_a_list_of_hosts_is_checked_as_one_host_is(tmp_path, url, message):
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\nkeys: {{store: '{url}'}}\n")
    with pytest.raises(ConfigError, match=message) as e:
        load_config(path)
    assert "s3cret-pw" not in str(e.value)


@pytest.mark.parametrize("query, words", [
    ("sslmode=bogus", 'invalid sslmode value: "bogus"'),
    ("target_session_attrs=primary-only", 'invalid target_session_attrs value: "primary-only"'),
    ("channel_binding=always", 'invalid channel_binding value: "always"'),
    ("require_auth=kerberos", 'invalid require_auth value: "kerberos"'),
    ("ssl_min_protocol_version=TLSv1.3&ssl_max_protocol_version=TLSv1.2", "invalid SSL protocol version range"),
    ("sslrootcert=system&sslmode=require", 'weak sslmode "require" may not be used with sslrootcert=system'),
    ("service=no-such-service", 'definition of service "no-such-service" not found'),
    ("hostaddr=db.internal", "hostaddr: db.internal is no IP address"),
    ("port=5432,5433", "could not match 2 port numbers to 1 hosts"),
    ("tcp_user_timeout=soon", "tcp_user_timeout: soon is no whole number"),
])
@pytest.mark.parametrize("command", [("serve",), ("keys", "list")])
def test_a_parameter_libpq_refuses_is_a_configuration_error(tmp_path, query, words, command):
    """libpq checks a URL's parameters' values only as it connects: `serve` started with the store reported as
    unreachable (`connection is bad: invalid sslmode value`) and stayed not ready for ever, and `portico keys`
    said the store cannot be reached (exit 1), for a mistake in the file that no outage's end would mend."""
    config = tmp_path / "c.yaml"
    config.write_text(f"{ONE_MODEL}\naccess_log: 'off'\nkeys: {{store: 'postgresql://{USER}@db.internal:5432/portico"
                      f"?{query}', password_env: PG_PW}}\n")
    port, admin_port = free_ports(2)
    if command == ("serve",):
        command += ("--port", str(port), "--admin-port", str(admin_port), "--metrics-port", "0")
    done = subprocess.run([sys.executable, "-m", "server.cli", "--config", str(config), "--data-dir",
                           str(tmp_path / "data"), *command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PG_PW": "not-shown", "TMPDIR": str(tmp_path)})
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("portico: configuration error: ") and done.stderr.count("\n") == 1
    assert f"{config}: keys.store: " in done.stderr
    assert words in done.stderr and "not-shown" not in done.stderr


def test_parameters_libpq_takes_are_still_taken(tmp_path):
    url = (f"postgresql://{USER}@db1:5432,db2:5432/portico?hostaddr=10.0.0.1,::1&sslmode=verify-full"
           "&target_session_attrs=read-write&require_auth=!password&tcp_user_timeout=1000&sslrootcert=system")
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\nkeys: {{store: '{url}'}}\n")
    assert load_config(path).key_store.url == url


def test_a_host_without_its_own_port_in_a_list_takes_the_default_port(tmp_path):
    """`db1:5432,db2` (the standby on PostgreSQL's default port): libpq connects with it, reading the empty port as
    5432, but it was refused at start-up as 'a port that is no port number'."""
    url = f"postgresql://{USER}@db1:6432,db2/portico?target_session_attrs=read-write"
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\nkeys: {{store: '{url}'}}\n")
    assert load_config(path).key_store.url == url

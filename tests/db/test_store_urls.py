"""keys.store takes the PostgreSQL URLs libpq takes for a control plane shared by several hosts: a list of hosts (a
primary and its standbys, `target_session_attrs=read-write` to follow a failover) and a Unix-socket directory given as
`?host=`. Each was refused at start-up as "not a URL" or as missing a host, though libpq connects with it."""

from __future__ import annotations

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

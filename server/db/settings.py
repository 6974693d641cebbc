"""Where the control-plane database is: `keys.store` (with the settings that go with it).

    keys:
      store: sqlite                                   # default: <data_dir>/keys.db
      store: postgresql://portico@db.internal:5432/portico
      password_env: PORTICO_DB_PASSWORD               # the variable holding the PostgreSQL password
      store_timeout_seconds: 2.0                      # connect and query timeout
      pool_size: 4                                    # PostgreSQL connections per server process

The password is never part of the configuration (a URL carrying one is refused): only the name of the variable that
holds it, read when a connection is opened. A URL is shown in messages only without its password.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config_providers import ConfigError, is_env_name, number
from server.limits.settings import QUERY_SECRETS, redacted

SQLITE = "sqlite"
POSTGRES_SCHEMES = ("postgresql://", "postgres://")
STORE_SETTING_NAMES = ("store", "password_env", "store_timeout_seconds", "pool_size")
# A libpq keyword/value string's password (`password=s3cret`, `sslpassword = 'a b'`): such a string is refused
# (a URL is asked for), and the line saying so must not quote it.
_KEYWORD_SECRET = re.compile(r"(\b(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|\S*)", re.IGNORECASE)
_HIDDEN = r"\1***"
# libpq reads these as integers only as it connects to a host: a word there stopped every connection.
_INTEGER_PARAMETERS = ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count",
                       "tcp_user_timeout")
_NO_SOCKET_DIR = "/nonexistent/portico-conninfo-check"  # the probe's hosts: refused at once, without the network


@dataclass(frozen=True, slots=True)
class StoreSettings:
    sqlite_path: Path | None = None  # SQLite: the file
    url: str = ""  # set for PostgreSQL: postgresql://user@host:port/db, no password
    password_env: str = ""  # PostgreSQL: the environment variable holding the password ("" = none needed)
    timeout_seconds: float = 2.0  # PostgreSQL: connect timeout, and the longest a query may take
    pool_size: int = 4  # PostgreSQL: connections per process
    # A worker restarted after a crash (serve --workers N): a schema newer than this code, which another host migrated
    # while this one ran, is used as the worker's siblings go on using it, not refused as at a start.
    newer_schema_ok: bool = False
    # SQLite, for a command that only reads (`keys list`, `usage`) where keys.db or its directory may not be written
    # (a read-only volume): opened read-only, its schema checked, not migrated.
    read_only: bool = False

    @property
    def is_postgres(self) -> bool:
        return bool(self.url)

    @property
    def described(self) -> str:
        """For logs and messages: the URL or the file (neither holds a secret)."""
        return self.url if self.url else str(self.sqlite_path)

    def password(self) -> str | None:
        """The PostgreSQL password from its environment variable; refused when the variable is named but unset."""
        if not self.password_env:
            return None
        value = os.environ.get(self.password_env)
        if value is None:
            raise ConfigError(f"keys.password_env: the environment variable {self.password_env} is not set "
                              f"(it holds the password for {self.url})")
        return value


def _conninfo(url: str) -> dict[str, str] | None:
    """The URL as libpq reads it (its parameters by name), or None for one it cannot read, or whose port is no port.
    libpq's reading, not urlsplit's: a list of hosts (`db1:5432,db2:5432`, a primary and its standbys, which
    `target_session_attrs=read-write` follows through a failover) and a socket directory in `?host=` are URLs libpq
    connects with, and urlsplit took neither. psycopg is imported here only once PostgreSQL is configured."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    if any(char.isspace() or not char.isprintable() for char in url):
        return None
    try:
        parts = {name: str(value) for name, value in conninfo_to_dict(url).items()}
    except ProgrammingError:
        return None
    ports = parts.get("port", "").split(",") if parts.get("port") else []
    # An empty one in a list (`db1:6432,db2`) is libpq's default port, as an absent one is.
    if not all(port == "" or (port.isdigit() and 0 < int(port) < 65536) for port in ports):
        return None
    return parts


def _refused(parts: dict[str, str]) -> str:
    """Why libpq refuses the parameters' values ("" when it takes them). libpq checks them only when it connects, so
    a bad `sslmode` looked like an outage that never ended: it is asked here, with every host replaced by a socket in
    a directory that does not exist, so no packet leaves and no name is looked up. Its failure to reach that socket
    names the directory; any other failure is about the parameters. hostaddr, which would be connected to, and the
    integers, read per TCP connection, are checked here."""
    from psycopg import pq
    from psycopg.conninfo import make_conninfo

    hosts = parts.get("host", "").split(",")
    addresses = parts["hostaddr"].split(",") if parts.get("hostaddr") else []
    if addresses and len(addresses) != len(hosts):
        return f"hostaddr: {len(addresses)} addresses for {len(hosts)} hosts"
    for address in filter(None, addresses):
        try:
            ipaddress.ip_address(address)
        except ValueError:
            return f"hostaddr: {address} is no IP address"
    for name in _INTEGER_PARAMETERS:
        if name in parts and not re.fullmatch(r"\s*[-+]?\d+\s*", parts[name]):
            return f"{name}: {parts[name]} is no whole number"
    probe = {name: value for name, value in parts.items() if name != "hostaddr"}
    probe["host"] = ",".join([_NO_SOCKET_DIR] * len(hosts))
    if probe.get("gssencmode") == "require":  # refused on a local socket, taken over TCP
        probe["gssencmode"] = "prefer"
    conn = pq.PGconn.connect_start(make_conninfo(**probe).encode())
    try:
        words = " ".join(conn.error_message.decode(errors="replace").split())
        return "" if conn.status == pq.ConnStatus.OK or _NO_SOCKET_DIR in words else words
    finally:
        conn.finish()


def parse_store(keys: dict[str, Any], where: str) -> StoreSettings:
    """The store settings from the `keys:` mapping (other settings of that mapping are left to the caller). SQLite's
    file is left unset: it is `<data_dir>/keys.db`, and the command line may change data_dir (Config.key_database)."""
    store = str(keys.get("store", SQLITE))
    password_env = keys.get("password_env")
    # '' is no name either, as for api_key_env, not "no password": the store would refuse every login.
    if password_env is not None and (not isinstance(password_env, str) or not is_env_name(password_env)):
        # A string is not quoted: it may be the password itself, pasted where its variable's name goes.
        shown = "(the password itself never goes in the file)" if password_env and isinstance(password_env, str) \
            else repr(password_env)
        raise ConfigError(f"{where}.password_env: the name of an environment variable, not {shown}")
    # PostgreSQL takes statement_timeout in 32-bit milliseconds (24.8 days): past it every connection was refused.
    timeout = float(number(keys, "store_timeout_seconds", 2.0, where, positive=True, high=86_400))
    pool_size = number(keys, "pool_size", 4, where, integer=True, low=1)
    if store == SQLITE:
        # Settings nothing would honour are refused, not ignored: SQLite has no password, pool or query timeout.
        for name in ("password_env", "store_timeout_seconds", "pool_size"):
            if keys.get(name) is not None:
                raise ConfigError(f"{where}.{name}: only for a postgresql:// store")
        return StoreSettings(timeout_seconds=timeout, pool_size=pool_size)
    if not store.startswith(POSTGRES_SCHEMES):
        raise ConfigError(f"{where}.store: `sqlite` or a postgresql://user@host:port/database URL, not "
                          f"{_KEYWORD_SECRET.sub(_HIDDEN, redacted(store))!r}")
    parts = _conninfo(store)
    if parts is None:  # not quoted: libpq's own words quote the URL, password and all
        raise ConfigError(f"{where}.store: not a URL libpq can read (a space, a query parameter libpq does not know, "
                          "a port that is no port number, or a bracketed host that is no IPv6 address)")
    if QUERY_SECRETS & set(parts):
        raise ConfigError(f"{where}.store: no password in the URL ({redacted(store)}); name the "
                          "environment variable that holds it in keys.password_env")
    if not all(parts.get("host", "").split(",")) or not parts.get("dbname"):
        raise ConfigError(f"{where}.store: {store!r} needs a host and a database name "
                          "(postgresql://user@host:port/database)")
    if words := _refused(parts):
        raise ConfigError(f"{where}.store: libpq refuses its parameters ({words})")
    return StoreSettings(url=store, password_env=password_env or "", timeout_seconds=timeout, pool_size=pool_size)

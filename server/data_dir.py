"""What Portico keeps in its data dir, named once: read by what makes each file and by the check that all of them
are private to the service's user (server/private_files.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# SQLite's own files beside a database: what a crashed writer or an open connection leaves there.
_SQLITE_SIBLINGS = ("-wal", "-shm", "-journal")


@dataclass(frozen=True)
class DataDir:
    root: Path

    @property
    def keys_db(self) -> Path:
        """The SQLite key store, and the usage ledger beside the keys."""
        return self.root / "keys.db"

    @property
    def images(self) -> Path:
        """Generated images, served by signed links until they expire."""
        return self.root / "images"

    @property
    def image_link_key(self) -> Path:
        """The secret that signs image links."""
        return self.root / "image-link.key"

    @property
    def limits_daily(self) -> Path:
        """The in-process limit store's daily quotas, kept across restarts."""
        return self.root / "limits-daily.json"

    @property
    def envoy_log(self) -> Path:
        """Envoy's own stdout and stderr."""
        return self.root / "envoy.log"

    @property
    def envoy_access_log(self) -> Path:
        """Envoy's lines for replies the server never saw, when the access log goes to stderr or stdout."""
        return self.root / "envoy-access.log"

    @property
    def ledger_spool(self) -> Path:
        """Usage-ledger rows the store could not take yet."""
        return self.root / "ledger-spool"

    @property
    def directories(self) -> tuple[Path, ...]:
        return self.images, self.ledger_spool

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file of Portico's at the top of the data dir (the directories' files are theirs to list)."""
        sqlite = tuple(self.keys_db.with_name(self.keys_db.name + suffix) for suffix in _SQLITE_SIBLINGS)
        return (self.keys_db, *sqlite, self.image_link_key, self.limits_daily, self.envoy_log, self.envoy_access_log)

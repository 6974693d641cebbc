"""Start-up takes others' access away from Portico's own files in the data dir, and from nothing else."""

import os
import stat

from server.private_files import make_private


def _mode(path):
    return stat.S_IMODE(path.lstat().st_mode)


def test_portico_files_left_readable_are_made_private_and_nothing_else_is_touched(tmp_path):
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "ledger-spool").mkdir()
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not portico's")
    ours = [data / "keys.db", data / "keys.db-wal", data / "image-link.key", data / "limits-daily.json",
            data / "envoy.log", data / "images" / "a.png", data / "ledger-spool" / "1.rows"]
    for path in ours:
        path.write_text("x")
    operators = data / "README.txt"
    operators.write_text("the gateway's data")
    (data / "images" / "link.png").symlink_to(outside)
    for path in (data, data / "images", data / "ledger-spool"):
        path.chmod(0o755)
    for path in (*ours, operators, outside):
        path.chmod(0o644)
    umask = os.umask(0o022)
    try:
        make_private(data)
    finally:
        os.umask(umask)
    assert _mode(data) == _mode(data / "images") == _mode(data / "ledger-spool") == 0o700
    assert {path.name: _mode(path) for path in ours} == {path.name: 0o600 for path in ours}
    # An operator's file, and a file a link points to, are theirs: the 0700 data dir keeps others out of the first.
    assert _mode(operators) == 0o644
    assert _mode(outside) == 0o644

"""The access log's file when it cannot be written (a full disk): the requests go on, and the operator is told."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import orjson

from server.observability.access_log import AccessLog
from server.observability.record import Outcome, RequestRecord


def record() -> RequestRecord:
    return RequestRecord("r-1", "ChatService/CreateChatCompletionHttp", "/v1/chat/completions")


def test_lines_lost_to_a_full_disk_are_logged_once_and_writing_again_too(tmp_path, caplog):
    """On a full disk the lines were dropped without a word: the operator found gaps in the access log later."""
    log = AccessLog("/dev/full")  # every write fails with ENOSPC, as on a full disk
    with caplog.at_level(logging.WARNING, logger="server.observability.access_log"):
        for _ in range(3):
            log.write(record(), Outcome(200), 0.0)
        assert [r.levelname for r in caplog.records] == ["ERROR"]
        assert "/dev/full" in caplog.text and "No space left on device" in caplog.text
        log.close()
        log._fd = os.open(tmp_path / "access.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # the disk has room again
        log.write(record(), Outcome(200), 0.0)
        log.write(record(), Outcome(200), 0.0)
    assert [r.levelname for r in caplog.records] == ["ERROR", "WARNING"]
    assert "3 line(s) lost" in caplog.records[1].getMessage()
    assert (tmp_path / "access.log").read_bytes().count(b"\n") == 2
    log.close()


_TORN = """
import os, resource, signal, sys
from server.observability.access_log import AccessLog
from server.observability.record import Outcome, RequestRecord

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails (EFBIG), as on a full disk
log = AccessLog(sys.argv[1])
record = RequestRecord("r-1", "ChatService/CreateChatCompletionHttp", "/v1/chat/completions")
log.write(record, Outcome(200), 0.0)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(sys.argv[1]) + 100, resource.RLIM_INFINITY))
log.write(record, Outcome(200), 0.0)  # 100 bytes of it fit: a short write
log.write(record, Outcome(200), 0.0)  # none
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # room again
log.write(record, Outcome(200), 0.0)
"""


def test_a_line_cut_short_by_a_full_disk_does_not_swallow_the_next_one(tmp_path):
    """A disk that fills up mid-line took part of a line (a short write); the next line, once there was room again,
    was glued to that fragment, so a log shipper lost it too (one line of invalid JSON)."""
    path = tmp_path / "access.log"
    subprocess.run([sys.executable, "-c", _TORN, str(path)], check=True, capture_output=True,
                   cwd=Path(__file__).parents[2])
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # every line ends
    parsed = [line for line in lines if line.startswith(b"{") and line.endswith(b"}")]
    assert len(parsed) == 2 and all(orjson.loads(line)["request_id"] == "r-1" for line in parsed)

"""The access log's file when it cannot be written (a full disk): the requests go on, and the operator is told."""

from __future__ import annotations

import logging
import os

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

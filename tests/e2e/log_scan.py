"""The secret scan behind the e2e suite's `no_key_in_any_log` check: every `*.log` file under a directory, line by
line, for anything shaped like a Portico key (`pk-...`, which covers every key the suite creates and the made-up
ones it sends, such as `pk-wrong`) or a bearer credential."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_SECRET = re.compile(r"pk-[A-Za-z0-9_-]{3,}|Bearer\s+\S+", re.IGNORECASE)


@dataclass
class ScanReport:
    files: int = 0
    lines: int = 0
    envoy_logs: int = 0
    leaks: list[str] = field(default_factory=list)  # "file:line: what", the secret itself cut short


def scan_logs(root: Path) -> ScanReport:
    report = ScanReport()
    for path in sorted(root.rglob("*.log")):
        report.files += 1
        report.envoy_logs += path.name == "envoy.log"
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            report.lines += 1
            if match := _SECRET.search(line):
                report.leaks.append(f"{path}:{number}: {match.group()[:10]}...")
    return report

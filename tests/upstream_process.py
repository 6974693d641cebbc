"""The upstream double in a process of its own, so a test can kill it (SIGKILL) like a crashed upstream server.

    python -m tests.upstream_process FRAME_DELAY     prints its port, then serves until killed
"""

from __future__ import annotations

import sys
import time

from tests.upstream_double import Cue, UpstreamDouble

if __name__ == "__main__":
    double = UpstreamDouble()
    double.default_cue = Cue(frame_delay=float(sys.argv[1]))  # every answer takes a while: requests stay in flight
    double.start()
    print(double.port, flush=True)
    while True:
        time.sleep(3600)

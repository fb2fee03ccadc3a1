"""Every timeout a test waits on, from one setting: ``TANGRAM_TEST_TIMEOUT_S`` (seconds, default 600).

It bounds one wait: a CLI subprocess, a launch, a group of ranks joining, a process group's collectives. On this
project's machine kind (2 cores) beside four other CPU-heavy jobs (load average 10), the longest single wait measured
was under 100 s (the README's main job: profile, plan and train in one launch); the default leaves 6x that, and a
hung test fails after it rather than after torch's 30-minute default. Raise it on slower machines:

    TANGRAM_TEST_TIMEOUT_S=1200 python -m pytest tests

Timeouts that are part of what a test checks (a rendezvous that must give up, a store wait that must time out) are
not budgets and stay as the tests set them.
"""
from __future__ import annotations

import os
from datetime import timedelta

ENV = "TANGRAM_TEST_TIMEOUT_S"


def _read(env: dict | os._Environ = os.environ) -> float:
    raw = env.get(ENV, "600")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ENV}={raw!r}: must be a positive number of seconds (default 600)")
    return value


TIMEOUT_S = _read()
SUBPROCESS_TIMEOUT_S = TIMEOUT_S  # subprocess.run/communicate, a group of ranks to finish
PROCESS_GROUP_TIMEOUT_S = TIMEOUT_S  # a rank waiting for its peers in a collective
PROCESS_GROUP_TIMEOUT = timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)

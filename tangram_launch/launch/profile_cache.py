"""The profile cache's seal: a cached ClusterSpec is reused only if it is the file the profiler wrote for this key.

Next to ``profiles/<key>.yaml`` sits ``profiles/<key>.yaml.seal`` (JSON): the cache key (this node's hardware
fingerprint), the fingerprint the profile itself records, and the sha256 and size of the YAML's bytes, written
when the profile is cached. A file edited since (another fingerprint inside, changed figures), copied under
another key, or without a seal is not reused: the launcher says why and profiles again (``--reprofile`` forces a
new profile in any case). ``tangram-launch calibrate`` is the one writer besides the profiler: it seals the file it
calibrated again and lists the run it calibrated from (``calibrated``), so the next launch plans from those figures.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

SEAL_SUFFIX = ".seal"
SEAL_VERSION = 1


def _digest(path: str) -> tuple[str, int]:
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha256(data).hexdigest(), len(data)


def seal(path: str, key: str, profile_fingerprint: Any, *, calibrated: list[dict] | None = None) -> None:
    """Record what ``path`` is, right after the profiler's output was moved there (or ``calibrate`` rewrote it:
    ``calibrated`` lists the runs its figures were calibrated from)."""
    sha, size = _digest(path)
    record = {"version": SEAL_VERSION, "key": key, "fingerprint": profile_fingerprint, "sha256": sha, "bytes": size}
    if calibrated:
        record["calibrated"] = calibrated
    tmp = f"{path}{SEAL_SUFFIX}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, path + SEAL_SUFFIX)


def seal_problem(path: str, key: str, profile_fingerprint: Any) -> str | None:
    """Why ``path`` is not the sealed profile of ``key`` (None: it is)."""
    try:
        with open(path + SEAL_SUFFIX, encoding="utf-8") as f:
            s = json.load(f)
    except FileNotFoundError:
        return "it has no seal (not written by this launcher's profiler)"
    except (OSError, ValueError) as exc:
        return f"its seal is unreadable ({exc})"
    if not isinstance(s, dict) or s.get("version") != SEAL_VERSION:
        return "its seal is not one this launcher writes"
    if s.get("key") != key:
        return f"it was cached for hardware fingerprint {s.get('key')}, not {key}"
    sha, size = _digest(path)
    if (sha, size) != (s.get("sha256"), s.get("bytes")):
        return f"the file changed after it was cached (sha256 {sha[:12]}, sealed {str(s.get('sha256'))[:12]})"
    if profile_fingerprint != s.get("fingerprint"):
        return f"it records fingerprint {profile_fingerprint}, the profiler wrote {s.get('fingerprint')}"
    return None


def sealed_key(path: str, profile_fingerprint: Any) -> str | None:
    """The cache key ``path`` is sealed under, if it is exactly the file its seal describes (else None)."""
    try:
        with open(path + SEAL_SUFFIX, encoding="utf-8") as f:
            key = json.load(f).get("key")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(key, str):
        return None
    return key if seal_problem(path, key, profile_fingerprint) is None else None


def reseal_calibrated(path: str, key: str, profile_fingerprint: Any, plan_hash: str, at: str) -> None:
    """Seal ``path`` again after ``tangram-launch calibrate`` rewrote a sealed profile, recording the run it was
    calibrated from: the launcher then reuses the calibrated figures instead of profiling over them."""
    seal(path, key, profile_fingerprint, calibrated=calibrations(path) + [{"plan_hash": plan_hash, "at": at}])


def calibrations(path: str) -> list[dict]:
    """What ``reseal_calibrated`` recorded for ``path`` (oldest first; empty when never calibrated)."""
    try:
        with open(path + SEAL_SUFFIX, encoding="utf-8") as f:
            found = json.load(f).get("calibrated") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [c for c in found if isinstance(c, dict)]


def keep_aside(path: str, key: str, when: str) -> str | None:
    """Before a new profile replaces ``path``: copy it to ``PATH.replaced-<when>`` unless it is exactly the
    profiler's own sealed output (which a new measurement supersedes). An edited or calibrated profile is someone's
    work; the copy (returned) keeps it."""
    if not os.path.exists(path):
        return None
    try:
        with open(path + SEAL_SUFFIX, encoding="utf-8") as f:
            record = json.load(f)
        pristine = (isinstance(record, dict) and record.get("key") == key and not record.get("calibrated")
                    and (record.get("sha256"), record.get("bytes")) == _digest(path))
    except (OSError, ValueError):
        pristine = False
    if pristine:
        return None
    kept = f"{path}.replaced-{when}"
    shutil.copy2(path, kept)
    return kept

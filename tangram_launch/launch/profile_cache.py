"""The profile cache's seal: a cached ClusterSpec is reused only if it is the file the profiler wrote for this key.

Next to ``profiles/<key>.yaml`` sits ``profiles/<key>.yaml.seal`` (JSON): the cache key (this node's hardware
fingerprint), the fingerprint the profile itself records, and the sha256 and size of the YAML's bytes, written
when the profile is cached. A file edited since (another fingerprint inside, changed figures), copied under
another key, or without a seal is not reused: the launcher says why and profiles again (``--reprofile`` forces a
new profile in any case).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

SEAL_SUFFIX = ".seal"
SEAL_VERSION = 1


def _digest(path: str) -> tuple[str, int]:
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha256(data).hexdigest(), len(data)


def seal(path: str, key: str, profile_fingerprint: Any) -> None:
    """Record what ``path`` is, right after the profiler's output was moved there."""
    sha, size = _digest(path)
    tmp = f"{path}{SEAL_SUFFIX}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": SEAL_VERSION, "key": key, "fingerprint": profile_fingerprint, "sha256": sha,
                   "bytes": size}, f)
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

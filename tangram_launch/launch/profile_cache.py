"""The profile cache's seal: a cached ClusterSpec is reused only if it is the file the profiler wrote for this key.

Next to ``profiles/<key>.yaml`` sits ``profiles/<key>.yaml.seal`` (JSON): the cache key (this node's hardware
fingerprint), the fingerprint the profile itself records, and the sha256 and size of the YAML's bytes, written
when the profile is cached. A file edited since (another fingerprint inside, changed figures), copied under
another key, or without a seal is not reused: the launcher says why and profiles again (``--reprofile`` forces a
new profile in any case). ``tangram-launch calibrate`` is the one writer besides the profiler: it seals the file it
calibrated again and lists the run it calibrated from (``calibrated``), so the next launch plans from those figures.

A launch with ``--model`` needs more than the hardware: layer timings of its model at the shapes its planner prices
(:class:`LayerShapes`, :func:`planner_micro_batches`). The profile records the shapes it was asked for (its
``profile.model`` block); a cached profile whose shapes do not :func:`covers` the launch's is profiled again.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Mapping

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


# --- the model layers a launch-time profile times ---------------------------------------------------------------------

@dataclass(frozen=True)
class LayerShapes:
    """The shapes at which ``--profile --model`` times the model's layers (each layer kind, the embedding and the
    head): the cross product of sequence lengths, micro-batch sizes (rows per replica) and TP shards, in ``dtype``
    (None: the profiler's default, to be checked against the dtype the launch then trains in)."""

    model: str
    seq_lens: tuple[int, ...]
    micro_batches: tuple[int, ...]
    tps: tuple[int, ...] = (1,)
    dtype: str | None = None
    source: str = field(default="", compare=False)  # what the profiler's --model loads (a preset, a file): model's

    def __post_init__(self) -> None:
        for name in ("seq_lens", "micro_batches", "tps"):
            values = getattr(self, name)
            if not values or min(values) < 1 or tuple(sorted(set(values))) != values:
                raise ValueError(f"{name} must be positive integers, sorted and distinct, got {values!r}")

    def jobs(self, kinds: int) -> int:
        """Timings the profiler makes for a model of ``kinds`` layer kinds: each kind at every shape, the embedding
        and the head at tp 1 (profiler.worker._profile_layer)."""
        per_tp = len(self.seq_lens) * len(self.micro_batches)
        return per_tp * (kinds * len(self.tps) + (2 if 1 in self.tps else 0))

    def label(self) -> str:
        return (f"{self.model} at seq {_csv(self.seq_lens)}, micro-batch {_csv(self.micro_batches)}, "
                f"tp {_csv(self.tps)}{', ' + self.dtype if self.dtype else ''}")


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def _sorted(values: Any) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in values}))


def planner_micro_batches(global_batch: int, asked_b: tuple[int, ...] | None, devices: int) -> tuple[int, ...]:
    """The rows per replica (``mbs``) the planner can price a stage at: b / dp for every micro-batch size b it
    considers (``asked_b``, else every divisor of the global batch: planner.size_search.candidate_sizes) and every
    data-parallel degree dp <= ``devices`` that divides b (parallelizers: mbs = b / dp must be whole)."""
    from tangram_launch.planner.size_search import candidate_sizes

    bs = candidate_sizes(global_batch, asked_b)
    return _sorted(b // dp for b in bs for dp in range(1, devices + 1) if b % dp == 0)


def recorded_layer_shapes(profile: Mapping[str, Any]) -> LayerShapes | None:
    """The shapes a profile's layer timings were asked for (its ``profile.model`` block, written by the profiler's
    ``--model``: those the layer budget left out count as asked, so they are not asked again on every launch);
    None for a profile without layer timings."""
    info = profile.get("model")
    if not isinstance(info, Mapping) or not info.get("name"):
        return None
    try:
        return LayerShapes(model=str(info["name"]), seq_lens=_sorted(info.get("seq_lens") or [info["seq_len"]]),
                           micro_batches=_sorted(info.get("micro_batches") or [info["micro_batch"]]),
                           tps=_sorted(info.get("tp") or [1]), dtype=info.get("dtype"))
    except (KeyError, TypeError, ValueError):
        return None


def covers(recorded: LayerShapes | None, needed: LayerShapes) -> bool:
    """Whether layer timings asked for ``recorded`` hold every shape of ``needed`` (a ``needed`` dtype of None
    accepts any)."""
    return (recorded is not None and recorded.model == needed.model
            and (needed.dtype is None or recorded.dtype == needed.dtype)
            and set(needed.seq_lens) <= set(recorded.seq_lens)
            and set(needed.micro_batches) <= set(recorded.micro_batches) and set(needed.tps) <= set(recorded.tps))

"""The checkpoint directory on disk: atomic commits, manifests with checksums, finding the newest complete one.

Layout of a checkpoint directory (one training run)::

    ckpt/
      step_200/                 complete: renamed into place only after every rank finished and the manifest exists
        manifest.json           written last: step, model keys, optimizer keys, sha256 + size of every other file
        plan.json               the plan the checkpoint was written under
        position.json           step, consumed samples, data-loader position, extra (JSON)
        optimizer.json          per-parameter optimizer hyperparameters and non-tensor state
        rng/rank_<r>.json       RNG states (torch, numpy, python[, cuda]) of rank r; rng/global.json = rank 0's
        state/                  torch.distributed.checkpoint shards (.metadata + __<rank>_<i>.distcp)
      step_300.tmp-1a2b3c4d/    a save in progress, or torn by a crash: never loaded, removed by the next save

A directory is *complete* when its manifest is present and every file it lists exists with the recorded size and
sha256. The loader takes the newest complete one and names every newer one it skipped, with the reason. Standard
library only, so the launcher (``--resume``) can look at a checkpoint without importing torch.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from tangram_launch.checkpoint import confined, fields
from tangram_launch.errors import SpecError

logger = logging.getLogger(__name__)

FORMAT = fields.FORMAT
FORMAT_VERSION = fields.FORMAT_VERSION
MANIFEST = "manifest.json"
PLAN_FILE = "plan.json"
POSITION_FILE = "position.json"
OPTIMIZER_FILE = "optimizer.json"
RNG_DIR = "rng"
STATE_DIR = "state"

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp-([0-9a-f]+)$")


def committed_step(name: str) -> int | None:
    """The step of a committed checkpoint's directory name (``step_<N>``), else None (a temporary name, another
    name, or a number longer than any count of ours)."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m and len(m.group(1)) <= confined.MAX_JSON_INT_DIGITS else None


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step}")


def tmp_dir_name(step: int) -> str:
    return f"step_{step}.tmp-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class Candidate:
    """A directory that looks like a checkpoint: ``step_<N>`` (committed) or ``step_<N>.tmp-<id>`` (in progress)."""

    path: str
    step: int
    committed: bool


@dataclass(frozen=True)
class Skipped:
    """A checkpoint the loader passed over, and why (what the warning says)."""

    path: str
    step: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path} (step {self.step}): {self.reason}"


def list_candidates(directory: str) -> list[Candidate]:
    """Checkpoint-like entries of ``directory``, newest step first (committed before tmp at equal steps).

    Only real directories count: a ``step_<N>`` that is a symlink is not followed (and is named in a warning).
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise SpecError("checkpoint path is not a directory", field="checkpoint directory", value=directory) from None
    out = []
    for name in names:
        m_step, m_tmp = _STEP_DIR.match(name), _TMP_DIR.match(name)
        m = m_step or m_tmp
        if not m or len(m.group(1)) > confined.MAX_JSON_INT_DIGITS:
            continue
        path = os.path.join(directory, name)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            logger.warning("ignoring %s: a symbolic link (links are not followed in a checkpoint directory)", path)
            continue
        if stat.S_ISDIR(mode):
            out.append(Candidate(path, int(m.group(1)), m_step is not None))
    return sorted(out, key=lambda c: (-c.step, not c.committed, c.path))


# --- durable writes ------------------------------------------------------------------------------------------

def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(root: str, rel: str, obj: Any) -> None:
    """Write ``root/rel`` (JSON) and fsync it (the directory entry is fsynced by ``commit``)."""
    confined.write_json(root, rel, obj)


def read_json(root: str, rel: str) -> Any:
    """A JSON file of a checkpoint: confined to ``root``, a regular file, size-capped, bounded numbers and depth."""
    return confined.read_json(root, rel, field=rel)


def list_files(root: str) -> list[str]:
    """Every regular file under ``root`` as a '/'-separated relative path, sorted; the manifest excluded.

    Links are neither followed nor listed (the writers of a checkpoint make none).
    """
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel != MANIFEST and stat.S_ISREG(os.lstat(full).st_mode):
                out.append(rel)
    return sorted(out)


def hash_files(root: str, rel_paths: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{relative path: {"sha256", "bytes"}} for the given files (one rank's share of a checkpoint)."""
    out = {}
    for rel in rel_paths:
        size = confined.file_size(root, rel, field=rel)
        out[rel] = {"sha256": confined.sha256(root, rel, size_bytes=size, field=rel), "bytes": size}
    return out


def share(items: list[str], rank: int, world_size: int) -> list[str]:
    """Rank ``rank``'s share of a sorted list (round robin), for hashing or verifying in parallel."""
    return items[rank::world_size]


def write_manifest(root: str, manifest: Mapping[str, Any]) -> None:
    """The manifest goes last: its presence is what makes a directory a checkpoint."""
    write_json(root, MANIFEST, dict(manifest))


def fsync_tree(root: str) -> None:
    """fsync every directory under ``root`` (files are fsynced as they are written)."""
    for dirpath, dirnames, _ in os.walk(root, topdown=False):
        fsync_dir(dirpath)


def commit(tmp_path: str, final_path: str) -> None:
    """Make a finished checkpoint visible: fsync the tree, rename atomically, fsync the parent directory."""
    if os.path.lexists(final_path):
        raise SpecError("a checkpoint already exists under that name; complete checkpoints are never overwritten",
                        field="step", value=final_path)
    fsync_tree(tmp_path)
    os.rename(tmp_path, final_path)
    fsync_dir(os.path.dirname(final_path) or ".")


# --- reading and verifying ---------------------------------------------------------------------------------------

def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of a checkpoint directory, every field checked; SpecError if absent, unreadable or not ours."""
    return fields.check_manifest(confined.read_json(path, MANIFEST, field=MANIFEST), source=os.path.join(path, MANIFEST))


def manifest_problem(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) or (None, why this directory is not a checkpoint)."""
    try:
        return read_manifest(path), None
    except confined.CheckpointFileError as exc:
        if exc.missing:
            return None, "no manifest (an interrupted save)"
        return None, f"unreadable manifest ({exc})"
    except SpecError as exc:
        return None, f"unreadable manifest ({exc})"


def check_files(path: str, manifest: Mapping[str, Any], rel_paths: Iterable[str] | None = None,
                *, checksums: bool = True) -> list[str]:
    """Problems with the listed files (default: all in the manifest): missing, wrong size, wrong sha256, or not a
    regular file inside ``path`` (a link, a FIFO, a device: refused, never followed or read)."""
    files: Mapping[str, Mapping[str, Any]] = manifest["files"]
    problems = []
    for rel in (sorted(files) if rel_paths is None else rel_paths):
        entry = files[rel]
        try:
            if checksums:
                ok = confined.sha256(path, rel, size_bytes=entry["bytes"], field=rel) == entry["sha256"]
            else:
                with confined.open_regular(path, rel, size_bytes=entry["bytes"], field=rel):
                    ok = True
        except confined.CheckpointFileError as exc:
            problems.append(f"missing file {rel}" if exc.missing else f"{rel}: {exc.reason}")
            continue
        if not ok:
            problems.append(f"checksum mismatch in {rel}")
    return problems


@dataclass(frozen=True)
class Found:
    path: str
    step: int
    manifest: Mapping[str, Any]
    skipped: tuple[Skipped, ...]


def one_checkpoint(path: str) -> tuple[str, int] | None:
    """(the directory that holds it, its step) when ``path`` names one checkpoint (``DIR/step_<N>`` with a
    manifest), else None: a directory of checkpoints."""
    step = committed_step(os.path.basename(os.path.normpath(path)))
    if step is None or not os.path.lexists(os.path.join(path, MANIFEST)):
        return None
    return os.path.dirname(os.path.abspath(path)), step


def checkpoint_location(path: str, step: int | None = None) -> tuple[str, int | None]:
    """(directory, step) to look in: ``path`` and ``step`` as given, or, where ``path`` names one checkpoint, the
    directory holding it at its step (as Megatron's --ckpt-step or DeepSpeed's checkpoint tag choose one); a
    ``step`` other than the named checkpoint's is refused."""
    one = one_checkpoint(path)
    if one is None:
        return path, step
    if step is not None and step != one[1]:
        raise SpecError(f"{path} is the checkpoint of step {one[1]}, not of step {step}", field="step", value=step,
                        valid=f"{one[1]}, or the directory {one[0]} to choose any of its steps")
    return one


def home_directory(path: str) -> str:
    """The directory a run resumed from ``path`` keeps its checkpoints in: ``path``, or the one holding the single
    checkpoint it names."""
    one = one_checkpoint(path)
    return one[0] if one is not None else path


def find_latest(directory: str, *, step: int | None = None, checksums: bool = True) -> Found:
    """The newest complete checkpoint under ``directory`` (or the one of ``step``; or the checkpoint ``directory``
    names: checkpoint_location), verified on one process.

    Newer torn or corrupt ones are skipped and logged. SpecError when there is none, naming where it looked and
    what it skipped. (``tangram_launch.checkpoint.load_checkpoint`` does the same with the verification spread over
    ranks.)
    """
    directory, step = checkpoint_location(directory, step)
    skipped: list[Skipped] = []
    for cand in list_candidates(directory):
        if step is not None and cand.step != step:
            continue
        manifest, problem = (None, "a save in progress or torn (temporary name)") if not cand.committed \
            else manifest_problem(cand.path)
        if manifest is not None:
            problems = check_files(cand.path, manifest, checksums=checksums)
            if not problems:
                log_skipped(skipped, cand.path)
                return Found(cand.path, cand.step, manifest, tuple(skipped))
            problem = "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
        skipped.append(Skipped(cand.path, cand.step, problem or "incomplete"))
    raise no_checkpoint_error(directory, skipped, step)


def log_skipped(skipped: list[Skipped], chosen: str) -> None:
    for s in skipped:
        logger.warning("skipping checkpoint %s; using the previous complete one, %s", s, chosen)


def no_checkpoint_error(directory: str, skipped: list[Skipped], step: int | None) -> SpecError:
    what = f"step_{step}" if step is not None else "step_<N>"
    msg = f"no complete checkpoint in {os.path.abspath(directory)} (looked for {what}/{MANIFEST})"
    if skipped:
        msg += "; skipped: " + "; ".join(str(s) for s in skipped)
    elif not os.path.isdir(directory):
        msg += "; the directory does not exist"
    return SpecError(msg, field="checkpoint directory", value=directory)


# --- retention ------------------------------------------------------------------------------------------------------

def prune(directory: str, keep_last: int, *, keep: str) -> list[str]:
    """Remove committed checkpoints older than the newest ``keep_last`` *verified* ones, and stale temporary ones.

    Called only after a successful commit of ``keep``, which is never removed. Walking from the newest step down,
    a checkpoint counts toward ``keep_last`` only if it verifies (every file of its manifest present with the
    recorded size and sha256; ``keep`` was hashed by the ranks that just wrote it, so its sizes are checked, not its
    bytes again); one that does not verify is kept (the loader skips it, naming it) and does not count, so an older
    complete checkpoint is removed only once ``keep_last`` newer ones verify, and nothing at or after the newest
    verified one is ever removed. Only directories with a manifest count as checkpoints; a committed directory
    without one is left alone (not ours to judge), and so is anything that is not named like a checkpoint. Steps
    newer than ``keep`` (another history: a run resumed from an older checkpoint of this directory) neither count
    nor go. Cost: rank 0 re-reads up to ``keep_last - 1`` older checkpoints, and only when there is something to
    remove.
    """
    removed = []
    keep_abs = os.path.abspath(keep)
    keep_step = committed_step(os.path.basename(keep_abs))
    complete = [c for c in list_candidates(directory)
                if c.committed and os.path.lexists(os.path.join(c.path, MANIFEST))
                and (keep_step is None or c.step <= keep_step)]
    if len(complete) > keep_last:  # something may go: count verified checkpoints from the newest down
        verified = 0
        for c in complete:
            if verified >= keep_last:
                if os.path.abspath(c.path) != keep_abs:
                    shutil.rmtree(c.path)
                    removed.append(c.path)
                continue
            manifest, problem = manifest_problem(c.path)
            problems = [problem] if problem else check_files(
                c.path, manifest, checksums=os.path.abspath(c.path) != keep_abs)
            if problems:
                logger.warning("keeping checkpoint %s, which does not verify (%s), and not counting it toward "
                               "keep_last=%d", c.path, "; ".join(problems[:3]), keep_last)
                continue
            verified += 1
    for c in list_candidates(directory):
        if not c.committed:
            shutil.rmtree(c.path, ignore_errors=True)
            removed.append(c.path)
    if removed:
        fsync_dir(directory)
        logger.info("removed old checkpoints: %s", ", ".join(removed))
    return removed


# --- the training position ------------------------------------------------------------------------------------------

MAX_COUNT = fields.MAX_INT  # steps and samples are int64 wherever they end up (samplers, tensors, Megatron)


def _check_jsonable(value: Any, where: str, source: str | None = None) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise SpecError(f"must be JSON-serialisable ({str(exc)[:200]})", source=source, field=where,
                        value=type(value).__name__) from None
    problem = confined.depth_problem(value)
    if problem:
        raise SpecError(f"must be JSON of reasonable depth ({problem})", source=source, field=where)


@dataclass(frozen=True)
class TrainingPosition:
    """Where training stands, independent of the layout: what a resumed run needs to continue the same data stream.

    ``step``: optimizer steps completed. ``consumed_samples``: sequences consumed so far (the layout-agnostic data
    position: with a changed global batch the next sample is still exact). ``data``: the data loader's own position
    (epoch, index, shuffling seed, ...), ``extra``: anything else (an LR scheduler's state_dict()); both JSON objects.
    """

    step: int
    consumed_samples: int
    data: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = field(default=None, compare=False, repr=False)  # the file it was read from, for errors

    def __post_init__(self) -> None:
        for name in ("step", "consumed_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
                raise SpecError("must be an integer >= 0 (and below 2**63)", source=self.source,
                                field=f"position.{name}", value=v, valid=f"0..{MAX_COUNT}")
        for name in ("data", "extra"):
            v = getattr(self, name)
            if not isinstance(v, Mapping):
                raise SpecError("must be a JSON object", source=self.source, field=f"position.{name}",
                                value=type(v).__name__)
            v = dict(v)
            _check_jsonable(v, f"position.{name}", self.source)
            object.__setattr__(self, name, v)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "data": dict(self.data),
                "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, d: Any, *, source: str | None = None) -> "TrainingPosition":
        if not isinstance(d, Mapping):
            raise SpecError("a training position is a JSON object", source=source, value=type(d).__name__)
        for key in ("step", "consumed_samples"):
            if key not in d:
                raise SpecError("missing", source=source, field=f"position.{key}")
        unknown = sorted(set(d) - {"step", "consumed_samples", "data", "extra"})
        if unknown:
            raise SpecError("unknown field in a training position", source=source, field=f"position.{unknown[0]}",
                            valid="step, consumed_samples, data, extra")
        return cls(step=d["step"], consumed_samples=d["consumed_samples"],
                   data={} if d.get("data") is None else d["data"],
                   extra={} if d.get("extra") is None else d["extra"], source=source)


@dataclass(frozen=True)
class CheckpointInfo:
    """What the launcher needs to show before resuming: where, which step, the old plan (as a dict), the position."""

    path: str
    step: int
    plan: Mapping[str, Any]
    position: TrainingPosition
    skipped: tuple[Skipped, ...]


def describe(directory: str, *, step: int | None = None, checksums: bool = False) -> CheckpointInfo:
    """The newest complete checkpoint's summary without torch (``checksums=True`` to verify every byte as well)."""
    found = find_latest(directory, step=step, checksums=checksums)
    return CheckpointInfo(found.path, found.step, read_plan_dict(found.path), read_position(found.path),
                          found.skipped)


def read_plan_dict(path: str) -> dict[str, Any]:
    """plan.json of checkpoint ``path`` as a dict, every field checked as a Plan (what the launcher compares)."""
    from tangram_launch.plan import Plan

    source = os.path.join(path, PLAN_FILE)
    plan = read_json(path, PLAN_FILE)
    try:
        Plan.from_dict(plan, source=source)
    except SpecError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SpecError(f"not a valid plan ({type(exc).__name__}: {str(exc)[:200]})", source=source) from None
    return plan


def read_position(path: str) -> "TrainingPosition":
    """position.json of checkpoint ``path``, every field checked."""
    return TrainingPosition.from_dict(read_json(path, POSITION_FILE), source=os.path.join(path, POSITION_FILE))


def finish(tmp_path: str, final_path: str, manifest: Mapping[str, Any], *, directory: str,
           keep_last: int | None) -> str | None:
    """Manifest last, then the rename that makes the checkpoint visible; older ones are pruned only after that.

    Returns an error text (the files stay in ``tmp_path``) or None; run on one rank after every rank wrote.
    """
    try:
        write_manifest(tmp_path, manifest)
        commit(tmp_path, final_path)
    except (OSError, SpecError) as exc:
        return f"{exc} (the files stay in {tmp_path})"
    if keep_last is not None:
        try:
            prune(directory, keep_last, keep=final_path)
        except OSError as exc:  # the new checkpoint is complete; an old one that stays is no loss
            logger.warning("could not remove old checkpoints in %s: %s", directory, exc)
    return None

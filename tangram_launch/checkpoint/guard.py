"""What rank 0 does around a save so that a bad disk state never stops training and never loses data.

Before a save (:func:`before_save`):

* take or confirm the directory's lock (:mod:`tangram_launch.checkpoint_lock`): one writer per directory;
* a ``step_<N>/`` that already exists but does not verify (torn, corrupt, truncated manifest) is moved aside as
  ``step_<N>.corrupt-<UTC time>`` (never deleted: someone may want to look at it), so the run saves past it; a
  complete one is still never overwritten;
* temporaries of earlier, crashed saves (``step_<N>.tmp-<id>``) are removed first: under the lock no other save
  can be in progress, and they may be what fills the disk;
* the free space is checked against the checkpoint's size (tensor bytes from every rank's key list, plus a margin
  for the small files): a save that cannot fit is refused before anything is written, naming the directory, the
  space needed and the space free.

After a failed write (:func:`failed_save`): the temporary directory is removed and the message names the
directory, the space needed and free (ENOSPC), instead of a raw OSError traceback.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from typing import Any, Iterable, Mapping

from tangram_launch.checkpoint import lock as checkpoint_lock
from tangram_launch.checkpoint import store
from tangram_launch.errors import SpecError

logger = logging.getLogger(__name__)

SMALL_FILES_MARGIN_BYTES = 4 << 20  # manifest, plan, position, RNG and DCP metadata, generously
_DTYPE_BYTES = {"float64": 8, "double": 8, "int64": 8, "long": 8, "complex64": 8, "float32": 4, "float": 4,
                "int32": 4, "int": 4, "bfloat16": 2, "float16": 2, "half": 2, "int16": 2, "short": 2, "int8": 1,
                "uint8": 1, "bool": 1, "complex128": 16}


def tensor_bytes(metas: Iterable[Mapping[str, Any]]) -> int:
    """Bytes of tensors described as {"shape", "dtype"} (unknown dtypes count 8 bytes an element)."""
    total = 0
    for m in metas:
        n = 1
        for d in m.get("shape", ()):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(str(m.get("dtype")), 8)
    return total


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_bytes(directory: str) -> int | None:
    probe = directory
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe or ".").free
    except OSError:
        return None


def set_aside_if_incomplete(final: str) -> str | None:
    """Move a ``step_<N>/`` that does not verify out of the way; returns the new name, or None (nothing there).

    SpecError when it is a complete checkpoint: those are never overwritten.
    """
    if not os.path.lexists(final):
        return None
    problems = ["not a directory"] if not os.path.isdir(final) else None
    if problems is None:
        manifest, problem = store.manifest_problem(final)
        problems = [problem] if problem else store.check_files(final, manifest)
    if not problems:
        raise SpecError(f"{final} already exists; a complete checkpoint is never overwritten (resume from it, or "
                        "save under another step)", field="position.step", value=os.path.basename(final))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = f"{final}.corrupt-{stamp}"
    n = 1
    while os.path.lexists(aside):
        n += 1
        aside = f"{final}.corrupt-{stamp}-{n}"
    os.rename(final, aside)
    logger.warning("moved the incomplete checkpoint %s aside to %s (%s) so this save can take its place", final,
                   aside, "; ".join(problems[:3]))
    return aside


def prune_temporaries(directory: str) -> list[str]:
    """Remove ``step_<N>.tmp-<id>`` left by crashed saves (call only under the directory's lock)."""
    removed = []
    for cand in store.list_candidates(directory):
        if not cand.committed:
            shutil.rmtree(cand.path, ignore_errors=True)
            removed.append(cand.path)
    if removed:
        logger.info("removed temporaries of earlier, interrupted saves: %s", ", ".join(removed))
    return removed


def check_space(directory: str, needed_bytes: int) -> None:
    free = free_bytes(directory)
    if free is not None and free < needed_bytes:
        raise SpecError(f"not enough free space in {os.path.abspath(directory)} for the checkpoint: it needs about "
                        f"{human(needed_bytes)}, {human(free)} free; free {human(needed_bytes - free)} or more "
                        "(e.g. a smaller --keep-last), or save elsewhere", field="checkpoint directory",
                        value=directory)


def before_save(directory: str, final: str, needed_bytes: int) -> None:
    """Rank 0, before making the temporary directory (see the module doc)."""
    os.makedirs(directory, exist_ok=True)
    checkpoint_lock.ensure_held(directory)
    set_aside_if_incomplete(final)
    prune_temporaries(directory)
    check_space(directory, needed_bytes)


def _enospc(exc: BaseException) -> bool:
    seen: list[BaseException] = [exc]
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: exception}
    if isinstance(failures, Mapping):
        seen += [e for e in failures.values() if isinstance(e, BaseException)]
    for e in seen:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
    return False


def failed_save(exc: BaseException, *, directory: str, tmp: str | None, needed_bytes: int) -> str:
    """The error text for a save that failed while writing; ``tmp`` is removed (call on rank 0 only)."""
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    free = free_bytes(directory)
    if _enospc(exc):
        return (f"{os.path.abspath(directory)} ran out of space: the checkpoint needs about {human(needed_bytes)}, "
                f"{human(free) if free is not None else '?'} free now; the partial save was removed. Free space "
                "(e.g. a smaller --keep-last) or save elsewhere")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"writing into {os.path.abspath(directory)} failed ({type(exc).__name__}: {first}); the partial save was " \
           "removed"


__all__ = ["tensor_bytes", "before_save", "set_aside_if_incomplete", "prune_temporaries", "check_space",
           "failed_save", "free_bytes"]

"""Every byte read from or written to a checkpoint directory goes through here, confined to that directory.

A checkpoint is input someone else may have written, so a path it names is data, not a place to go:

* paths are relative, '/'-separated, with no ``..``, ``.``, empty part, backslash or NUL (:func:`parts_of`);
* they are resolved one directory at a time from the root with ``os.open(..., dir_fd=...)`` and ``O_NOFOLLOW``,
  so no symlink is followed, in a parent or the file itself (the root is the user's own choice and may be one);
* only regular files are read: the file is opened ``O_NONBLOCK`` (a FIFO never blocks) and checked with
  ``fstat`` on the open descriptor before one byte is read (no FIFOs, devices or directories);
* sizes are checked before reading: against the manifest (:func:`sha256`, which reads at most the declared size)
  or a cap (:func:`read_bytes`, :func:`read_json`);
* JSON is parsed with bounds: integers of at most 30 digits, finite floats, no NaN/Infinity, nesting at most 64.

Refusals are :class:`CheckpointFileError` (a SpecError: exit status 2) naming the file, and say why.
Standard library only (the launcher reads checkpoints without torch).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import stat
from typing import Any, BinaryIO, Iterator

from tangram_launch.errors import SpecError

MAX_JSON_BYTES = 64 << 20  # manifest/plan/position/RNG/optimizer JSON of a huge model stays far below this
MAX_JSON_DEPTH = 64  # ours nest 5 deep at most
MAX_JSON_INT_DIGITS = 30  # int64 has 19; a longer number is not a count, a size or a seed of ours
_HASH_CHUNK_BYTES = 1 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_MODE = 0o666  # the umask decides, as for any file a user writes
_NEW_DIR_MODE = 0o777


class CheckpointFileError(SpecError):
    """A checkpoint file that is missing, outside its directory, a symlink, not a regular file or the wrong size.

    ``missing`` tells a file that is simply absent (an interrupted save) from one that is refused.
    """

    def __init__(self, message: str, *, missing: bool = False, **where: Any) -> None:
        super().__init__(message, **where)  # source, field, value, valid as SpecError takes them
        self.missing = missing
        self.reason = message


def parts_of(rel: Any, *, root: str, field: str = "path") -> tuple[str, ...]:
    """The components of a relative path a checkpoint names; CheckpointFileError for anything else."""
    valid = "a relative path inside the checkpoint directory ('a/b.json': no '..', no leading '/', no NUL)"
    if not isinstance(rel, str) or not rel:
        raise CheckpointFileError("a file name must be a non-empty string", source=root, field=field,
                                  value=rel if not isinstance(rel, str) else "", valid=valid)
    if "\x00" in rel or "\\" in rel or rel.startswith("/"):
        raise CheckpointFileError("refusing a path that is absolute or holds NUL or '\\'", source=root,
                                  field=field, value=rel[:200], valid=valid)
    parts = tuple(rel.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise CheckpointFileError("refusing a path that leaves or re-enters its directory", source=root,
                                  field=field, value=rel[:200], valid=valid)
    return parts


def _where(root: str, rel: str) -> str:
    return os.path.join(root, rel)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a regular file"
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_entry(dir_fd: int, name: str, *, root: str, rel: str, field: str, exc: OSError) -> CheckpointFileError:
    """The error for an entry that would not open: absent, a symlink (not followed), or of another kind."""
    if isinstance(exc, FileNotFoundError):
        return CheckpointFileError("missing", source=_where(root, rel), field=field, missing=True)
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        return CheckpointFileError("refusing a symbolic link (links are not followed inside a checkpoint)",
                                   source=_where(root, rel), field=field, valid="a regular file")
    if exc.errno == errno.ENOTDIR:
        return CheckpointFileError(f"refusing a path through {_kind(st.st_mode) if st else 'something'} that is "
                                   "not a directory", source=_where(root, rel), field=field)
    return CheckpointFileError(f"cannot open ({exc.strerror})", source=_where(root, rel), field=field)


def _open_dir_chain(root: str, parts: tuple[str, ...], *, rel: str, field: str, create: bool = False) -> int:
    """A descriptor of the directory holding ``parts[-1]``, reached without following a link."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointFileError("the directory does not exist", source=root, field=field, missing=True) from None
    except OSError as exc:
        raise CheckpointFileError(f"cannot open the directory ({exc.strerror})", source=root, field=field) from None
    try:
        for part in parts[:-1]:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, _NEW_DIR_MODE, dir_fd=fd)
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _refuse_entry(fd, part, root=root, rel=rel, field=field, exc=exc) from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def open_regular(root: str, rel: str, *, field: str = "file", max_bytes: int | None = None,
                 size_bytes: int | None = None) -> Iterator[tuple[BinaryIO, int]]:
    """(file, size) of a regular file under ``root``, its size checked before any read.

    ``size_bytes``: the size the manifest declares (must match); ``max_bytes``: a cap.
    """
    parts = parts_of(rel, root=root, field=field)
    dir_fd = _open_dir_chain(root, parts, rel=rel, field=field)
    try:
        try:
            fd = os.open(parts[-1], _READ_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            raise _refuse_entry(dir_fd, parts[-1], root=root, rel=rel, field=field, exc=exc) from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFileError(f"refusing {_kind(st.st_mode)}", source=_where(root, rel), field=field,
                                      valid="a regular file")
        if size_bytes is not None and st.st_size != size_bytes:
            raise CheckpointFileError(f"has {st.st_size} bytes, the manifest says {size_bytes}",
                                      source=_where(root, rel), field=field)
        if max_bytes is not None and st.st_size > max_bytes:
            raise CheckpointFileError(f"is {st.st_size} bytes, more than the {max_bytes} allowed for it",
                                      source=_where(root, rel), field=field)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f, st.st_size


def file_size(root: str, rel: str, *, field: str = "file") -> int:
    with open_regular(root, rel, field=field) as (_, size):
        return size


def read_bytes(root: str, rel: str, *, max_bytes: int, field: str = "file") -> bytes:
    """A whole regular file of at most ``max_bytes``."""
    with open_regular(root, rel, field=field, max_bytes=max_bytes) as (f, size):
        data = f.read(size + 1)
    if len(data) != size:  # it changed while open
        raise CheckpointFileError(f"changed size while being read ({size} -> {len(data)} bytes)",
                                  source=_where(root, rel), field=field)
    return data


def read_range(root: str, rel: str, offset: int, length: int, *, field: str = "file") -> bytes:
    """``length`` bytes at ``offset`` of a regular file that holds them."""
    with open_regular(root, rel, field=field) as (f, size):
        if offset < 0 or length < 0 or offset + length > size:
            raise CheckpointFileError(f"bytes [{offset}, {offset + length}) lie outside the file ({size} bytes)",
                                      source=_where(root, rel), field=field)
        f.seek(offset)
        return f.read(length)


def sha256(root: str, rel: str, *, size_bytes: int, field: str = "file") -> str:
    """sha256 of a regular file of exactly ``size_bytes`` (what the manifest says), reading no more than that."""
    h = hashlib.sha256()
    left = size_bytes
    with open_regular(root, rel, field=field, size_bytes=size_bytes) as (f, _):
        while left > 0:
            chunk = f.read(min(_HASH_CHUNK_BYTES, left))
            if not chunk:
                raise CheckpointFileError(f"ended after {size_bytes - left} of {size_bytes} bytes",
                                          source=_where(root, rel), field=field)
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


# --- JSON ---------------------------------------------------------------------------------------------------------

def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_JSON_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} does not fit a float")
    return value


def _parse_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def depth_problem(obj: Any) -> str | None:
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"nested more than {MAX_JSON_DEPTH} deep"
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return None


def loads_json(data: bytes, *, source: str) -> Any:
    """JSON from bytes, with the bounds of the module doc; CheckpointFileError naming ``source`` otherwise."""
    try:
        text = data.decode("utf-8")
        obj = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except UnicodeDecodeError as exc:
        raise CheckpointFileError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", source=source) from None
    except RecursionError:
        raise CheckpointFileError(f"not valid JSON (nested more than {MAX_JSON_DEPTH} deep)", source=source) from None
    except ValueError as exc:  # JSONDecodeError, and the bounds above
        raise CheckpointFileError(f"not valid JSON ({str(exc)[:200]})", source=source) from None
    problem = depth_problem(obj)
    if problem:
        raise CheckpointFileError(f"not valid JSON ({problem})", source=source)
    return obj


def read_json(root: str, rel: str, *, max_bytes: int = MAX_JSON_BYTES, field: str = "file") -> Any:
    return loads_json(read_bytes(root, rel, max_bytes=max_bytes, field=field), source=_where(root, rel))


# --- writing --------------------------------------------------------------------------------------------------------

def write_bytes(root: str, rel: str, data: bytes, *, fsync: bool = True) -> None:
    """Create ``rel`` under ``root`` (parents made as needed), never through a link and never over a file."""
    parts = parts_of(rel, root=root)
    dir_fd = _open_dir_chain(root, parts, rel=rel, field="file", create=True)
    try:
        fd = os.open(parts[-1], _WRITE_FLAGS, _NEW_FILE_MODE, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def write_json(root: str, rel: str, obj: Any) -> None:
    write_bytes(root, rel, json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode("utf-8"))


def umask() -> int:
    """The process's umask (read from /proc where possible: setting it to read it races with other threads)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_readable_as_created(path: str) -> None:
    """Give a file written with mode 0600 by a library (safetensors) the mode a plain ``open`` would: 0666 less
    the umask."""
    os.chmod(path, _NEW_FILE_MODE & ~umask())

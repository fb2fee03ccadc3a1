"""YAML in and out with errors that name the file and the field."""
from __future__ import annotations

import contextlib
import difflib
import os
from typing import Any, Iterable, Mapping

import yaml

from tangram_launch.errors import SpecError


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The most similar valid name, for 'did you mean' hints."""
    matches = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def load_yaml_file(path: str | os.PathLike) -> dict:
    """Read a YAML mapping; a missing file or malformed YAML is a SpecError naming the file."""
    from tangram_launch.specs.limits import parse_yaml, read_text  # bounded: size, depth, aliases, integers

    path = os.fspath(path)
    data = parse_yaml(read_text(path), source=path)
    if not isinstance(data, dict):
        raise SpecError(
            "expected a mapping at the top level", source=path, value=type(data).__name__, valid="a YAML mapping"
        )
    return data


def dump_yaml_file(data: Any, path: str | os.PathLike) -> None:
    """Write YAML atomically (temporary name, fsync, rename) so a crash never leaves half a file."""
    dump_text_file(yaml.safe_dump(data, sort_keys=False, default_flow_style=None), path)


def dump_bytes_file(data: bytes, path: str | os.PathLike) -> None:
    """Write bytes atomically: a temporary name beside the file, flushed to disk, then renamed over it, so that a
    crash leaves the old file or the new one, never a torn one."""
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a directory that takes no files (/proc), a full disk, a read-only mount, ...
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise SpecError(f"cannot write the file ({exc.strerror or exc}); what was there before is unchanged",
                        source=path) from None


def dump_text_file(text: str, path: str | os.PathLike) -> None:
    """Write text (UTF-8) atomically, as dump_bytes_file does."""
    dump_bytes_file(text.encode("utf-8"), path)


def check_keys(mapping: Mapping, allowed: Iterable[str], *, where: str, source: str | None = None) -> None:
    """Refuse unknown keys (typos silently ignored are the worst kind of bug)."""
    allowed = list(allowed)
    for key in mapping:
        if key not in allowed:
            hint = closest(str(key), allowed)
            valid = f"did you mean '{hint}'? known keys: {', '.join(allowed)}" if hint else ", ".join(allowed)
            raise SpecError("unknown key", source=source, field=f"{where}.{key}" if where else str(key), valid=valid)


def require(mapping: Mapping, key: str, *, where: str, source: str | None = None) -> Any:
    """A required field, or a SpecError naming it."""
    if key not in mapping:
        raise SpecError("missing required field", source=source, field=f"{where}.{key}" if where else key)
    return mapping[key]


def positive_number(value: Any, *, field: str, source: str | None = None, allow_zero: bool = False) -> float:
    """A number > 0 (or >= 0), else a SpecError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError("expected a number", source=source, field=field, value=value)
    if value != value or value in (float("inf"), float("-inf")):  # NaN, inf: never a measurement
        raise SpecError("must be a finite number", source=source, field=field, value=value)
    if value < 0 or (value == 0 and not allow_zero):
        raise SpecError("must be positive" if not allow_zero else "must not be negative", source=source,
                        field=field, value=value, valid="a number > 0" if not allow_zero else "a number >= 0")
    return float(value)


def positive_int(value: Any, *, field: str, source: str | None = None) -> int:
    """An integer >= 1, else a SpecError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError("expected a positive integer", source=source, field=field, value=value, valid="an integer >= 1")
    return int(value)


def to_plain(obj: Any) -> Any:
    """Mappings/tuples to plain dicts/lists so YAML and JSON write them without Python tags."""
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj

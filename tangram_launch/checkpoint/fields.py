"""Every field of a checkpoint's JSON files checked before anything uses it: the manifest here (standard library
only, so the launcher checks it without torch), RNG states and optimizer state in :mod:`tangram_launch.checkpoint.
state_fields`.

A checkpoint is input: a manifest may list ``../../etc/passwd``, a shape of ``[4000000000000000000]`` or
``"abc"``, a size of ``-1``. Each is refused with a SpecError naming the file, the field, the value and what would
be valid, before a byte of the listed files is opened or a tensor allocated.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from tangram_launch.checkpoint import confined
from tangram_launch.errors import SpecError

FORMAT = "tangram-checkpoint"
FORMAT_VERSION = 1
STATE_FORMATS = ("tangram-dcp", "megatron-dist-checkpointing")
MAX_FILE_BYTES = 1 << 50  # 1 PiB: no checkpoint file is larger
MAX_DIM = 1 << 40
MAX_ELEMENTS = 1 << 48
MAX_INT = (1 << 63) - 1
# dtype names as ``str(tensor.dtype)`` writes them without "torch."
DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"})
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _int(value: Any, *, lo: int, hi: int, source: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpecError("must be an integer in range", source=source, field=field,
                        value=value if not isinstance(value, str) else value[:80], valid=f"{lo}..{hi}")
    return value


def _mapping(value: Any, *, source: str, field: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise SpecError("must be a JSON object", source=source, field=field, value=type(value).__name__)
    return value


def check_tensor_meta(meta: Any, *, source: str, field: str) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of a manifest's ``{"shape": [...], "dtype": "..."}``."""
    meta = _mapping(meta, source=source, field=field)
    shape = meta.get("shape")
    if not isinstance(shape, list) or len(shape) > 8:
        raise SpecError("a shape is a list of at most 8 sizes", source=source, field=f"{field}.shape",
                        value=shape if not isinstance(shape, str) else shape[:80])
    dims = tuple(_int(d, lo=0, hi=MAX_DIM, source=source, field=f"{field}.shape[{i}]") for i, d in enumerate(shape))
    n = 1
    for d in dims:
        n *= d
    if n > MAX_ELEMENTS:
        raise SpecError(f"a tensor of {n} elements", source=source, field=f"{field}.shape", value=list(dims),
                        valid=f"at most {MAX_ELEMENTS} elements")
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        raise SpecError("unknown dtype", source=source, field=f"{field}.dtype",
                        value=dtype if not isinstance(dtype, str) else dtype[:80], valid=", ".join(sorted(DTYPES)))
    return dims, dtype


def _check_files(files: Any, *, source: str) -> None:
    files = _mapping(files, source=source, field="files")
    for rel, entry in files.items():
        confined.parts_of(rel, root=source, field=f"files[{rel[:200]!r}]")
        if rel == "manifest.json":
            raise SpecError("the manifest cannot list itself", source=source, field="files", value=rel)
        entry = _mapping(entry, source=source, field=f"files.{rel}")
        _int(entry.get("bytes"), lo=0, hi=MAX_FILE_BYTES, source=source, field=f"files.{rel}.bytes")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise SpecError("not a sha256 hex digest", source=source, field=f"files.{rel}.sha256",
                            value=digest if not isinstance(digest, str) else digest[:80],
                            valid="64 lowercase hex digits")


def check_manifest(m: Any, *, source: str) -> dict[str, Any]:
    """The manifest, every field a reader uses checked (types, ranges, paths); SpecError naming the field."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise SpecError("not a tangram checkpoint manifest", source=source, field="format",
                        value=m.get("format") if isinstance(m, dict) else type(m).__name__, valid=FORMAT)
    if m.get("version") != FORMAT_VERSION or isinstance(m.get("version"), bool):
        raise SpecError("unsupported checkpoint format version", source=source, field="version",
                        value=m.get("version"), valid=str(FORMAT_VERSION))
    if "files" not in m:
        raise SpecError("manifest lists no files", source=source, field="files")
    _check_files(m["files"], source=source)
    if m.get("state_format", STATE_FORMATS[0]) not in STATE_FORMATS:
        raise SpecError("unknown checkpoint state format", source=source, field="state_format",
                        value=m.get("state_format"), valid=", ".join(STATE_FORMATS))
    for key, lo in (("step", 0), ("world_size", 1), ("num_stages", 1), ("num_layers", 0)):
        if key in m:
            _int(m[key], lo=lo, hi=MAX_INT, source=source, field=key)
    layers = m.get("layers", [])
    if not isinstance(layers, list):
        raise SpecError("must be a list of layer indices", source=source, field="layers", value=type(layers).__name__)
    for i, layer in enumerate(layers):
        _int(layer, lo=0, hi=MAX_DIM, source=source, field=f"layers[{i}]")
    for name, meta in _mapping(m.get("model", {}), source=source, field="model").items():
        check_tensor_meta(meta, source=source, field=f"model.{name}")
    for name, states in _mapping(m.get("optimizer", {}), source=source, field="optimizer").items():
        for k, meta in _mapping(states, source=source, field=f"optimizer.{name}").items():
            check_tensor_meta(meta, source=source, field=f"optimizer.{name}.{k}")
    if "has_optimizer" in m and not isinstance(m["has_optimizer"], bool):
        raise SpecError("must be true or false", source=source, field="has_optimizer", value=m["has_optimizer"])
    return m


__all__ = ["check_manifest", "check_tensor_meta", "DTYPES", "MAX_INT"]

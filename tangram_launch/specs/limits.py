"""What one input file may cost, in one place: every cluster, model, HF config and plan file is read through here.

A file input is refused (SpecError, exit 2, naming the file and the limit) when it

* is not a regular file (a FIFO would block the reader forever, ``/dev/zero`` never ends, a directory is not a
  file) or is larger than :data:`MAX_FILE_BYTES`;
* is not UTF-8 (the message gives the byte offset);
* nests deeper than :data:`MAX_DEPTH` (JSON or YAML; the parsers would otherwise recurse until RecursionError);
* expands, through YAML aliases, to more than :data:`MAX_NODES` values (the "billion laughs" bomb: a few hundred
  bytes that construct gigabytes of lists);
* holds an integer of more than :data:`MAX_INT_DIGITS` digits (Python refuses above 4,300 anyway, with a
  ValueError that used to escape as a traceback).

Sizes that parse but are physically absurd (a node with 10^30 GPUs, 10^9 layers) are bounded by the spec
classes, with the limits defined here so that they are stated once.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import stat
import threading
from collections import OrderedDict
from typing import Any

from tangram_launch.errors import SpecError

MAX_FILE_BYTES = 16 << 20  # the biggest real input (a profiled 1,000-GPU cluster) is well under 1 MiB
MAX_DEPTH = 64  # real inputs nest 6 levels
MAX_NODES = 1_000_000  # values after alias expansion
MAX_INT_DIGITS = 30

# physically absurd sizes (the spec classes refuse above these)
MAX_GPUS_PER_NODE = 1024
MAX_NODES_PER_CLUSTER = 100_000
MAX_LAYERS = 10_000  # the largest published dense models have ~126 layers
MAX_MODEL_DIM = 1 << 20  # hidden/ffn size, vocabulary, heads, experts, sequence length
MAX_TFLOPS = 1e6  # per device: ~1,000x today's largest accelerator
MAX_GLOBAL_BATCH = 1 << 24  # sequences per iteration


def read_bytes(path: str | os.PathLike, *, what: str = "file", limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, else a SpecError naming it."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SpecError(f"{what} not found", source=path) from None
    except OSError as exc:
        raise SpecError(f"cannot read {what}: {exc.strerror}", source=path) from None
    if stat.S_ISDIR(st.st_mode):
        raise SpecError(f"is a directory, not a {what}", source=path)
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or \
            stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file"
        raise SpecError(f"is {kind}; a {what} must be a regular file", source=path)
    if st.st_size > limit:
        raise SpecError(f"{what} is {st.st_size} bytes, more than the {limit} allowed", source=path)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise SpecError(f"cannot read {what}: {exc.strerror}", source=path) from None
    if len(data) > limit:
        raise SpecError(f"{what} is more than the {limit} bytes allowed", source=path)
    return data


def decode(data: bytes, *, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r})",
                        source=source) from None


def read_text(path: str | os.PathLike, *, what: str = "file") -> str:
    return decode(read_bytes(path, what=what), source=os.fspath(path))


def _json_depth_ok(text: str, quotes: str = '"') -> bool:
    """Bracket depth of the text outside quoted strings at most MAX_DEPTH (a linear scan: the parsers would take
    seconds, or recurse until RecursionError, on 100,000 nested brackets)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return True
    depth = 0
    quote = ""
    escaped = False
    for ch in text:
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\" and quote == '"':
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in quotes:
            quote = ch
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _bad_float(text: str) -> float:
    raise ValueError(f"{text} is not a number JSON allows")


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def parse_json(text: str, *, source: str) -> Any:
    """JSON within the limits (NaN and Infinity refused: they are not JSON, and no field takes them)."""
    if not _json_depth_ok(text):
        raise SpecError(f"nested deeper than {MAX_DEPTH} levels", source=source)
    try:
        data = json.loads(text, parse_constant=_bad_float, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise SpecError(f"key {exc.key!r} given twice in one object; JSON readers keep the second silently",
                        source=source, field=exc.key, valid="each key once") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}", source=source) from None
    except (ValueError, RecursionError) as exc:  # 5,000-digit integers, NaN, ...
        raise SpecError(f"malformed JSON: {str(exc).splitlines()[0][:200]}", source=source) from None
    check_values(data, source=source)
    return data


def check_values(data: Any, *, source: str) -> None:
    """Depth, value count and integer size of parsed data (JSON or YAML), without recursion."""
    stack = [(data, 1)]
    count = 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise SpecError(f"holds more than {MAX_NODES} values", source=source)
        if depth > MAX_DEPTH:
            raise SpecError(f"nested deeper than {MAX_DEPTH} levels", source=source)
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if value.bit_length() > MAX_INT_DIGITS * 3.33:
                raise SpecError(f"an integer of more than {MAX_INT_DIGITS} digits", source=source,
                                value=f"{str(value)[:20]}...")
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


class _ParsedTexts:
    """The values of the YAML texts parsed last, kept as pickles: the loaders read the same presets, catalog and
    cluster files many times per process, and PyYAML's pure-Python reader (which keeps line and column for the
    error messages) costs milliseconds a file. A text within the limits parses to the same values whatever its
    source, so the text alone is the key. Each use unpickles a fresh copy (a caller may change what it gets;
    values an alias shares stay shared); texts that fail are not kept, so every error is raised afresh, naming
    its source."""

    def __init__(self, *, entries: int, text_chars: int) -> None:
        self._entries = entries
        self._text_chars = text_chars
        self._kept: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> bytes | None:
        with self._lock:
            kept = self._kept.get(text)
            if kept is not None:
                self._kept.move_to_end(text)
            return kept

    def put(self, text: str, data: Any) -> None:
        if len(text) > self._text_chars:
            return
        blob = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._kept[text] = blob
            self._kept.move_to_end(text)
            while len(self._kept) > self._entries:
                self._kept.popitem(last=False)


_PARSED_YAML = _ParsedTexts(entries=256, text_chars=256 << 10)  # at most 64 MiB of texts, a few of real inputs


def parse_yaml(text: str, *, source: str) -> Any:
    """YAML (safe types only) within the limits: alias expansion and depth are checked on the node graph, before
    anything is constructed, so a bomb costs no memory. A text parsed before comes back from a kept copy
    (:class:`_ParsedTexts`)."""
    kept = _PARSED_YAML.get(text)
    if kept is not None:
        return pickle.loads(kept)
    data = _parse_yaml(text, source=source)
    _PARSED_YAML.put(text, data)
    return data


def _parse_yaml(text: str, *, source: str) -> Any:
    import yaml

    if not _json_depth_ok(text, quotes="\"'"):
        raise SpecError(f"nested deeper than {MAX_DEPTH} levels", source=source)
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # its reader refuses control characters (NUL, \x01, ...) right here
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise SpecError(f"nested deeper than {MAX_DEPTH} levels", source=source) from None
        if node is None:
            return None
        _check_yaml_nodes(node, source)
        try:
            data = loader.construct_document(node)
        except (ValueError, OverflowError) as exc:  # 5,000-digit integers (Python's int limit), ...
            raise SpecError(f"malformed YAML value: {str(exc).splitlines()[0][:200]}", source=source) from None
    except yaml.reader.ReaderError as exc:
        line, column = _line_column(text, exc.position)
        raise SpecError(f"malformed YAML at line {line}, column {column}: control character {exc.character:#06x} "
                        "(YAML allows tab, newline and printable characters only)", source=source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"malformed YAML{where}: {problem}", source=source) from None
    finally:
        if loader is not None:
            loader.dispose()
    check_values(data, source=source)
    return data


def _line_column(text: str, position: int) -> tuple[int, int]:
    """1-based line and column of a character offset."""
    before = text[:position]
    return before.count("\n") + 1, position - (before.rfind("\n") + 1) + 1


def _check_yaml_nodes(root: Any, source: str) -> None:
    """Expanded size (aliases counted every time they are used) and depth of a YAML node graph, memoized."""
    import yaml

    size: dict[int, int] = {}
    depth_of: dict[int, int] = {}
    order, stack, seen = [], [root], set()
    while stack:  # post-order without recursion
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            _check_duplicate_keys(node, source)
            for k, v in node.value:
                stack.extend((k, v))
    for node in reversed(order):
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [c for kv in node.value for c in kv]
        else:
            children = []
        total = 1 + sum(size.get(id(c), 1) for c in children)
        size[id(node)] = min(total, MAX_NODES + 1)
        depth_of[id(node)] = 1 + max((depth_of.get(id(c), 1) for c in children), default=0)
        if size[id(node)] > MAX_NODES:
            raise SpecError(f"expands to more than {MAX_NODES} values (YAML aliases)", source=source)
        if depth_of[id(node)] > MAX_DEPTH:
            raise SpecError(f"nested deeper than {MAX_DEPTH} levels", source=source)


def _check_duplicate_keys(node: Any, source: str) -> None:
    """A key given twice in one mapping: YAML loaders keep the last silently, so an edit meant to replace a value
    (or a block pasted twice) would plan something other than either line says."""
    import yaml

    first: dict[tuple[str, str], Any] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        seen = first.setdefault((key.tag, key.value), key)
        if seen is not key:
            a, b = seen.start_mark.line + 1, key.start_mark.line + 1
            where = f"lines {a} and {b}" if a != b else f"line {a}"
            raise SpecError(f"key {key.value!r} given twice in one mapping ({where}); YAML would keep the second "
                            "silently", source=source, field=key.value, valid="each key once")


def bounded_int(value: Any, *, field: str, source: str | None = None, low: int = 1, high: int) -> int:
    """An integer in [low, high] (not a bool, not a float such as 1.0), else a SpecError saying so."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError("expected an integer", source=source, field=field, value=value,
                        valid=f"an integer from {low} to {high}")
    if not low <= value <= high:
        raise SpecError("out of range", source=source, field=field, value=value,
                        valid=f"an integer from {low} to {high}")
    return value


def finite_number(value: Any, *, field: str, source: str | None = None, high: float = math.inf,
                  allow_zero: bool = False) -> float:
    """A finite number > 0 (>= 0 with allow_zero) and <= high, else a SpecError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError("expected a number", source=source, field=field, value=value)
    if isinstance(value, int) and value.bit_length() > 1000:
        raise SpecError("out of range", source=source, field=field, value=f"{str(value)[:20]}...",
                        valid=f"a number up to {high:g}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero) or v > high:
        raise SpecError("must be a finite number " + (">= 0" if allow_zero else "> 0") +
                        (f" and at most {high:g}" if math.isfinite(high) else ""), source=source, field=field,
                        value=value)
    return v


# --- the shape of a plan file (a frozen Plan or a hand-written one), checked before any conversion ---------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_plan_shape(d: Any, *, source: str | None) -> None:
    """Top-level field types of a Plan dict: int() and dict() would otherwise turn nonsense into values or
    tracebacks (``version: null``, ``stages: "x"``, ``model: "tiny"``, ``islands_used: true``)."""
    def bad(field: str, value: Any, valid: str) -> SpecError:
        return SpecError("wrong type", source=source, field=field, value=value, valid=valid)

    if "version" in d and not _is_int(d["version"]):
        raise bad("version", d["version"], "an integer (1)")
    if not _is_int(d.get("num_microbatches")) or d["num_microbatches"] < 1:
        raise bad("num_microbatches", d.get("num_microbatches"), "an integer >= 1")
    for key in ("model", "training", "predicted"):
        if not isinstance(d.get(key), dict):
            raise bad(key, d.get(key), "a mapping")
    for key in ("cluster", "planner"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise bad(key, d[key], "a mapping")
    for key in ("runtime", "schedule"):
        if key in d and not isinstance(d[key], str):
            raise bad(key, d[key], "a string")
    if not isinstance(d.get("stages"), list) or not d["stages"]:
        raise bad("stages", d.get("stages"), "a non-empty list of stage mappings")
    for i, st in enumerate(d["stages"]):
        if not isinstance(st, dict):
            raise bad(f"stages[{i}]", st, "a mapping")
    used = d.get("islands_used")
    if used is not None and (not isinstance(used, list) or not all(isinstance(x, str) for x in used)):
        raise bad("islands_used", used, "a list of island names")
    dropped = d.get("islands_dropped")
    if dropped is not None and (not isinstance(dropped, list) or not all(isinstance(x, dict) for x in dropped)):
        raise bad("islands_dropped", dropped, "a list of mappings")
    rows = d.get("rank_layout")
    if rows is not None and (not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows)):
        raise bad("rank_layout", rows, "a list of mappings")


def check_plan_stage(d: Any, *, where: str, source: str | None) -> None:
    """Integer fields of one stage are integers (1.0, 1.5, "3", NaN refused), within sane bounds."""
    for key in ("index", "tp", "dp", "cp", "ep", "zero_stage", "micro_batch_size", "num_gpus"):
        if key in d and not _is_int(d[key]):
            raise SpecError("expected an integer", source=source, field=f"{where}.{key}", value=d[key])
    layers = d.get("layers")
    if not isinstance(layers, list) or len(layers) != 2 or not all(_is_int(x) for x in layers):
        raise SpecError("layers must be [start, stop) as two integers", source=source, field=f"{where}.layers",
                        value=layers)
    gpus = d.get("gpus")
    if not isinstance(gpus, list) or not all(isinstance(g, dict) and _is_int(g.get("local_gpu")) for g in gpus):
        raise SpecError("gpus must be a list of {node, local_gpu}", source=source, field=f"{where}.gpus", value=gpus)


def check_model_sizes(spec: Any) -> None:
    """ModelSpec sizes within :data:`MAX_LAYERS` / :data:`MAX_MODEL_DIM` (integers already checked)."""
    if spec.num_layers > MAX_LAYERS:
        raise SpecError("more layers than any model this planner is meant for", field="num_layers",
                        value=spec.num_layers, valid=f"an integer from 1 to {MAX_LAYERS}")
    for name in ("hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "max_seq_len",
                 "num_experts", "top_k", "num_shared_experts", "moe_layer_frequency"):
        value = getattr(spec, name, 0)
        if isinstance(value, int) and value > MAX_MODEL_DIM:
            raise SpecError("physically absurd size", field=name, value=value,
                            valid=f"an integer up to {MAX_MODEL_DIM}")


def check_output_path(path: str | None, *, option: str) -> None:
    """An output file can be written: its directory exists and it is not itself a directory (checked up front,
    before any planning, so a long run does not end in a traceback at the last step)."""
    if path is None:
        return
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise SpecError("is a directory; give a file name", field=option, value=path)
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise SpecError(f"the directory {parent} does not exist", field=option, value=path,
                        valid="a file in an existing directory")
    if not os.access(parent, os.W_OK):
        raise SpecError(f"the directory {parent} is not writable", field=option, value=path)


def check_training_sizes(global_batch: int, seq_len: int) -> None:
    """A global batch or sequence length no run could use (10^10 sequences made the micro-batch search hang)."""
    if global_batch > MAX_GLOBAL_BATCH:
        raise SpecError("larger than any global batch a run uses", field="global_batch", value=global_batch,
                        valid=f"an integer from 1 to {MAX_GLOBAL_BATCH}")
    if seq_len > MAX_MODEL_DIM:
        raise SpecError("longer than any sequence a run uses", field="seq_len", value=seq_len,
                        valid=f"an integer from 1 to {MAX_MODEL_DIM}")


def check_cli_args(args: Any) -> None:
    """The numeric and output options of the planning commands, before any work (one call per command)."""
    for option in ("output", "stages_out", "timeline", "draw"):
        check_output_path(getattr(args, option, None), option="--" + option.replace("_", "-"))
    for option in ("global_batch", "seq_len", "workers", "mbs", "tp", "pp", "dp", "cp", "ep"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            raise SpecError("must be a positive integer", field="--" + option.replace("_", "-"), value=value,
                            valid="an integer >= 1")
    after = getattr(args, "stages_after", None)
    if after is not None and after < 0:
        raise SpecError("must not be negative", field="--stages-after", value=after, valid="an integer >= 0")
    for option in ("balance_tolerance", "eps_compute", "eps_memory", "eps_interconnect"):
        value = getattr(args, option, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise SpecError("must be a finite number >= 0", field="--" + option.replace("_", "-"), value=value)

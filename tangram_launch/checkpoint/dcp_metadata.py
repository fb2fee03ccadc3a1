"""DCP's ``.metadata`` read as data: its pickle stream interpreted here, never by ``pickle``.

torch 2.13 writes DCP metadata only as a pickle (``FileSystemWriter.finish``), so it has to be read as one. A
``pickle.Unpickler`` with a restricted ``find_class`` is not a boundary: it still runs ``BUILD`` (``__setstate__``,
``__dict__`` updates, ``setattr``) on any object an allowed name reaches, a class included, so a planted file could
set attributes on ``pathlib.PurePosixPath`` or a DCP class for the whole process. Here ``pickletools.genops`` splits
the stream into opcodes (it builds nothing) and a small stack machine builds:

* plain data: None, bool, int, float, str, bytes, tuple, list, dict;
* leaf values from the names a DCP metadata file uses: ``torch.Size`` of non-negative ints, torch dtypes and
  layouts, members of DCP's ``_MEM_FORMAT_ENCODING`` enum (by value, or by name through ``getattr`` as some Python
  builds write enums), pure paths of strings, and ``OrderedDict`` (a plain dict);
* at the end, fresh instances of DCP's metadata dataclasses (``NEWOBJ`` with no arguments, then one ``BUILD``),
  each constructed by its own ``__init__`` from fields whose types are checked first.

No other name is looked up, nothing else is called, and no state outside the returned object is touched. Any other
opcode, name or shape of data is refused with :class:`UnsafeCheckpointError` (exit status 2), nothing executed.
"""
from __future__ import annotations

import pathlib
import pickletools
from dataclasses import dataclass, fields
from typing import Any

from tangram_launch.errors import SpecError

_DCP = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_MAX_DEPTH = 100
_MAX_DIM = 1 << 62
_PATHS = frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"})


class UnsafeCheckpointError(SpecError):
    """A checkpoint file that would run code or is not what the format allows: refused, nothing was executed."""


@dataclass(frozen=True)
class _Global:
    """A name the stream asked for; what it may do is decided by this module, not by the name's object."""

    module: str
    name: str


class _Pending:
    """An instance of an allowed class announced by NEWOBJ; built at the end from the state BUILD gave it."""

    __slots__ = ("cls", "state", "built")

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.state: Any = None
        self.built = False


class _Reader:
    def __init__(self, *, source: str, allow_bytes: bool) -> None:
        import torch
        from torch.distributed.checkpoint import metadata as md
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        self.torch = torch
        self.md = md
        self.source = source
        self.classes: dict[tuple[str, str], type] = {
            (_DCP, n): getattr(md, n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                                "ChunkStorageMetadata", "MetadataIndex", "StorageMeta")}
        self.classes[(_FS, "_StorageInfo")] = _StorageInfo
        if allow_bytes:
            self.classes[(_DCP, "BytesStorageMetadata")] = md.BytesStorageMetadata
        self.mem_enum = md._MEM_FORMAT_ENCODING
        self.storage_info = _StorageInfo

    def refuse(self, message: str, **kw: Any) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(message, source=self.source, **kw)

    # --- names and calls --------------------------------------------------------------------------------------

    def global_(self, module: Any, name: Any) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.refuse("a global name that is not text", field="pickle global", value=repr(name)[:80])
        key = (module, name)
        if key in self.classes or key in {(_DCP, "_MEM_FORMAT_ENCODING"), ("torch", "Size"),
                                         ("torch.serialization", "_get_layout"), ("builtins", "getattr"),
                                         ("collections", "OrderedDict")} or (module == "pathlib" and name in _PATHS):
            return _Global(module, name)
        if module == "torch" and name.isidentifier() and not name.startswith("_"):
            value = getattr(self.torch, name, None)
            if isinstance(value, self.torch.dtype):
                return value
        raise self.refuse(f"refusing to load {module}.{name}: a checkpoint's metadata may only name DCP's metadata "
                          "classes, torch.Size and dtypes (someone may have planted code in this checkpoint; nothing "
                          "was executed)", field="pickle global", value=f"{module}.{name}"[:200])

    def call(self, fn: Any, args: Any) -> Any:
        torch = self.torch
        if not isinstance(fn, _Global) or not isinstance(args, tuple) or (fn.module, fn.name) in self.classes:
            raise self.refuse("refusing a call in checkpoint metadata", field="pickle REDUCE",
                              value=getattr(fn, "name", type(fn).__name__))
        key = (fn.module, fn.name)
        if key == ("torch", "Size"):
            dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else None
            if dims is None or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in dims):
                raise self.refuse("torch.Size of anything but non-negative ints", field="torch.Size",
                                  value=repr(args)[:80])
            return torch.Size(dims)
        if key == ("torch.serialization", "_get_layout"):
            name = args[0] if len(args) == 1 and isinstance(args[0], str) else ""
            value = getattr(torch, name.removeprefix("torch."), None) if name.startswith("torch.") else None
            if not isinstance(value, torch.layout):
                raise self.refuse("unknown tensor layout", field="layout", value=repr(args)[:80])
            return value
        if key == (_DCP, "_MEM_FORMAT_ENCODING"):
            members = {m.value: m for m in self.mem_enum}
            if len(args) != 1 or type(args[0]) is not int or args[0] not in members:
                raise self.refuse("unknown memory format", field="memory_format", value=repr(args)[:80])
            return members[args[0]]
        if key == ("builtins", "getattr"):
            cls = args[0] if len(args) == 2 else None
            name = args[1] if len(args) == 2 else None
            if cls == _Global(_DCP, "_MEM_FORMAT_ENCODING") and isinstance(name, str) \
                    and name in self.mem_enum.__members__:
                return self.mem_enum.__members__[name]
            raise self.refuse(f"refusing getattr({getattr(cls, 'name', type(cls).__name__)}, {name!r}): checkpoint "
                              "metadata may look up enum members only (nothing was executed)", field="pickle getattr",
                              value=repr(name)[:80])
        if fn.module == "pathlib":
            if not all(isinstance(a, str) for a in args):
                raise self.refuse("a path of anything but strings", field="path", value=repr(args)[:80])
            return pathlib.PurePosixPath(*args)
        # collections.OrderedDict: a plain dict (pickled as OrderedDict() followed by SETITEMS, or of pairs)
        pairs = args[0] if len(args) == 1 else []
        if len(args) > 1 or not isinstance(pairs, (list, tuple)) or \
                not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise self.refuse("an OrderedDict of anything but pairs", field="OrderedDict", value=repr(args)[:80])
        return self.setitems({}, [x for p in pairs for x in p])

    def new(self, cls: Any, args: Any, kwargs: Any = None) -> _Pending:
        if not isinstance(cls, _Global) or (cls.module, cls.name) not in self.classes:
            name = f"{cls.module}.{cls.name}" if isinstance(cls, _Global) else type(cls).__name__
            raise self.refuse(f"refusing to load {name}: not a DCP metadata class", field="pickle NEWOBJ", value=name)
        if args != () or kwargs not in (None, {}):
            raise self.refuse("refusing constructor arguments in checkpoint metadata", field=cls.name)
        return _Pending(self.classes[(cls.module, cls.name)])

    def setitems(self, target: Any, items: list) -> Any:
        if not isinstance(target, dict) or len(items) % 2:
            raise self.refuse("SETITEMS onto something that is not a dict", field="pickle SETITEMS")
        for k, v in zip(items[::2], items[1::2]):
            try:
                target[k] = v
            except TypeError:
                raise self.refuse("an unhashable dict key", field="pickle SETITEMS", value=type(k).__name__) from None
        return target

    # --- the stack machine ------------------------------------------------------------------------------------

    def run(self, data: bytes) -> Any:
        stack: list[Any] = []
        marks: list[int] = []
        memo: dict[int, Any] = {}

        def pop_mark() -> list:
            if not marks:
                raise self.refuse("a pickle that pops a mark it never set", field="pickle")
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            return items

        def pop() -> Any:
            if not stack:
                raise self.refuse("a pickle that pops an empty stack", field="pickle")
            return stack.pop()

        try:
            ops = list(pickletools.genops(data))
        except Exception as exc:  # ValueError and friends from a malformed or truncated stream
            raise self.refuse(f"not a readable pickle ({type(exc).__name__}: {str(exc)[:200]})") from None
        for op, arg, pos in ops:
            name = op.name
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                if len(stack) != 1 or marks:
                    raise self.refuse("a pickle that ends with a stack of more than one value", field="pickle")
                return self.finish(stack[0], 0, {})
            if name == "MARK":
                marks.append(len(stack))
            elif name == "POP":
                if stack and (not marks or marks[-1] < len(stack)):
                    stack.pop()
                else:
                    pop_mark()
            elif name == "POP_MARK":
                pop_mark()
            elif name == "DUP":
                stack.append(stack[-1] if stack else pop())
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else pop()
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1] if stack else pop()
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise self.refuse(f"a pickle that reads memo entry {arg} it never wrote", field="pickle")
                stack.append(memo[arg])
            elif name in ("NONE", "NEWTRUE", "NEWFALSE"):
                stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[name])
            elif name in ("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
                          "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
                          "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"):
                stack.append(arg)
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = [pop() for _ in range(n)][::-1]
                stack.append(tuple(items))
            elif name == "TUPLE":
                stack.append(tuple(pop_mark()))
            elif name == "EMPTY_LIST":
                stack.append([])
            elif name == "LIST":
                stack.append(pop_mark())
            elif name in ("APPEND", "APPENDS"):
                items = [pop()] if name == "APPEND" else pop_mark()
                target = stack[-1] if stack else None
                if not isinstance(target, list):
                    raise self.refuse(f"{name} onto something that is not a list", field="pickle")
                target.extend(items)
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "DICT":
                stack.append(self.setitems({}, pop_mark()))
            elif name in ("SETITEM", "SETITEMS"):
                if name == "SETITEM":
                    v = pop()
                    items = [pop(), v]
                else:
                    items = pop_mark()
                self.setitems(stack[-1] if stack else None, items)
            elif name == "GLOBAL":
                module, _, gname = str(arg).partition(" ")
                stack.append(self.global_(module, gname))
            elif name == "STACK_GLOBAL":
                gname = pop()
                stack.append(self.global_(pop(), gname))
            elif name == "REDUCE":
                args = pop()
                stack.append(self.call(pop(), args))
            elif name == "NEWOBJ":
                args = pop()
                stack.append(self.new(pop(), args))
            elif name == "NEWOBJ_EX":
                kwargs, args = pop(), pop()
                stack.append(self.new(pop(), args, kwargs))
            elif name == "BUILD":
                state = pop()
                target = stack[-1] if stack else None
                if not isinstance(target, _Pending) or target.state is not None:
                    raise self.refuse("refusing BUILD onto anything but a fresh DCP metadata object (it would set "
                                      "attributes on it)", field="pickle BUILD",
                                      value=getattr(target, "name", type(target).__name__))
                target.state = state
            else:
                raise self.refuse(f"refusing pickle opcode {name} at byte {pos} (not used by checkpoint metadata; "
                                  "nothing was executed)", field="pickle opcode", value=name)
        raise self.refuse("a pickle without STOP", field="pickle")

    # --- building the result ----------------------------------------------------------------------------------

    def finish(self, value: Any, depth: int, done: dict[int, Any]) -> Any:
        torch = self.torch
        if depth > _MAX_DEPTH:
            raise self.refuse(f"checkpoint metadata nested more than {_MAX_DEPTH} deep", field="pickle")
        if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Size, torch.dtype, torch.layout,
                                               pathlib.PurePath, self.mem_enum)):
            return value
        key = id(value)
        if key in done:
            if done[key] is _IN_PROGRESS:
                raise self.refuse("checkpoint metadata that contains itself", field="pickle")
            return done[key]
        done[key] = _IN_PROGRESS
        if isinstance(value, tuple):
            out: Any = tuple(self.finish(v, depth + 1, done) for v in value)
        elif isinstance(value, list):
            out = [self.finish(v, depth + 1, done) for v in value]
        elif isinstance(value, dict):
            out = {}
            for k, v in value.items():
                out[self.finish(k, depth + 1, done)] = self.finish(v, depth + 1, done)
        elif isinstance(value, _Pending):
            out = self.build(value, depth, done)
        else:
            raise self.refuse("a class or function where checkpoint metadata holds data", field="pickle",
                              value=getattr(value, "name", type(value).__name__))
        done[key] = out
        return out

    def build(self, pending: _Pending, depth: int, done: dict[int, Any]) -> Any:
        cls, md = pending.cls, self.md
        state = self.finish(pending.state, depth + 1, done)
        if cls is md.TensorProperties:
            return self.tensor_properties(state)
        if state is None:
            state = {}
        names = {f.name for f in fields(cls) if f.init}
        if not isinstance(state, dict) or not all(isinstance(k, str) and k in names for k in state):
            raise self.refuse(f"{cls.__name__} with fields it does not have", field=cls.__name__,
                              value=sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__,
                              valid=", ".join(sorted(names)))
        self.check_fields(cls, state)
        return cls(**state)

    def tensor_properties(self, state: Any) -> Any:
        torch, md = self.torch, self.md
        formats = {"TORCH_CONTIGUOUS_FORMAT": torch.contiguous_format, "TORCH_CHANNELS_LAST": torch.channels_last,
                   "TORCH_PRESERVE_FORMAT": torch.preserve_format}
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[0], torch.dtype)
                and isinstance(state[1], torch.layout) and isinstance(state[2], bool)
                and isinstance(state[3], self.mem_enum) and isinstance(state[4], bool)):
            raise self.refuse("TensorProperties that are not (dtype, layout, requires_grad, memory format, "
                              "pin_memory)", field="TensorProperties", value=repr(state)[:120])
        return md.TensorProperties(dtype=state[0], layout=state[1], requires_grad=state[2],
                                   memory_format=formats[state[3].name], pin_memory=state[4])

    def check_fields(self, cls: type, state: dict[str, Any]) -> None:
        torch, md = self.torch, self.md

        def want(name: str, ok: bool, valid: str) -> None:
            if name in state and not ok:
                raise self.refuse(f"{cls.__name__}.{name} of the wrong type", field=f"{cls.__name__}.{name}",
                                  value=type(state[name]).__name__, valid=valid)

        def of(name: str, *types: Any) -> bool:
            return isinstance(state.get(name), types)

        def plain(v: Any) -> bool:
            if isinstance(v, (list, tuple)):
                return all(plain(x) for x in v)
            if isinstance(v, dict):
                return all(plain(k) and plain(x) for k, x in v.items())
            return v is None or isinstance(v, (bool, int, float, str, bytes))

        sizes = (torch.Size,)
        if cls is md.Metadata:
            entries = state.get("state_dict_metadata")
            want("state_dict_metadata", isinstance(entries, dict) and all(isinstance(k, str) for k in entries),
                 "a dict from names to storage metadata")
            storage = state.get("storage_data")
            want("storage_data", storage is None or (isinstance(storage, dict) and all(
                isinstance(k, md.MetadataIndex) and isinstance(v, self.storage_info) for k, v in storage.items())),
                 "a dict from MetadataIndex to _StorageInfo")
            want("planner_data", plain(state.get("planner_data")), "plain data")
            want("storage_meta", of("storage_meta", md.StorageMeta, type(None)), "StorageMeta or None")
            want("version", of("version", str, type(None)), "a string")
        elif cls is md.TensorStorageMetadata:
            want("properties", of("properties", md.TensorProperties), "TensorProperties")
            want("size", of("size", *sizes), "torch.Size")
            chunks = state.get("chunks")
            want("chunks", isinstance(chunks, list) and all(isinstance(c, md.ChunkStorageMetadata) for c in chunks),
                 "a list of ChunkStorageMetadata")
        elif cls is md.ChunkStorageMetadata:
            want("offsets", of("offsets", *sizes), "torch.Size")
            want("sizes", of("sizes", *sizes), "torch.Size")
        elif cls is md.MetadataIndex:
            want("fqn", of("fqn", str), "a string")
            want("offset", of("offset", torch.Size, type(None)), "torch.Size or None")
            want("index", state.get("index") is None or type(state.get("index")) is int, "an int or None")
        elif cls is md.StorageMeta:
            want("checkpoint_id", of("checkpoint_id", str, pathlib.PurePath, type(None)), "a path")
            want("save_id", of("save_id", str, type(None)), "a string")
            want("load_id", of("load_id", str, type(None)), "a string")
            want("modules", isinstance(state.get("modules"), list) and all(
                isinstance(m, str) for m in state.get("modules", [])), "a list of strings")
        elif cls is self.storage_info:
            want("relative_path", of("relative_path", str), "a file name")
            for name in ("offset", "length"):
                want(name, type(state.get(name)) is int and 0 <= state[name] <= _MAX_DIM, "an int >= 0")
            want("transform_descriptors", not state.get("transform_descriptors"),
                 "none (Tangram and Megatron write untransformed shards)")


_IN_PROGRESS = object()


def loads_metadata(data: bytes, *, source: str, allow_bytes: bool = False) -> Any:
    """A DCP ``Metadata`` from the bytes of a ``.metadata`` file, built by this module (see the module doc)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    reader = _Reader(source=source, allow_bytes=allow_bytes)
    try:
        metadata = reader.run(data)
    except UnsafeCheckpointError:
        raise
    except (TypeError, ValueError, AttributeError, IndexError, KeyError) as exc:  # a constructor that disagreed
        raise UnsafeCheckpointError(f"unreadable checkpoint metadata ({type(exc).__name__}: {str(exc)[:200]})",
                                    source=source) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpointError("not a DCP Metadata object", source=source, value=type(metadata).__name__)
    kinds = (TensorStorageMetadata, BytesStorageMetadata) if allow_bytes else (TensorStorageMetadata,)
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, kinds):
            raise UnsafeCheckpointError("checkpoint metadata lists a non-tensor entry (Tangram checkpoints hold "
                                        "tensors only)", source=source, field=str(key), value=type(entry).__name__)
    return metadata


__all__ = ["UnsafeCheckpointError", "loads_metadata"]

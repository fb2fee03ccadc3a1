"""GPU catalog: spec-sheet figures per GPU type, read from a data file with a source per figure.

Hardware is data (STYLE.md): peak TFLOP/s, memory and bandwidths live in ``gpu_catalog.yaml`` beside this module,
never in code. The catalog fills the figures a cluster file does not give; the profiler's measurements win over it.

Names are looked up after normalisation, so the name NVML reports on a node resolves to the same entry as the short
name a user writes::

    >>> default_catalog().lookup("NVIDIA A100-SXM4-80GB").name
    'a100-80gb'
    >>> normalize_gpu_name("Tesla V100-SXM2-16GB")
    'v100-16gb'
"""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import DTYPES
from tangram_launch.specs.yamlio import check_keys, closest, load_yaml_file, require

INTERCONNECTS = ("nvlink", "pcie", "host")
# Figures that need a citation; "pcie_gen" only when it is not null.
FIGURES = (
    "tflops.bf16", "tflops.fp16", "tflops.fp32", "tflops.tf32", "tflops.fp8", "memory_gib", "memory_bandwidth_GBps",
    "intra_node_bandwidth_GBps", "pcie_gen",
)
_SOURCE_KEYS = FIGURES + ("interconnect",)

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "single": "fp32",
    "tf32": "tf32", "tensorfloat32": "tf32",
    "fp8": "fp8", "float8": "fp8",
}
# Dtypes added after the first catalog format: a GpuType built in code may leave them out (= unsupported).
_LATER_DTYPES = ("tf32", "fp8")

_CATALOG_FILE = "gpu_catalog.yaml"
_ENTRY_KEYS = (
    "display_name", "tflops", "memory_gib", "memory_bandwidth_GBps", "intra_node_bandwidth_GBps", "interconnect",
    "pcie_gen", "aliases", "sources",
)
_CANONICAL_RE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_REF_RE = re.compile(r"@([a-z0-9][a-z0-9-]*)")


# --- validation shared by GpuType and the file loader ----------------------------------------------------------

def _positive(value: Any, *, field: str, source: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecError("must be a positive number", source=source, field=field, value=value, valid="a number > 0")
    return float(value)


def _check_tflops(tflops: Any, *, where: str, source: str | None) -> dict[str, float | None]:
    if not isinstance(tflops, Mapping):
        raise SpecError("expected a mapping of dtype to dense TFLOP/s", source=source, field=f"{where}.tflops",
                        value=tflops, valid="{bf16: ..., fp16: ..., fp32: ...} (null = unsupported)")
    check_keys(tflops, DTYPES, where=f"{where}.tflops", source=source)
    out: dict[str, float | None] = {}
    for dt in DTYPES:
        if dt not in tflops and dt in _LATER_DTYPES and source is None:
            out[dt] = None
            continue
        if dt not in tflops:
            raise SpecError("missing dtype (write null if unsupported)", source=source, field=f"{where}.tflops.{dt}",
                            valid="a number > 0 or null")
        v = tflops[dt]
        out[dt] = None if v is None else _positive(v, field=f"{where}.tflops.{dt}", source=source)
    if all(v is None for v in out.values()):
        raise SpecError("no dtype is supported", source=source, field=f"{where}.tflops", value=dict(tflops),
                        valid="at least one of bf16, fp16, fp32 with a number")
    return out


def _required_sources(pcie_gen: int | None) -> tuple[str, ...]:
    return tuple(f for f in FIGURES if f != "pcie_gen" or pcie_gen is not None)


# --- the type ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuType:
    """One GPU model's spec-sheet figures (dense peaks; per GPU)."""

    name: str  # canonical key, e.g. "a100-80gb", "h100-sxm", "v100-16gb"
    display_name: str
    tflops: Mapping[str, float | None]  # dense peak per dtype "bf16"/"fp16"/"fp32"; None = unsupported
    memory_gib: float
    memory_bandwidth_GBps: float
    intra_node_bandwidth_GBps: float  # per-GPU bidirectional: NVLink if present, else PCIe x16
    interconnect: str  # "nvlink" | "pcie" | "host" (cpu placeholder)
    pcie_gen: int | None
    aliases: tuple[str, ...] = ()
    # figure name ("tflops.bf16", "memory_gib", ...) -> citation. The catalog file must cite every figure; a GpuType
    # built in code (a custom GPU, a test) may leave this empty.
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"gpu type '{self.name}'"
        if not isinstance(self.name, str) or not self.name:
            raise SpecError("a GPU type needs a name", field="name", value=self.name)
        object.__setattr__(self, "tflops", MappingProxyType(_check_tflops(self.tflops, where=where, source=None)))
        for attr in ("memory_gib", "memory_bandwidth_GBps", "intra_node_bandwidth_GBps"):
            object.__setattr__(self, attr, _positive(getattr(self, attr), field=f"{where}.{attr}", source=None))
        if self.interconnect not in INTERCONNECTS:
            raise SpecError("unknown interconnect", field=f"{where}.interconnect", value=self.interconnect,
                            valid=", ".join(INTERCONNECTS))
        if self.pcie_gen is not None and (
            isinstance(self.pcie_gen, bool) or not isinstance(self.pcie_gen, int) or not 1 <= self.pcie_gen <= 7
        ):
            raise SpecError("bad PCIe generation", field=f"{where}.pcie_gen", value=self.pcie_gen,
                            valid="an integer 1-7 or null")
        object.__setattr__(self, "aliases", tuple(str(a) for a in self.aliases))
        sources = dict(self.sources)
        for key, text in sources.items():
            if key not in _SOURCE_KEYS:
                raise SpecError("source for an unknown figure", field=f"{where}.sources.{key}",
                                valid=", ".join(_SOURCE_KEYS))
            if not isinstance(text, str) or not text.strip():
                raise SpecError("empty source", field=f"{where}.sources.{key}", value=text,
                                valid="a citation (URL or document)")
        object.__setattr__(self, "sources", MappingProxyType(sources))

    def __hash__(self) -> int:  # the mapping fields are read-only proxies; hash their items
        return hash((self.name, self.display_name, tuple(sorted(self.tflops.items())), self.memory_gib,
                     self.memory_bandwidth_GBps, self.intra_node_bandwidth_GBps, self.interconnect, self.pcie_gen,
                     self.aliases))

    def supported_dtypes(self) -> tuple[str, ...]:
        return tuple(dt for dt in DTYPES if self.tflops.get(dt) is not None)

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak TFLOP/s for ``dtype``; SpecError if the GPU lacks it (bf16 on T4/V100), naming alternatives."""
        key = _DTYPE_ALIASES.get(str(dtype).lower().removeprefix("torch."))
        if key is None:
            raise SpecError("unknown dtype", field="dtype", value=dtype, valid=", ".join(DTYPES))
        value = self.tflops.get(key)
        if value is None:
            raise SpecError(f"{self.display_name} ({self.name}) has no {key} tensor support", field="dtype",
                            value=dtype, valid=", ".join(self.supported_dtypes()))
        return float(value)


# --- names ------------------------------------------------------------------------------------------------------

_VENDOR_TOKENS = frozenset({"nvidia", "tesla", "geforce"})
# Memory technology says nothing the memory size does not ("H100 80GB HBM3").
_MEMORY_TYPE_TOKENS = frozenset({"hbm", "hbm2", "hbm2e", "hbm3", "hbm3e", "gddr6", "gddr6x", "gddr7"})
_SIZE_RE = re.compile(r"(\d+)(?:gb|gib|g)")
# "80g" is in no catalog spelling: a lookup refuses it, suggesting the entries of that size (A100 80GB SXM or
# PCIe?), rather than match one silently. It still normalises to "80gb" so unknown hardware compares equal.
_BARE_SIZE_RE = re.compile(r"(\d+)g")
_SXM_RE = re.compile(r"sxm\d*")


def _tokens(name: str) -> list[str]:
    """Lower-case tokens without vendor prefixes: 'NVIDIA GeForce RTX 4090' -> ['rtx', '4090']."""
    s = str(name).strip().lower()
    s = s.replace("pci-e", "pcie").replace("pci express", "pcie")
    s = re.sub(r"[\s_\-/]+", "-", s).strip("-")
    s = re.sub(r"^rtx(?=\d)", "rtx-", s)  # rtx4090 -> rtx-4090
    out: list[str] = []
    for tok in s.split("-"):
        if not tok or (not out and tok in _VENDOR_TOKENS) or tok in _MEMORY_TYPE_TOKENS:
            continue
        m = _SIZE_RE.fullmatch(tok)
        if m:
            tok = f"{m.group(1)}gb"
        elif _SXM_RE.fullmatch(tok):
            tok = "sxm"  # SXM2/SXM4/SXM5 are one form factor across generations
        out.append(tok)
    return out


def _key(tokens: list[str]) -> str:
    """Order-insensitive after the model token: 'a100-80gb-pcie' and 'a100-pcie-80gb' are one key."""
    if not tokens:
        return ""
    return "-".join([tokens[0]] + sorted(tokens[1:]))


def _bare_sizes(name: str) -> list[str]:
    """Memory sizes written without their unit ("80g" -> "80gb")."""
    toks = re.split(r"[\s_\-/]+", str(name).strip().lower())
    return [f"{m.group(1)}gb" for t in toks if (m := _BARE_SIZE_RE.fullmatch(t))]


def _lookup_keys(name: str) -> list[str]:
    """Keys to try, most specific first. SXM is the default form of V100/A100/H100, so 'sxm' may be dropped.
    None for a name with a bare size: it is ambiguous, never matched."""
    if _bare_sizes(name):
        return []
    toks = _tokens(name)
    keys = [_key(toks)]
    if "sxm" in toks:
        keys.append(_key([t for t in toks if t != "sxm"]))
    return keys


# --- the catalog ------------------------------------------------------------------------------------------------

class GpuCatalog:
    """Lookup of GpuType by canonical name, alias or NVML name (normalised)."""

    def __init__(self, types: Mapping[str, GpuType] | list[GpuType], *, source: str | None = None) -> None:
        items = list(types.values()) if isinstance(types, Mapping) else list(types)
        self._types: dict[str, GpuType] = {}
        self._index: dict[str, str] = {}
        self.source = source
        for t in items:
            if t.name in self._types:
                raise SpecError("duplicate GPU type", source=source, field=f"gpus.{t.name}", value=t.name)
            self._types[t.name] = t
        for t in items:
            for spelling in (t.name, t.display_name, *t.aliases):
                key = _key(_tokens(spelling))
                if not key:
                    raise SpecError("empty alias", source=source, field=f"gpus.{t.name}.aliases", value=spelling)
                other = self._index.setdefault(key, t.name)
                if other != t.name:
                    raise SpecError(f"ambiguous name: it normalises to '{key}', as does a name of '{other}'",
                                    source=source, field=f"gpus.{t.name}.aliases", value=spelling,
                                    valid="aliases unique across GPU types")

    # -- construction --
    @classmethod
    def from_dict(cls, data: Mapping, *, source: str | None = None) -> "GpuCatalog":
        """Build and validate a catalog from the data file's mapping (every figure positive and cited)."""
        if not isinstance(data, Mapping):
            raise SpecError("expected a mapping", source=source, value=type(data).__name__)
        check_keys(data, ("schema_version", "references", "gpus"), where="", source=source)
        version = data.get("schema_version", 1)
        if version != 1:
            raise SpecError("unsupported catalog schema version", source=source, field="schema_version",
                            value=version, valid="1")
        refs = data.get("references") or {}
        if not isinstance(refs, Mapping):
            raise SpecError("expected a mapping of id to citation", source=source, field="references", value=refs)
        for rid, text in refs.items():
            if not isinstance(text, str) or not text.strip():
                raise SpecError("empty reference", source=source, field=f"references.{rid}", value=text)
        gpus = require(data, "gpus", where="", source=source)
        if not isinstance(gpus, Mapping) or not gpus:
            raise SpecError("expected a non-empty mapping of GPU name to figures", source=source, field="gpus",
                            value=gpus)
        return cls([_parse_entry(name, entry, refs, source=source) for name, entry in gpus.items()], source=source)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "GpuCatalog":
        path = os.fspath(path)
        return cls.from_dict(load_yaml_file(path), source=path)

    # -- queries --
    def lookup(self, name: str, *, field: str | None = None, source: str | None = None,
               otherwise: str | None = None) -> GpuType:
        """The GpuType for a canonical name, alias or NVML name; unknown -> SpecError suggesting the closest.

        ``otherwise`` ends the error's hint (e.g. how to give explicit figures instead).
        """
        if isinstance(name, GpuType):
            name = name.name
        for key in _lookup_keys(str(name)):
            canonical = self._index.get(key)
            if canonical is not None:
                return self._types[canonical]
        hint = self._suggest(str(name))
        raise SpecError("unknown GPU type", source=source, field=field, value=name,
                        valid=f"{hint}; {otherwise}" if otherwise else hint)

    def names(self) -> list[str]:
        return sorted(self._types)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return any(key in self._index for key in _lookup_keys(name))

    def __iter__(self) -> Iterator[GpuType]:
        return iter(self._types[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._types)

    def canonical_name(self, name: str) -> str | None:
        """Canonical name of ``name`` if known, else None (no exception)."""
        for key in _lookup_keys(name):
            if key in self._index:
                return self._index[key]
        return None

    def _suggest(self, name: str) -> str:
        """'Did you mean' text: the same model family first ('a100' -> its four variants), else the closest name."""
        toks = _tokens(name)
        model = toks[0] if toks else ""
        family = [n for n in self.names() if n.split("-")[0] == model]
        sizes = _bare_sizes(name)
        sized = [n for n in family if all(size in self._types[n].name.split("-") for size in sizes)]
        if sizes and sized:
            return (f"'{name}' is ambiguous: did you mean {' or '.join(sized)}? (a suggestion, not a match; "
                    f"sizes are written {sizes[0]})")
        if not family and len(model) >= 2:  # 'v100s' -> the v100 family
            family = [n for n in self.names()
                      if model.startswith(n.split("-")[0]) or n.split("-")[0].startswith(model)]
        if len(family) == 1:
            return f"did you mean '{family[0]}'?"
        if family:
            return f"did you mean one of {', '.join(family)}?"
        hint = closest("-".join(toks), self.names())
        known = ", ".join(self.names())
        if hint:
            return (f"not in the catalog: did you mean '{hint}'? (the closest spelling, a suggestion, not a match: "
                    f"if yours is another model, give its figures); known: {known}")
        return f"known: {known}"


def _resolve_source(text: Any, refs: Mapping, *, field: str, source: str | None) -> str:
    if not isinstance(text, str) or not text.strip():
        raise SpecError("missing source", source=source, field=field, value=text,
                        valid="a citation (URL or document) or '@<reference id>'")

    def sub(m: re.Match) -> str:
        rid = m.group(1)
        if rid not in refs:
            hint = closest(rid, [str(r) for r in refs])
            raise SpecError("unknown reference", source=source, field=field, value=f"@{rid}",
                            valid=(f"did you mean '@{hint}'? " if hint else "") + "an id under 'references'")
        return str(refs[rid])

    return _REF_RE.sub(sub, text)


def _parse_entry(name: Any, entry: Any, refs: Mapping, *, source: str | None) -> GpuType:
    where = f"gpus.{name}"
    if not isinstance(name, str) or not _CANONICAL_RE.fullmatch(name):
        raise SpecError("GPU type names are lower case words joined by '-'", source=source, field=where,
                        value=name, valid="e.g. a100-80gb, h100-sxm")
    if not isinstance(entry, Mapping):
        raise SpecError("expected a mapping of figures", source=source, field=where, value=entry)
    check_keys(entry, _ENTRY_KEYS, where=where, source=source)
    for key in _ENTRY_KEYS:
        if key not in entry:
            raise SpecError("missing field", source=source, field=f"{where}.{key}")
    tflops = _check_tflops(entry["tflops"], where=where, source=source)
    figures = {k: _positive(entry[k], field=f"{where}.{k}", source=source)
               for k in ("memory_gib", "memory_bandwidth_GBps", "intra_node_bandwidth_GBps")}
    interconnect = entry["interconnect"]
    if interconnect not in INTERCONNECTS:
        raise SpecError("unknown interconnect", source=source, field=f"{where}.interconnect", value=interconnect,
                        valid=", ".join(INTERCONNECTS))
    pcie_gen = entry["pcie_gen"]
    if pcie_gen is not None and (isinstance(pcie_gen, bool) or not isinstance(pcie_gen, int) or
                                 not 1 <= pcie_gen <= 7):
        raise SpecError("bad PCIe generation", source=source, field=f"{where}.pcie_gen", value=pcie_gen,
                        valid="an integer 1-7 or null")
    aliases = entry["aliases"] or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a.strip() for a in aliases):
        raise SpecError("expected a list of names", source=source, field=f"{where}.aliases", value=aliases)
    raw_sources = entry["sources"]
    if not isinstance(raw_sources, Mapping):
        raise SpecError("expected a mapping of figure to citation", source=source, field=f"{where}.sources",
                        value=raw_sources)
    check_keys(raw_sources, _SOURCE_KEYS, where=f"{where}.sources", source=source)
    sources: dict[str, str] = {}
    for fig in _required_sources(pcie_gen):
        if fig not in raw_sources:
            raise SpecError("figure without a source", source=source, field=f"{where}.sources.{fig}",
                            valid="a citation (URL or document) or '@<reference id>'")
    for fig, text in raw_sources.items():
        sources[fig] = _resolve_source(text, refs, field=f"{where}.sources.{fig}", source=source)
    display = entry["display_name"]
    if not isinstance(display, str) or not display.strip():
        raise SpecError("expected a non-empty name", source=source, field=f"{where}.display_name", value=display)
    return GpuType(
        name=name,
        display_name=display,
        tflops=tflops,
        interconnect=interconnect,
        pcie_gen=pcie_gen,
        aliases=tuple(aliases),
        sources=sources,
        **figures,
    )


@functools.lru_cache(maxsize=1)
def default_catalog() -> GpuCatalog:
    """The packaged catalog (``gpu_catalog.yaml``), loaded and validated once per process."""
    ref = resources.files("tangram_launch.specs").joinpath(_CATALOG_FILE)
    with resources.as_file(ref) as path:
        return GpuCatalog.from_file(path)


def normalize_gpu_name(name: str) -> str:
    """Canonical catalog name of ``name`` ("NVIDIA A100-SXM4-80GB" -> "a100-80gb").

    A name the default catalog does not know comes back in normal form (lower case, '-' separators, vendor prefix,
    SXM generation and memory type dropped), so equal hardware still compares equal.
    """
    canonical = default_catalog().canonical_name(name)
    if canonical is not None:
        return canonical
    toks = _tokens(name)
    return "-".join(toks)

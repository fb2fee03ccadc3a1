"""Layout-agnostic, atomic, verified checkpoints: save under one pipeline layout, resume under another.

Every rank hands over its state under *global* names (``embedding.*``, ``layers.<global i>.*``, ``head.*``; see
:mod:`tangram_launch.checkpoint.keys`) and the optimizer state keyed by the same names. Tensors go through
``torch.distributed.checkpoint`` (DCP): each rank writes its own shard file, replicas of a tensor (data-parallel
copies) are written once, and a rank of a new layout reads exactly the keys its new layer range needs, resharding
DTensors (FSDP2/TP) on the way in. Around the shards this module adds what makes a resume safe and exact::

    save:  gather key lists, check the layers are covered -> rank 0 makes step_<N>.tmp-<id>/ -> DCP shards, RNG
           states, plan, position (fsynced) -> ranks hash a share of the files each -> rank 0 writes manifest.json
           last and renames to step_<N>/ -> keep the last K
    load:  newest step_<N>/ with a manifest whose files all match (verified in parallel; torn or corrupt ones are
           skipped with a warning naming them) -> same model? (else SpecError naming the field) -> every key this
           rank needs present? (else SpecError naming the missing layers) -> DCP load -> optimizer -> RNG

On a worker (``tangram-launch --resume`` sets TANGRAM_RESUME_DIR; any directory works)::

    from tangram_launch.checkpoint import (LayerKeyMap, StageState, TrainingPosition, load_checkpoint,
                                           resume_directory, save_checkpoint)
    keys = LayerKeyMap.for_stage(place.stage, local_numbering="global")   # runtime_adapters.gpt names layers globally
    state = StageState.from_module(module, keys, optimizer)
    if resume_directory():
        loaded = load_checkpoint(resume_directory(), plan=plan, state=state)   # collective
        step, consumed = loaded.position.step, loaded.position.consumed_samples
    ...
    save_checkpoint("ckpt", plan=plan, state=state, position=TrainingPosition(step, consumed), keep_last=3)

Both calls are collective over every rank of the plan (the default process group; one process without one).
The directory must be on a filesystem every rank sees.
"""
from __future__ import annotations

import base64
import contextlib
import logging
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from tangram_launch.checkpoint import confined, guard
from tangram_launch.checkpoint import store
from tangram_launch.checkpoint.fields import check_tensor_meta
from tangram_launch.checkpoint.keys import (LayerKeyMap, NamedOptimizerState, format_layers, layer_of,
                                            load_optimizer_state_by_name, optimizer_state_by_name, part_of)
from tangram_launch.checkpoint.store import CheckpointInfo, Skipped, TrainingPosition, describe
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan

__all__ = ["LayerKeyMap", "StageState", "TrainingPosition", "LoadedCheckpoint", "CheckpointInfo", "Skipped",
           "save_checkpoint", "load_checkpoint", "describe", "resume_directory", "capture_rng_state",
           "restore_rng_state", "model_differences"]

STATE_FORMAT = "tangram-dcp"  # manifest "state_format" of checkpoints this module writes

logger = logging.getLogger(__name__)

RNG_MODES = ("auto", "per_rank", "global", "none")
# ModelSpec fields that do not change any tensor: a checkpoint loads across them
_MODEL_FIELDS_IGNORED = ("name", "citation", "description", "max_seq_len")
_MODEL_PREFIX = "model."
_OPTIM_PREFIX = "optim."


# --- what a rank hands over ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageState:
    """One rank's trainable state under global names.

    ``model``: global name -> live tensor (plain or DTensor); ``load_checkpoint`` copies into these tensors in
    place, so they must be the module's own (``module.state_dict()`` values are). ``param_names``: the optimizer's
    parameters -> global names (the optimizer's state is saved and loaded under these names).
    """

    model: Mapping[str, torch.Tensor]
    optimizer: torch.optim.Optimizer | None = None
    param_names: Mapping[torch.Tensor, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.model:
            part_of(name)  # SpecError for names outside the convention
        if self.optimizer is not None:
            named = {id(p) for p in self.param_names}
            for gi, group in enumerate(self.optimizer.param_groups):
                for p in group["params"]:
                    if id(p) not in named:
                        raise SpecError("every optimizer parameter needs a global name", field="param_names",
                                        value=f"param_groups[{gi}] parameter of shape {tuple(p.shape)}")

    @classmethod
    def from_module(cls, module: nn.Module, key_map: LayerKeyMap | Callable[[str], str],
                    optimizer: torch.optim.Optimizer | None = None) -> "StageState":
        """From a stage module (DDP is unwrapped): ``key_map`` is a LayerKeyMap or any local -> global renaming
        (DeepSpeed's PipelineModule names entries ``<i>.<param>`` over [embedding, layer 0, ..., head])."""
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(module, DistributedDataParallel):
            module = module.module
        rename = key_map.to_global if isinstance(key_map, LayerKeyMap) else key_map
        model: dict[str, torch.Tensor] = {}
        for key, value in module.state_dict().items():
            if not isinstance(value, torch.Tensor):  # e.g. Megatron/TE '_extra_state' entries that are None
                continue
            name = rename(key)
            if name in model:
                raise SpecError("two local state names map to one global name", field="state key", value=[key, name])
            model[name] = value
        names = {p: rename(n) for n, p in module.named_parameters()}
        return cls(model=model, optimizer=optimizer, param_names=names)


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: str
    step: int
    position: TrainingPosition
    saved_plan: Plan  # the plan the checkpoint was written under
    rng: str  # how RNG states were restored: per_rank | global | none
    skipped: tuple[Skipped, ...]  # newer checkpoints passed over (torn, corrupt), with reasons
    layout_changed: bool  # stages, layer ranges or grids differ from the saved plan's


def _layout(plan: Plan) -> tuple:
    """What makes two plans the same rank layout (per-rank RNG states only carry over between equal ones)."""
    return tuple((s.layers, s.tp, s.cp, s.dp, s.ep) for s in plan.stages)


def resume_directory() -> str | None:
    """The directory ``tangram-launch --resume DIR`` hands its workers (env TANGRAM_RESUME_DIR), or None; in a
    restart round (``--max-restarts``), the run's ``--checkpoint-dir`` once it holds a complete checkpoint."""
    from tangram_launch.checkpoint.rounds import resume_dir_for_round

    return resume_dir_for_round(os.environ)


# --- RNG ------------------------------------------------------------------------------------------------------------

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(bytes(t.cpu().tolist())).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """torch (CPU, and the current CUDA device's if CUDA is initialised), numpy and python RNG states as JSON."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"torch": _b64(torch.get_rng_state()),
                           "python": {"version": version, "state": list(internal), "gauss_next": gauss}}
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        np = None
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"name": name, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = _b64(torch.cuda.get_rng_state())
    return out


def restore_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


# --- collectives (nothing when there is no process group) ---------------------------------------------------------

@dataclass(frozen=True)
class Comm:
    """This rank within ``group`` and the few collectives a save or load needs (nothing without a process group)."""

    rank: int
    world_size: int
    group: Any
    distributed: bool

    @classmethod
    def create(cls, group: Any) -> "Comm":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(group), group, True)
        return cls(0, 1, None, False)

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def raise_any(self, error: str | None, what: str) -> None:
        """Collective: if any rank has an error, every rank raises one SpecError listing them (no rank hangs)."""
        errors = self.all_gather(error)
        if any(errors):
            by_text: dict[str, list[int]] = {}
            for r, e in enumerate(errors):
                if e:
                    by_text.setdefault(e, []).append(r)
            text = "; ".join(e if self.world_size == 1 else f"rank {', '.join(map(str, rs))}: {e}"
                             for e, rs in by_text.items())
            raise SpecError(f"{what}: {text}")

    def raise_first(self, error: SpecError | None, what: str) -> None:
        """Collective: a rank with an error raises it as it is; the others raise a SpecError naming it."""
        texts = self.all_gather(None if error is None else str(error))
        if error is not None:
            raise error
        failed = [(r, t) for r, t in enumerate(texts) if t]
        if failed:
            raise SpecError(f"{what}: " + "; ".join(f"rank {r}: {t}" for r, t in failed))


@contextlib.contextmanager
def _single_process_quiet(comm: Comm) -> Iterator[None]:
    """DCP warns on every single-process call that it assumes one process; here that is the intent."""
    with warnings.catch_warnings():
        if not comm.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _check_world(comm: Comm, plan: Plan) -> None:
    if comm.world_size != plan.world_size:
        raise SpecError("the job's world size differs from the plan's", field="world_size", value=comm.world_size,
                        valid=str(plan.world_size))


def _meta(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _owned_problem(state: StageState, plan: Plan, rank: int) -> str | None:
    stage = plan.place(rank).stage
    keys = [LayerKeyMap.for_stage(stage)]
    if stage.chunks:  # interleaved 1F1B: the stage holds its chunks' layers (plan.interleaved_chunks)
        keys = [LayerKeyMap(layers=c, has_embedding=stage.has_embedding, has_head=stage.has_head)
                for c in stage.chunks]
    foreign = sorted(k for k in state.model if not any(m.owns(k) for m in keys))
    if foreign:
        held = (f"chunks {[list(c) for c in stage.chunks]}" if stage.chunks
                else f"layers [{stage.layers[0]}, {stage.layers[1]})")
        return (f"stage {stage.index} ({held}, embedding="
                f"{stage.has_embedding}, head={stage.has_head}) hands over state it does not hold: "
                + ", ".join(foreign[:5]) + (f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else ""))
    return None


def _coverage_problem(model_keys: Mapping[str, Any], num_layers: int) -> str | None:
    """What a set of global keys lacks to be a whole model: layers, embedding, head."""
    have = {layer_of(k) for k in model_keys} - {None}
    missing = sorted(set(range(num_layers)) - have)
    parts = {part_of(k) for k in model_keys}
    lacks = []
    if missing:
        lacks.append(f"layers {format_layers(missing)}")
    lacks += [p for p in ("embedding", "head") if p not in parts]
    return ("no rank holds " + ", ".join(lacks)) if lacks else None


def model_differences(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, saved value, new value) for every ModelSpec field that changes the model's tensors.

    Both sides are compared as resolved ModelSpecs, so a field one plan leaves at its default (absent or None, e.g.
    ``dropout``) equals the default the other spells out."""
    saved, new = _resolved_model(saved), _resolved_model(new)
    out = []
    for key in sorted(set(saved) | set(new)):
        if key in _MODEL_FIELDS_IGNORED:
            continue
        a, b = saved.get(key), new.get(key)
        if a != b:
            out.append((key, a, b))
    return out


def _resolved_model(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """The model's fields with every default filled in (the mapping as it is when it is no valid ModelSpec)."""
    from tangram_launch.specs.model import ModelSpec

    try:
        return ModelSpec.from_dict(d).to_dict()
    except (SpecError, TypeError, ValueError):
        return d


# --- save -----------------------------------------------------------------------------------------------------------

def save_checkpoint(directory: str | os.PathLike, *, plan: Plan, state: StageState, position: TrainingPosition,
                    keep_last: int | None = 3, group: Any = None) -> str:
    """Write ``<directory>/step_<position.step>/`` atomically; collective over every rank of ``plan``.

    Returns the checkpoint's path. Nothing becomes visible unless every rank finished: a crash leaves only a
    ``.tmp-`` directory, which loading ignores and the next successful save removes. A complete checkpoint is never
    overwritten (same step again -> SpecError before anything is written) and only removed by ``keep_last``
    (None keeps all), after a newer one was committed.
    """
    directory = os.fspath(directory)
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise SpecError("must be a positive integer or None (keep all)", field="keep_last", value=keep_last)
    comm = Comm.create(group)
    _check_world(comm, plan)
    t0 = time.perf_counter()
    step = position.step
    named = (optimizer_state_by_name(state.optimizer, state.param_names) if state.optimizer is not None
             else NamedOptimizerState({}, {}, {}))

    # 1. every rank's key list: refuse a checkpoint that would not resume (before anything is written)
    local = {"error": _owned_problem(state, plan, comm.rank),
             "model": {k: _meta(t) for k, t in state.model.items()},
             "optimizer": {n: {k: _meta(t) for k, t in d.items()} for n, d in named.tensors.items()},
             "scalars": named.scalars, "hparams": named.hparams, "position": position.to_dict()}
    gathered = comm.all_gather(local)
    errors = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"]]
    model_meta: dict[str, Any] = {}
    optim_meta: dict[str, Any] = {}
    optim_json: dict[str, Any] = {}
    for r, g in enumerate(gathered):
        for k, m in g["model"].items():
            if model_meta.setdefault(k, m) != m:
                errors.append(f"rank {r}: {k} is {m} but another replica has {model_meta[k]}")
        for n, d in g["optimizer"].items():
            optim_meta.setdefault(n, d)
        for n, hp in g["hparams"].items():
            optim_json.setdefault(n, {"hparams": hp, "scalars": g["scalars"].get(n, {})})
    num_layers = int(plan.model.get("num_layers", 0))
    cover = _coverage_problem(model_meta, num_layers)
    if cover:
        errors.append(f"{cover} (the plan's model has {num_layers} layers, an embedding and a head)")
    if errors:
        raise SpecError(f"checkpoint step {step} not saved: " + "; ".join(errors), field="state")
    if comm.rank == 0 and any(g["position"] != gathered[0]["position"] for g in gathered):
        logger.warning("ranks passed different training positions; saving rank 0's: %s", gathered[0]["position"])

    # 2. rank 0 makes the temporary directory
    final = store.step_dir(directory, step)
    needed = guard.tensor_bytes([*model_meta.values(), *(m for d in optim_meta.values() for m in d.values())]) \
        + guard.SMALL_FILES_MARGIN_BYTES
    tmp, error = None, None
    if comm.rank == 0:
        try:
            guard.before_save(directory, final, needed)  # lock; a corrupt step_<N> moved aside; space; temporaries
            tmp = os.path.join(directory, store.tmp_dir_name(step))
            os.makedirs(os.path.join(tmp, store.STATE_DIR))
            os.makedirs(os.path.join(tmp, store.RNG_DIR))
        except (OSError, SpecError) as exc:
            error = str(exc)
    tmp, error = comm.broadcast((tmp, error))
    if error:
        raise SpecError(f"checkpoint step {step} not saved: {error}", field="checkpoint directory", value=directory)

    # 3. shards (DCP), then the small files; every file is fsynced as it is written
    import torch.distributed.checkpoint as dcp

    flat: dict[str, Any] = {_MODEL_PREFIX + k: t for k, t in state.model.items()}
    for n, d in named.tensors.items():
        flat.update({f"{_OPTIM_PREFIX}{n}.{k}": t for k, t in d.items()})
    from torch.distributed.checkpoint.api import CheckpointException

    error = None
    try:
        with _single_process_quiet(comm):
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, store.STATE_DIR), sync_files=True),
                     process_group=group, no_dist=not comm.distributed)
        rng = capture_rng_state()
        store.write_json(tmp, f"{store.RNG_DIR}/rank_{comm.rank}.json", rng)
        if comm.rank == 0:
            store.write_json(tmp, f"{store.RNG_DIR}/global.json", rng)
            store.write_json(tmp, store.PLAN_FILE, plan.to_dict())
            store.write_json(tmp, store.POSITION_FILE, gathered[0]["position"])
            store.write_json(tmp, store.OPTIMIZER_FILE, optim_json)
    except (OSError, CheckpointException) as exc:  # a full disk: a message, not a traceback; no temporary left
        error = guard.failed_save(exc, directory=directory, tmp=None, needed_bytes=needed)
    try:
        comm.raise_any(error, f"checkpoint step {step} not saved")
    except SpecError:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    # 4. checksums, each rank a share of the files; rank 0 writes the manifest last and commits
    files = comm.broadcast(store.list_files(tmp) if comm.rank == 0 else None)
    hashes: dict[str, Any] = {}
    for part in comm.all_gather(store.hash_files(tmp, store.share(files, comm.rank, comm.world_size))):
        hashes.update(part)
    error = None
    if comm.rank == 0:
        layers = sorted({layer_of(k) for k in model_meta} - {None})
        manifest = {
            "format": store.FORMAT, "version": store.FORMAT_VERSION, "state_format": STATE_FORMAT, "step": step,
            "created_unix_s": time.time(), "world_size": comm.world_size, "num_stages": plan.num_stages,
            "plan_hash": plan.content_hash(),
            "model_name": plan.model.get("name"), "num_layers": num_layers, "layers": layers,
            "model": model_meta, "optimizer": optim_meta, "files": hashes,
        }
        error = store.finish(tmp, final, manifest, directory=directory, keep_last=keep_last)
    error = comm.broadcast(error)
    if error:
        raise SpecError(f"checkpoint step {step} not committed: {error}", field="checkpoint directory",
                        value=directory)
    if comm.rank == 0:
        logger.info("saved checkpoint %s (%d tensors, %d files, %d ranks) in %.2f s", final,
                    len(model_meta) + sum(len(d) for d in optim_meta.values()),
                    len(hashes), comm.world_size, time.perf_counter() - t0)
    return final


# --- load -----------------------------------------------------------------------------------------------------------

def _find(directory: str, step: int | None, comm: Comm) -> tuple[str, int, dict[str, Any], list[Skipped]]:
    """Collective: the newest complete checkpoint, its files verified with the work spread over the ranks."""
    cands = comm.broadcast(store.list_candidates(directory) if comm.rank == 0 else None)
    skipped: list[Skipped] = []
    for cand in cands:
        if step is not None and cand.step != step:
            continue
        if not cand.committed:
            skipped.append(Skipped(cand.path, cand.step, "a save in progress or torn (temporary name)"))
            continue
        manifest, problem = store.manifest_problem(cand.path)
        mine = [problem] if problem else store.check_files(
            cand.path, manifest, store.share(sorted(manifest["files"]), comm.rank, comm.world_size))
        problems = list(dict.fromkeys(p for part in comm.all_gather(mine) for p in part))
        if not problems and manifest is not None:
            if comm.rank == 0:
                store.log_skipped(skipped, cand.path)
            return cand.path, cand.step, manifest, skipped
        reason = "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
        skipped.append(Skipped(cand.path, cand.step, reason))
    raise store.no_checkpoint_error(directory, skipped, step)


def _needs_problem(state: StageState, manifest: Mapping[str, Any], path: str) -> str | None:
    """Whether the checkpoint holds every key this rank needs, with the same shapes; names what is missing."""
    saved: Mapping[str, Any] = manifest["model"]
    missing = sorted(k for k in state.model if k not in saved)
    problems = []
    if missing:
        lost_layers = sorted({layer_of(k) for k in missing} - {None})
        lost_parts = sorted({part_of(k) for k in missing} - {"layers"})
        what = []
        if lost_layers:
            what.append(f"layers {format_layers(lost_layers)}")
        what += lost_parts
        problems.append(f"{path} lacks {', '.join(what)} (it holds layers "
                        f"{format_layers(manifest.get('layers', [])) or 'none'}); missing keys: "
                        + ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    for k, t in state.model.items():
        if k in saved and list(t.shape) != list(saved[k]["shape"]):
            problems.append(f"{k} has shape {list(t.shape)} here but {saved[k]['shape']} in {path}")
    return "; ".join(problems) or None


def read_saved_plan(path: str) -> Plan:
    """plan.json of checkpoint ``path`` (confined, size-capped, every field checked by Plan.from_dict)."""
    return Plan.from_dict(store.read_plan_dict(path), source=os.path.join(path, store.PLAN_FILE))


def _optimizer_templates(state: StageState, manifest: Mapping[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """Tensors to load this rank's optimizer state into: each saved state's shape must be its parameter's, or a
    scalar (Adam's step); anything else (a crafted [4e18] or [-1]) is refused before anything is allocated."""
    saved_optim: Mapping[str, Any] = manifest.get("optimizer", {})
    templates: dict[str, dict[str, torch.Tensor]] = {}
    if state.optimizer is None:
        return templates
    for param, name in state.param_names.items():
        for k, meta in saved_optim.get(name, {}).items():
            shape, dtype_name = check_tensor_meta(meta, source=source, field=f"optimizer.{name}.{k}")
            dtype = getattr(torch, dtype_name)
            if shape not in (tuple(param.shape), ()):
                raise SpecError("optimizer state whose shape is neither its parameter's nor a scalar's",
                                source=source, field=f"optimizer.{name}.{k}.shape", value=list(shape),
                                valid=f"{list(param.shape)} or []")
            if not (dtype.is_floating_point or dtype in (torch.int64, torch.int32)):
                raise SpecError("optimizer state of a non-numeric dtype", source=source,
                                field=f"optimizer.{name}.{k}.dtype", value=dtype_name)
            templates.setdefault(name, {})[k] = (torch.empty_like(param, dtype=dtype) if shape == tuple(param.shape)
                                                 else torch.empty(shape, dtype=dtype))  # e.g. Adam's 0-dim step
    return templates


def _check_saved_hparams(state: StageState, extra: Mapping[str, Any], source: str) -> None:
    """Each saved hyperparameter of this rank's parameters against its group's own (before anything is loaded)."""
    from tangram_launch.checkpoint.state_fields import ABSENT, check_hparam

    if state.optimizer is None:
        return
    group_of = {id(p): g for g in state.optimizer.param_groups for p in g["params"]}
    for param, name in state.param_names.items():
        group = group_of.get(id(param))
        for k, v in (extra.get(name) or {}).get("hparams", {}).items():
            if group is not None:
                check_hparam(k, v, group.get(k, ABSENT), source=source, field=f"{name}.hparams.{k}")


def _read_and_check(path: str, manifest: Mapping[str, Any], state: StageState, rank: int,
                    rng_mode: str) -> dict[str, Any]:
    """Every file a load reads besides the shards, read through the confined layer and checked field by field."""
    from tangram_launch.checkpoint.safe_load import check_dcp_directory, listed_in
    from tangram_launch.checkpoint.state_fields import check_optimizer_file

    out: dict[str, Any] = {"position": store.read_position(path),
                           "optim_templates": _optimizer_templates(state, manifest,
                                                                   os.path.join(path, store.MANIFEST)),
                           "optimizer_file": {}, "rng": None, "rng_source": None}
    if state.optimizer is not None:
        source = os.path.join(path, store.OPTIMIZER_FILE)
        out["optimizer_file"] = check_optimizer_file(store.read_json(path, store.OPTIMIZER_FILE), source=source)
        _check_saved_hparams(state, out["optimizer_file"], source)
    if rng_mode != "none":
        out["rng"], out["rng_source"] = read_rng_state(path, manifest, rank, rng_mode)
    out["metadata"] = check_dcp_directory(os.path.join(path, store.STATE_DIR),
                                          listed=listed_in(manifest, store.STATE_DIR))
    return out


def read_rng_state(path: str, manifest: Mapping[str, Any], rank: int, mode: str) -> tuple[dict[str, Any], str]:
    """(RNG state, its file) for ``mode`` per_rank or global, every field checked."""
    from tangram_launch.checkpoint.state_fields import check_rng_state

    rel = f"{store.RNG_DIR}/rank_{rank}.json" if mode == "per_rank" else f"{store.RNG_DIR}/global.json"
    try:
        state = store.read_json(path, rel)
    except confined.CheckpointFileError as exc:
        if exc.missing and mode == "per_rank":
            raise SpecError(f"{path} has no RNG state for rank {rank} (written on {manifest.get('world_size')} "
                            "ranks)", field="rng", value=mode, valid="global, none") from None
        raise
    source = os.path.join(path, rel)
    check_rng_state(state, source=source, torch_bytes=torch.get_rng_state().numel())
    return state, source


def restore_checked_rng(state: Mapping[str, Any], source: str) -> None:
    """restore_rng_state of a checked state; what torch or numpy still refuse is a SpecError naming the file."""
    try:
        restore_rng_state(state)
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
        raise SpecError(f"the RNG state does not restore ({str(exc)[:200]})", source=source, field="rng") from None


def load_checkpoint(directory: str | os.PathLike, *, plan: Plan, state: StageState, step: int | None = None,
                    rng: str = "auto", restore_hparams: bool = True, group: Any = None) -> LoadedCheckpoint:
    """Load the newest complete checkpoint (or ``step``; or the one ``directory`` names, ``DIR/step_<N>``) into
    this rank's state under ``plan``; collective.

    The plan may differ from the one the checkpoint was written under (stages, layer ranges, world size); the
    model may not. ``rng``: "auto" restores each rank's own RNG states when the layout is unchanged and rank 0's on
    every rank otherwise; "per_rank", "global" or "none" to choose. Nothing on disk is changed.
    """
    directory = os.fspath(directory)
    if rng not in RNG_MODES:
        raise SpecError("unknown RNG restore mode", field="rng", value=rng, valid=", ".join(RNG_MODES))
    comm = Comm.create(group)
    _check_world(comm, plan)
    t0 = time.perf_counter()
    path, found_step, manifest, skipped = _find(*store.checkpoint_location(directory, step), comm)
    fmt = manifest.get("state_format", STATE_FORMAT)
    if fmt != STATE_FORMAT:
        raise SpecError(f"checkpoint {path} holds '{fmt}' state, which this loader does not read (Megatron-core "
                        "checkpoints load with runtime_adapters.megatron_checkpoint)", field="state_format",
                        value=fmt, valid=STATE_FORMAT)

    saved_plan = read_saved_plan(path)
    diffs = model_differences(saved_plan.model, plan.model)
    if diffs:
        detail = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} in the plan" for k, a, b in diffs)
        if any(k == "num_layers" for k, _, _ in diffs):
            new_layers = int(plan.model.get("num_layers", 0))
            lost = sorted(set(range(new_layers)) - set(manifest.get("layers", [])))
            if lost:
                detail += f" (missing layers {format_layers(lost)})"
        raise SpecError(f"checkpoint {path} was written for a different model ({saved_plan.model.get('name')!r}, "
                        f"the plan has {plan.model.get('name')!r}): {detail}; to resume it, plan for the model it "
                        f"was written for (its plan: {os.path.join(path, store.PLAN_FILE)}), or start afresh in "
                        "another checkpoint directory", field=f"model.{diffs[0][0]}",
                        value=diffs[0][2], valid=repr(diffs[0][1]))
    error = _owned_problem(state, plan, comm.rank) or _needs_problem(state, manifest, path)
    comm.raise_any(error, f"cannot load checkpoint {path} under this plan")

    # every small file and the DCP metadata checked on every rank before any state changes
    same_layout = _layout(saved_plan) == _layout(plan)
    mode = rng if rng != "auto" else ("per_rank" if same_layout else "global")
    checked: dict[str, Any] = {}
    failure: SpecError | None = None
    try:
        checked = _read_and_check(path, manifest, state, comm.rank, mode)
    except SpecError as exc:
        failure = exc
    comm.raise_first(failure, f"cannot load checkpoint {path}")

    flat: dict[str, Any] = {_MODEL_PREFIX + k: t for k, t in state.model.items()}
    for n, d in checked["optim_templates"].items():
        flat.update({f"{_OPTIM_PREFIX}{n}.{k}": t for k, t in d.items()})
    targets = dict(flat)
    from tangram_launch.checkpoint.safe_load import check_request, load_tensors

    failure = None
    try:
        check_request(checked["metadata"], flat, source=os.path.join(path, store.STATE_DIR, ".metadata"))
    except SpecError as exc:
        failure = exc
    comm.raise_first(failure, f"cannot load checkpoint {path}")
    with _single_process_quiet(comm):
        load_tensors(flat, os.path.join(path, store.STATE_DIR), checked["metadata"], group=group,
                     no_dist=not comm.distributed)
    with torch.no_grad():
        for key, t in flat.items():  # DCP loads tensors in place; copy should it ever have replaced one
            if t is not targets[key]:
                targets[key].copy_(t)

    if state.optimizer is not None:
        if not manifest.get("optimizer") and comm.rank == 0:
            logger.warning("checkpoint %s has no optimizer state; the optimizer starts fresh", path)
        extra = checked["optimizer_file"]
        named = NamedOptimizerState(
            tensors={n: {k: flat[f"{_OPTIM_PREFIX}{n}.{k}"] for k in d} for n, d in checked["optim_templates"].items()},
            scalars={n: e.get("scalars", {}) for n, e in extra.items()},
            hparams={n: e["hparams"] for n, e in extra.items() if "hparams" in e})
        load_optimizer_state_by_name(state.optimizer, state.param_names, named, restore_hparams=restore_hparams,
                                     source=os.path.join(path, store.OPTIMIZER_FILE))
    if mode != "none":
        restore_checked_rng(checked["rng"], checked["rng_source"])
    position = checked["position"]
    if comm.rank == 0:
        logger.info("loaded checkpoint %s (step %d, written on %d ranks in %d stages, now %d ranks in %d stages; "
                    "RNG: %s) in %.2f s", path, found_step, saved_plan.world_size, saved_plan.num_stages,
                    plan.world_size, plan.num_stages, mode, time.perf_counter() - t0)
    return LoadedCheckpoint(path=path, step=found_step, position=position, saved_plan=saved_plan, rng=mode,
                            skipped=tuple(skipped), layout_changed=not same_layout)

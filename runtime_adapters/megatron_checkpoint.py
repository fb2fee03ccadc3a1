"""Megatron-core checkpoints that reshard: Megatron's own ``dist_checkpointing`` inside Tangram's atomic directory.

Two routes, both layout-agnostic:

* :func:`save_megatron_checkpoint` / :func:`load_megatron_checkpoint` (the adapter's path, any tp x pp layout).
  Every tensor goes through ``model.sharded_state_dict()``: a ``ShardedTensor`` whose key names the layer *type*
  (``decoder.layers.mlp.linear_fc1.weight``) and whose global shape carries a leading layer axis, with the tensor's
  TP slice described by offsets and fragmentation. The files therefore hold full logical tensors however they were
  split, and a rank of a new layout reads its own (layer, TP) slice. Optimizer state follows the parameters' sharding
  (Megatron's optimizer: its own ``sharded_state_dict``, distributed optimizer in ``fully_reshardable`` format; a
  plain torch Adam/AdamW: Megatron's ``dist_checkpointing.optimizer`` helpers, the same ones its FP32Optimizer uses).
  Around Megatron's directory this module writes what ``tangram_launch.checkpoint`` writes (plan, position, RNG,
  manifest with checksums, tmp-name + rename, keep-last), so ``tangram-launch --resume`` and ``describe`` work on it::

      step_<N>/manifest.json  plan.json  position.json  rng/rank_<r>.json  megatron/{.metadata,*.distcp,common.pt}

* :func:`megatron_stage_state`: a stage's state under Tangram's global names for ``tangram_launch.checkpoint``
  (pipeline-only layouts, tp == 1; TP-sharded tensors would be saved as if whole).

CPU (megatron-core 0.16.1): ``dist_checkpointing.load`` runs on gloo as shipped; ``save`` with the default
``torch_dist`` strategy does not (``FileSystemWriterAsync.preload_tensors`` calls ``torch.cuda.synchronize()`` and
``save_state_dict_async_finalize`` builds a tensor on ``torch.cuda.current_device()``). Without CUDA the save goes
through :func:`sync_save_strategy`, a synchronous ``SaveShardedStrategy`` (Megatron's extension point) that feeds
Megatron's own MCore->torch translation and save planner to ``torch.distributed.checkpoint.save``: the same
``torch_dist`` format, read back by Megatron's default load strategy.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Mapping

import torch

from tangram_launch.checkpoint import store
from tangram_launch.checkpoint import LoadedCheckpoint, StageState, capture_rng_state, model_differences
from tangram_launch.checkpoint.save_load import Comm, read_rng_state, read_saved_plan, restore_checked_rng
from tangram_launch.checkpoint.keys import LayerKeyMap
from tangram_launch.checkpoint.store import TrainingPosition
from tangram_launch.errors import SpecError, TangramError
from tangram_launch.plan import Place, Plan, Stage

__all__ = ["STATE_FORMAT", "MEGATRON_PARTS", "megatron_key_map", "megatron_stage_state", "sync_save_strategy",
           "sharded_state_dict", "save_megatron_checkpoint", "load_megatron_checkpoint"]

logger = logging.getLogger(__name__)

STATE_FORMAT = "megatron-dist-checkpointing"  # manifest "state_format": tells this layout from tangram's DCP one
MEGATRON_DIR = "megatron"  # Megatron's checkpoint directory inside step_<N>/
# GPTModel's non-layer state -> Tangram's global parts (see LayerKeyMap)
MEGATRON_PARTS = {"embedding.": "embedding.", "decoder.final_layernorm.": "head.final_layernorm.",
                  "output_layer.": "head.output_layer."}
RNG_MODES = ("auto", "per_rank", "global", "none")
_ADAM_STATE = ("exp_avg", "exp_avg_sq")
_DISTRIB_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


# --- the tangram route (global names, tp == 1) --------------------------------------------------------------------

def megatron_key_map(stage: Stage) -> LayerKeyMap:
    """Local GPTModel names (``decoder.layers.<local i>.``, ``embedding.``, ``decoder.final_layernorm.``,
    ``output_layer.``) <-> Tangram's global names for one stage."""
    return LayerKeyMap.for_stage(stage, layer_prefix="decoder.layers.", local_numbering="local",
                                 parts=MEGATRON_PARTS)


def _unwrap(model: Any) -> Any:
    """Megatron DDP / Float16Module / torch DDP keep the GPTModel in ``.module``."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def megatron_stage_state(model: Any, place: Place, optimizer: torch.optim.Optimizer | None = None) -> StageState:
    """This stage's GPTModel state under global names, for ``tangram_launch.checkpoint`` (tp == 1 only).

    ``_extra_state`` entries are left out: they are not tensors with the local layer spec (None) and Transformer
    Engine's FP8 metadata does not carry over to another layout. With tp > 1 every rank holds slices under the same
    name; use :func:`save_megatron_checkpoint`, whose format describes the slicing.
    """
    if place.stage.tp > 1:
        raise SpecError("tangram_launch.checkpoint stores whole tensors; this stage is tensor-parallel (use "
                        "runtime_adapters.megatron_checkpoint.save_megatron_checkpoint)", field="tp",
                        value=place.stage.tp, valid="1")
    model = _unwrap(model)
    keys = megatron_key_map(place.stage)
    tensors = {keys.to_global(k): v for k, v in model.state_dict().items()
               if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")}
    names = {p: keys.to_global(n) for n, p in model.named_parameters()}
    return StageState(model=tensors, optimizer=optimizer, param_names=names)


# --- Megatron's format ------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _sync_strategy_class() -> type:
    """Built on first use so that importing this module does not import Megatron."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy

    class SyncTorchDistSaveStrategy(SaveShardedStrategy):
        """Megatron's ``torch_dist`` format written synchronously by ``torch.distributed.checkpoint`` (no CUDA).

        The same three steps as Megatron's ``TorchDistSaveShardedStrategy`` (group ShardedTensors by key keeping
        main replicas only, translate to torch ShardedTensors, plan with ``MCoreSavePlanner``) without its async
        writer, which needs CUDA.
        """

        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt = mcore_torch.mcore_to_pyt_state_dict(flat, False)
            dcp.save(pyt, storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), sync_files=True),
                     planner=mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

    return SyncTorchDistSaveStrategy


def sync_save_strategy() -> Any:
    """A synchronous save strategy for Megatron's ``torch_dist`` (version 1) format that runs without CUDA."""
    return _sync_strategy_class()("torch_dist", 1)


def _save_strategy() -> Any:
    """Megatron's default (async-capable) strategy where CUDA is present, the synchronous one otherwise."""
    return None if torch.cuda.is_available() else sync_save_strategy()


def _is_megatron_optimizer(optimizer: Any) -> bool:
    return callable(getattr(optimizer, "sharded_state_dict", None))


def _check_torch_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise SpecError("a torch optimizer is checkpointed through Megatron's optimizer sharding for Adam-type "
                        "state only (or pass a Megatron optimizer)", field="optimizer", value=type(optimizer).__name__,
                        valid="torch.optim.Adam, torch.optim.AdamW, megatron.core.optimizer.MegatronOptimizer")


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """State tensors to load into (Megatron's init_state_fn does the same for its Adam): zeros, step 0."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = torch.tensor(0.0)
            for k in _ADAM_STATE + (("max_exp_avg_sq",) if group.get("amsgrad") else ()):
                state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _common_step(state: Mapping[int, Mapping[str, Any]]) -> Any:
    """Adam's per-parameter step, which Megatron saves once (shape () does not follow a parameter's sharding)."""
    steps = {float(s["step"]) for s in state.values() if "step" in s}
    if len(steps) > 1:
        raise SpecError("optimizer steps differ between parameters; Megatron's format keeps one step",
                        field="optimizer.state.step", value=sorted(steps))
    return torch.tensor(steps.pop()) if steps else None


def _torch_optimizer_sharded(optimizer: torch.optim.Optimizer, model_sd: Any, is_loading: bool) -> dict:
    """A torch Adam's state_dict with every per-parameter tensor sharded like its parameter (cf. FP32Optimizer)."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    _check_torch_optimizer(optimizer)
    if is_loading:
        _init_adam_state(optimizer)
    sd = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    missing = [i for i in range(len(params)) if i not in id_map]
    if missing:
        raise SpecError("optimizer parameters that are not in the model's sharded state dict",
                        field="optimizer", value=[tuple(params[i].shape) for i in missing[:5]])
    step = _common_step(sd["state"])
    optim_state_to_sharding_state(sd, id_map, exclude_keys=("step",))
    if step is not None:
        sd["state"]["common_step"] = step
    return sd


def sharded_state_dict(model: Any, optimizer: Any = None, *, is_loading: bool = False) -> dict:
    """``{"model": ..., "optimizer": ...}`` in Megatron's sharded form (what dist_checkpointing saves/loads)."""
    model = _unwrap(model)
    model_sd = model.sharded_state_dict(metadata=dict(_DISTRIB_OPTIM_METADATA))
    out = {"model": model_sd}
    if optimizer is not None:
        if _is_megatron_optimizer(optimizer):
            out["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                            metadata=dict(_DISTRIB_OPTIM_METADATA))
        else:
            out["optimizer"] = _torch_optimizer_sharded(optimizer, model_sd, is_loading)
    return out


def _checked_groups(saved: list, current: list, source: str) -> list:
    """The saved param groups' hyperparameters, each checked against this optimizer's own (lr "abc" is refused)."""
    from tangram_launch.checkpoint.state_fields import ABSENT, check_hparam

    return [{k: (v if k == "params" else check_hparam(k, v, c.get(k, ABSENT), source=source,
                                                      field=f"param_groups[{i}].{k}"))
             for k, v in g.items()} for i, (g, c) in enumerate(zip(saved, current))]


def _load_torch_optimizer(optimizer: torch.optim.Optimizer, loaded: dict, restore_hparams: bool,
                          source: str = "optimizer state") -> None:
    state = dict(loaded["state"])
    step = state.pop("common_step", None)
    per_param = {}
    for idx, entry in state.items():
        entry = dict(entry)
        if step is not None:
            entry["step"] = step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
        per_param[int(idx)] = entry
    current = optimizer.state_dict()["param_groups"]
    groups = loaded.get("param_groups", current)
    if not restore_hparams:
        groups = current
    elif len(groups) != len(current) or any(len(a["params"]) != len(b["params"]) for a, b in zip(groups, current)):
        logger.warning("optimizer param groups differ from the checkpoint's (%d saved, %d here); keeping this "
                       "optimizer's hyperparameters", len(groups), len(current))
        groups = current
    else:  # the saved hyperparameters, this rank's parameters
        groups = [dict(g, params=c["params"]) for g, c in zip(_checked_groups(groups, current, source), current)]
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})


# --- collectives ------------------------------------------------------------------------------------------------

def _checked_rank(dist, plan: Plan) -> int:
    """This rank, after checking the job runs the plan's world size."""
    world = dist.get_world_size()
    if world != plan.world_size:
        raise SpecError("the job's world size differs from the plan's", field="world_size", value=world,
                        valid=str(plan.world_size))
    return dist.get_rank()


def _dist() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise TangramError("Megatron checkpoints need torch.distributed initialised (MegatronAdapter.initialize)")
    return dist


def _broadcast(dist: Any, obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(dist: Any, obj: Any) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _raise_any(dist: Any, error: str | None, what: str) -> None:
    """Collective: every rank raises one SpecError when any rank has an error (no rank is left waiting)."""
    errors = _all_gather(dist, error)
    if any(errors):
        raise SpecError(f"{what}: " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))


def _stage_problem(model: Any, plan: Plan, rank: int) -> str | None:
    """The model must be this rank's stage of the plan: its layers, embedding and head."""
    place = plan.place(rank)
    model = _unwrap(model)
    held = [layer.layer_number - 1 for layer in model.decoder.layers] if hasattr(model, "decoder") else []
    want = list(range(*place.layers))
    if held != want or bool(getattr(model, "pre_process", place.is_first_stage)) != place.is_first_stage \
            or bool(getattr(model, "post_process", place.is_last_stage)) != place.is_last_stage:
        return (f"the model holds layers {held} (pre_process={getattr(model, 'pre_process', None)}, "
                f"post_process={getattr(model, 'post_process', None)}) but the plan places layers {want} "
                f"(first={place.is_first_stage}, last={place.is_last_stage}) on this rank")
    return None


def _layout(plan: Plan) -> tuple:
    return tuple((s.layers, s.tp, s.cp, s.dp, s.ep) for s in plan.stages)


# --- save / load ----------------------------------------------------------------------------------------------

def save_megatron_checkpoint(directory: str | os.PathLike, *, plan: Plan, model: Any, optimizer: Any = None,
                             position: TrainingPosition, keep_last: int | None = 3) -> str:
    """Write ``<directory>/step_<position.step>/`` atomically in Megatron's reshardable format; collective.

    ``model``: this rank's GPTModel (wrappers with ``.module`` are unwrapped); ``optimizer``: a Megatron optimizer,
    a torch Adam/AdamW over the model's parameters, or None. Returns the checkpoint's path.
    """
    from megatron.core import dist_checkpointing

    directory = os.fspath(directory)
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise SpecError("must be a positive integer or None (keep all)", field="keep_last", value=keep_last)
    dist = _dist()
    rank = _checked_rank(dist, plan)
    t0 = time.perf_counter()
    step = position.step
    _raise_any(dist, _stage_problem(model, plan, rank), f"checkpoint step {step} not saved")

    final = store.step_dir(directory, step)
    tmp, error = None, None
    if rank == 0:
        try:
            from tangram_launch.checkpoint import guard as checkpoint_guard

            checkpoint_guard.before_save(directory, final, checkpoint_guard.SMALL_FILES_MARGIN_BYTES)
            tmp = os.path.join(directory, store.tmp_dir_name(step))
            os.makedirs(os.path.join(tmp, MEGATRON_DIR))
            os.makedirs(os.path.join(tmp, store.RNG_DIR))
        except (OSError, SpecError) as exc:
            error = str(exc)
    tmp, error = _broadcast(dist, (tmp, error))
    if error:
        raise SpecError(f"checkpoint step {step} not saved: {error}", field="checkpoint directory", value=directory)

    # Megatron checks that the shards cover every tensor exactly once (validate_access_integrity)
    dist_checkpointing.save(sharded_state_dict(model, optimizer), os.path.join(tmp, MEGATRON_DIR),
                            sharded_strategy=_save_strategy())
    error = None
    try:
        rng = capture_rng_state()
        store.write_json(tmp, f"{store.RNG_DIR}/rank_{rank}.json", rng)
        if rank == 0:
            store.write_json(tmp, f"{store.RNG_DIR}/global.json", rng)
            store.write_json(tmp, store.PLAN_FILE, plan.to_dict())
            store.write_json(tmp, store.POSITION_FILE, position.to_dict())
    except OSError as exc:
        error = str(exc)
    _raise_any(dist, error, f"checkpoint step {step} not saved (left in {tmp})")

    files = _broadcast(dist, store.list_files(tmp) if rank == 0 else None)
    hashes: dict[str, Any] = {}
    for part in _all_gather(dist, store.hash_files(tmp, store.share(files, rank, plan.world_size))):
        hashes.update(part)
    error = None
    if rank == 0:
        from runtime_adapters.megatron_adapter import MEGATRON_VERSION

        num_layers = int(plan.model.get("num_layers", 0))
        manifest = {
            "format": store.FORMAT, "version": store.FORMAT_VERSION, "state_format": STATE_FORMAT,
            "megatron_version": MEGATRON_VERSION, "step": step, "created_unix_s": time.time(), "world_size": plan.world_size,
            "num_stages": plan.num_stages, "plan_hash": plan.content_hash(), "model_name": plan.model.get("name"),
            "num_layers": num_layers, "layers": list(range(num_layers)), "has_optimizer": optimizer is not None,
            "model": {}, "optimizer": {},  # tensor lists live in megatron/.metadata
            "files": hashes,
        }
        error = store.finish(tmp, final, manifest, directory=directory, keep_last=keep_last)
    error = _broadcast(dist, error)
    if error:
        raise SpecError(f"checkpoint step {step} not committed: {error}", field="checkpoint directory",
                        value=directory)
    if rank == 0:
        logger.info("saved megatron checkpoint %s (%d files, %d ranks) in %.2f s", final, len(hashes), plan.world_size,
                    time.perf_counter() - t0)
    return final


def load_megatron_checkpoint(directory: str | os.PathLike, *, plan: Plan, model: Any, optimizer: Any = None,
                             step: int | None = None, rng: str = "auto",
                             restore_hparams: bool = True) -> LoadedCheckpoint:
    """Load the newest complete checkpoint (or ``step``) into this rank's model/optimizer under ``plan``; collective.

    The plan may differ from the saved one in every layout respect (tp, pp, layer ranges, dp, world size); the model
    may not. Torn or corrupt newer checkpoints are skipped and named (rank 0 verifies the checksums).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    directory = os.fspath(directory)
    if rng not in RNG_MODES:
        raise SpecError("unknown RNG restore mode", field="rng", value=rng, valid=", ".join(RNG_MODES))
    dist = _dist()
    rank = _checked_rank(dist, plan)
    t0 = time.perf_counter()
    found, error = None, None
    if rank == 0:
        try:
            f = store.find_latest(directory, step=step, checksums=True)
            found = (f.path, f.step, dict(f.manifest), list(f.skipped))
        except SpecError as exc:
            error = str(exc)
    found, error = _broadcast(dist, (found, error))
    if error:
        raise SpecError(error, field="checkpoint directory", value=directory)
    path, found_step, manifest, skipped = found

    if manifest.get("state_format") != STATE_FORMAT:
        raise SpecError(f"{path} is not in Megatron's dist_checkpointing layout (load it with "
                        "tangram_launch.checkpoint.load_checkpoint)", field="state_format",
                        value=manifest.get("state_format"), valid=STATE_FORMAT)
    saved_plan = read_saved_plan(path)
    diffs = model_differences(saved_plan.model, plan.model)
    if diffs:
        detail = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} in the plan" for k, a, b in diffs)
        raise SpecError(f"checkpoint {path} was written for a different model ({saved_plan.model.get('name')!r}, "
                        f"the plan has {plan.model.get('name')!r}): {detail}", field=f"model.{diffs[0][0]}",
                        value=diffs[0][2], valid=repr(diffs[0][1]))
    _raise_any(dist, _stage_problem(model, plan, rank), f"cannot load checkpoint {path} under this plan")

    with_optimizer = optimizer is not None and bool(manifest.get("has_optimizer"))
    if optimizer is not None and not with_optimizer and rank == 0:
        logger.warning("checkpoint %s has no optimizer state; the optimizer starts fresh", path)
    same_layout = _layout(saved_plan) == _layout(plan)
    mode = rng if rng != "auto" else ("per_rank" if same_layout else "global")
    from tangram_launch.checkpoint.safe_load import check_dcp_directory, listed_in

    failure = None
    try:  # Megatron unpickles and opens what .metadata names: prove it is data inside the directory, check the rest
        check_dcp_directory(os.path.join(path, MEGATRON_DIR), allow_bytes=True,
                            listed=listed_in(manifest, MEGATRON_DIR))
        rng_state = read_rng_state(path, manifest, rank, mode) if mode != "none" else None
        position = store.read_position(path)
    except SpecError as exc:
        failure = exc
    Comm.create(None).raise_first(failure, f"cannot load checkpoint {path}")
    request = sharded_state_dict(model, optimizer if with_optimizer else None, is_loading=True)
    try:
        loaded = dist_checkpointing.load(request, os.path.join(path, MEGATRON_DIR))
    except CheckpointingException as exc:
        raise SpecError(f"checkpoint {path} does not hold what this layout needs: {exc}",
                        field="checkpoint", value=path) from None
    _unwrap(model).load_state_dict(loaded["model"], strict=True)
    if with_optimizer:
        if _is_megatron_optimizer(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
        else:
            _load_torch_optimizer(optimizer, loaded["optimizer"], restore_hparams,
                                  source=os.path.join(path, MEGATRON_DIR))

    if rng_state is not None:
        restore_checked_rng(*rng_state)
    if rank == 0:  # skipped checkpoints were logged by store.find_latest
        logger.info("loaded megatron checkpoint %s (step %d, written on %d ranks in %d stages, now %d ranks in %d "
                    "stages; RNG: %s) in %.2f s", path, found_step, saved_plan.world_size, saved_plan.num_stages,
                    plan.world_size, plan.num_stages, mode, time.perf_counter() - t0)
    return LoadedCheckpoint(path=path, step=found_step, position=position, saved_plan=saved_plan, rng=mode,
                            skipped=tuple(skipped),
                            layout_changed=not same_layout)

"""A checkpoint's whole model in one process, whatever layout wrote it (for export to other formats).

    state, info = read_model_state("ckpt")    # {"embedding.*", "layers.<i>.*", "head.*": tensor}, CheckpointInfo

Reads the newest complete checkpoint (or ``step``), every file verified, through the same safe DCP reader as
``load_checkpoint`` (nothing in the checkpoint can run code); optimizer state is not read. No process group.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from tangram_launch.checkpoint import store
from tangram_launch.checkpoint.save_load import STATE_FORMAT, _MODEL_PREFIX
from tangram_launch.checkpoint.store import CheckpointInfo, TrainingPosition
from tangram_launch.errors import SpecError


def read_model_state(directory: str | os.PathLike, *, step: int | None = None) -> tuple[dict[str, torch.Tensor],
                                                                                        CheckpointInfo]:
    """Every model tensor of the checkpoint under its global name, and the checkpoint's summary."""
    import torch.distributed.checkpoint as dcp

    from tangram_launch.checkpoint.safe_load import check_dcp_directory, safe_planner, safe_reader

    directory = os.fspath(directory)
    found = store.find_latest(directory, step=step, checksums=True)
    fmt = found.manifest.get("state_format", STATE_FORMAT)
    if fmt != STATE_FORMAT:
        raise SpecError(f"checkpoint {found.path} holds '{fmt}' state, which this reader does not read",
                        field="state_format", value=fmt, valid=STATE_FORMAT)
    flat: dict[str, Any] = {}
    for name, meta in found.manifest.get("model", {}).items():
        dtype = getattr(torch, str(meta.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise SpecError("unknown dtype in the manifest", source=found.path, field=f"model.{name}.dtype",
                            value=meta.get("dtype"))
        flat[_MODEL_PREFIX + name] = torch.empty(tuple(meta["shape"]), dtype=dtype)
    if not flat:
        raise SpecError("the checkpoint's manifest lists no model tensors", source=found.path, field="model")
    state_dir = os.path.join(found.path, store.STATE_DIR)
    check_dcp_directory(state_dir)
    with warnings.catch_warnings():  # DCP warns that it assumes one process: here that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=safe_reader(state_dir), planner=safe_planner(), no_dist=True)
    plan = store.read_json(os.path.join(found.path, store.PLAN_FILE))
    position = TrainingPosition.from_dict(store.read_json(os.path.join(found.path, store.POSITION_FILE)),
                                          source=os.path.join(found.path, store.POSITION_FILE))
    info = CheckpointInfo(found.path, found.step, plan, position, found.skipped)
    return {k[len(_MODEL_PREFIX):]: v for k, v in flat.items()}, info

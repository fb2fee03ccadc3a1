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
from tangram_launch.checkpoint.fields import check_tensor_meta
from tangram_launch.checkpoint.store import CheckpointInfo
from tangram_launch.errors import SpecError


def read_model_state(directory: str | os.PathLike, *, step: int | None = None) -> tuple[dict[str, torch.Tensor],
                                                                                        CheckpointInfo]:
    """Every model tensor of the checkpoint under its global name, and the checkpoint's summary."""
    from tangram_launch.checkpoint.safe_load import check_dcp_directory, check_request, listed_in, load_tensors

    directory = os.fspath(directory)
    found = store.find_latest(directory, step=step, checksums=True)  # the manifest's every field checked
    fmt = found.manifest.get("state_format", STATE_FORMAT)
    if fmt != STATE_FORMAT:
        raise SpecError(f"checkpoint {found.path} holds '{fmt}' state, which this reader does not read",
                        field="state_format", value=fmt, valid=STATE_FORMAT)
    source = os.path.join(found.path, store.MANIFEST)
    flat: dict[str, Any] = {}
    for name, meta in found.manifest.get("model", {}).items():
        shape, dtype = check_tensor_meta(meta, source=source, field=f"model.{name}")
        flat[_MODEL_PREFIX + name] = torch.empty(shape, dtype=getattr(torch, dtype))
    if not flat:
        raise SpecError("the checkpoint's manifest lists no model tensors", source=source, field="model")
    plan = store.read_plan_dict(found.path)
    position = store.read_position(found.path)
    state_dir = os.path.join(found.path, store.STATE_DIR)
    metadata = check_dcp_directory(state_dir, listed=listed_in(found.manifest, store.STATE_DIR))
    check_request(metadata, flat, source=os.path.join(state_dir, ".metadata"))
    with warnings.catch_warnings():  # DCP warns that it assumes one process: here that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_tensors(flat, state_dir, metadata, no_dist=True)
    info = CheckpointInfo(found.path, found.step, plan, position, found.skipped)
    return {k[len(_MODEL_PREFIX):]: v for k, v in flat.items()}, info

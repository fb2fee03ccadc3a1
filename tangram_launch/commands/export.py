"""Export a checkpoint (any layout that wrote it) to another format.

    tangram-launch export CKPT_DIR --to hf OUT_DIR [--config HF_DIR_OR_CONFIG_JSON] [--step N]

``--to hf``: ``OUT_DIR/config.json`` + ``OUT_DIR/model.safetensors``, which ``transformers.AutoModelForCausalLM.
from_pretrained(OUT_DIR)`` loads. The Hugging Face config comes from ``--config`` or, for runs of
``examples/train_hf.py``, from the checkpoint itself (position.json ``extra.hf_config``); it must describe the
checkpoint's model (same layers, widths, vocabulary), else the export is refused naming the field.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Callable, TypeVar

from tangram_launch.errors import SpecError

log = logging.getLogger(__name__)

FORMATS = ("hf",)
T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT_DIR",
                        help="a checkpoint directory (its newest complete step) or one checkpoint, DIR/step_N")
    parser.add_argument("out", metavar="OUT_DIR", help="where to write the exported model")
    parser.add_argument("--to", required=True, choices=FORMATS, help="the format to write")
    parser.add_argument("--config", metavar="PATH", help="Hugging Face config.json (or its folder); default: the "
                                                         "one the checkpoint carries")
    parser.add_argument("--step", type=int, help="export this step instead of the newest")


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.checkpoint):
        raise SpecError("no such checkpoint directory", field="CKPT_DIR", value=args.checkpoint)
    t0 = time.perf_counter()
    log.info("export 1/4: loading torch and the checkpoint reader")  # each phase can take seconds: say which runs
    from runtime_adapters.hf_model import config_from_dict, load_config, save_hf
    from tangram_launch.checkpoint import model_differences
    from tangram_launch.checkpoint.confined import make_readable_as_created
    from tangram_launch.checkpoint.whole import read_model_state
    from tangram_launch.specs.model import from_hf_config

    log.info("export 2/4: reading and verifying the checkpoint in %s (%.1f s)", args.checkpoint,
             time.perf_counter() - t0)
    state, info = read_model_state(args.checkpoint, step=args.step)  # every file and field checked
    log.info("export 3/4: step %d, %d tensors read; loading the Hugging Face config (transformers) (%.1f s)",
             info.step, len(state), time.perf_counter() - t0)
    if args.config:
        config = load_config(args.config)
        source, field = args.config, "--config"
    else:
        carried = info.position.extra.get("hf_config")
        source, field = os.path.join(info.path, "position.json"), "extra.hf_config"
        if not carried:
            raise SpecError(f"checkpoint {info.path} carries no Hugging Face config", field="--config",
                            valid="the config.json (or folder) of the model that was trained")
        if not isinstance(carried, dict):
            raise SpecError("a Hugging Face config is a JSON object", source=source, field=field,
                            value=type(carried).__name__)
        config = _checked(lambda: config_from_dict(carried), source=source, field=field)
    spec = _checked(lambda: from_hf_config(config.to_dict()), source=source, field=field)
    saved_model = info.plan.get("model", {})
    diffs = model_differences(spec.to_dict(), saved_model if isinstance(saved_model, dict) else {})
    if diffs:
        k, a, b = diffs[0]
        detail = "; ".join(f"{f}: {x!r} in the config, {y!r} in the checkpoint" for f, x, y in diffs)
        raise SpecError(f"the Hugging Face config does not describe the checkpoint's model ({detail})",
                        field=f"model.{k}", value=a, valid=repr(b))
    log.info("export 4/4: writing %s (%.1f s)", args.out, time.perf_counter() - t0)
    files = save_hf(args.out, config, state)
    for path in files:  # safetensors writes 0600 through a temporary file: give it the mode a plain open would
        make_readable_as_created(path)
    print(f"exported {info.path} (step {info.step}, {len(state)} tensors) to {args.out}: "
          + ", ".join(os.path.basename(f) for f in files) + f" in {time.perf_counter() - t0:.1f} s")
    return 0


def _checked(build: Callable[[], T], *, source: str, field: str) -> T:
    """``build()``, where transformers' own refusal of a config (ValueError, TypeError, KeyError) is a SpecError
    naming the file and field it came from."""
    try:
        return build()
    except SpecError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SpecError(f"not a usable Hugging Face config ({type(exc).__name__}: {str(exc)[:200]})", source=source,
                        field=field) from None

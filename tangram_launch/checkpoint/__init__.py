"""Layout-agnostic, atomic, verified checkpoints: keys by global layer (``keys``), the on-disk directory format
(``store``), and the collective save and load (``save_load``). What a training script needs is re-exported here::

    from tangram_launch.checkpoint import StageState, TrainingPosition, load_checkpoint, save_checkpoint
"""
from tangram_launch.checkpoint.keys import LayerKeyMap
from tangram_launch.checkpoint.save_load import (LoadedCheckpoint, StageState, capture_rng_state, load_checkpoint,
                                                 model_differences, restore_rng_state, resume_directory,
                                                 save_checkpoint)
from tangram_launch.checkpoint.store import TrainingPosition, describe

__all__ = ["LayerKeyMap", "LoadedCheckpoint", "StageState", "TrainingPosition", "capture_rng_state", "describe",
           "load_checkpoint", "model_differences", "restore_rng_state", "resume_directory", "save_checkpoint"]

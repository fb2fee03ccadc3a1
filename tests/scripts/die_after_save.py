"""Restart test worker: runs examples/train_gpt.py; in round 0, rank DIE_RANK kills itself (SIGKILL, as kill -9
would) right after the collective save of step DIE_STEP returned, while the other ranks go on into the next step.

Usage: die_after_save.py DIE_RANK DIE_STEP [train_gpt.py arguments]
"""
import os
import runpy
import signal
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "train_gpt.py")


def main() -> None:
    die_rank, die_step = int(sys.argv[1]), int(sys.argv[2])
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and int(os.environ["RANK"]) == die_rank:
        from tangram_launch import checkpoint

        real_save = checkpoint.save_checkpoint

        def save_then_die(*args, **kwargs):
            path = real_save(*args, **kwargs)
            if kwargs["position"].step == die_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return path

        checkpoint.save_checkpoint = save_then_die
    sys.argv = [EXAMPLE, *sys.argv[3:]]
    runpy.run_path(EXAMPLE, run_name="__main__")


if __name__ == "__main__":
    main()

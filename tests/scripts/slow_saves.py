"""Fault-test worker: runs examples/train_gpt.py, records its pid in PID_DIR/rank<RANK>, and sleeps SLEEP_S after
every checkpoint save, so that a test can kill the launcher between two saves.

Usage: slow_saves.py PID_DIR SLEEP_S [train_gpt.py arguments]
"""
import functools
import os
import runpy
import sys
import time

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "train_gpt.py")


def _then_sleep(save, sleep_s: float):
    @functools.wraps(save)
    def wrapped(*args, **kwargs):
        path = save(*args, **kwargs)
        time.sleep(sleep_s)
        return path

    return wrapped


if __name__ == "__main__":
    pid_dir, sleep_s = sys.argv[1], float(sys.argv[2])
    with open(os.path.join(pid_dir, f"rank{os.environ['RANK']}"), "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    from tangram_launch import checkpoint

    checkpoint.save_checkpoint = _then_sleep(checkpoint.save_checkpoint, sleep_s)
    sys.argv = [EXAMPLE, *sys.argv[3:]]
    runpy.run_path(EXAMPLE, run_name="__main__")

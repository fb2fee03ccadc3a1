"""Elastic test worker: examples/train_gpt.py, recording each step's loss (the reporting rank: step, loss, world
size, round) as a JSON line, and pausing after each step for the seconds in PACE_FILE (read every step), so that
a test can act between checkpoints.

Usage: elastic_train.py RECORD_FILE PACE_FILE [train_gpt.py arguments]
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import train_gpt  # noqa: E402


class Recording:
    """The adapter context, with train_step recording and pacing (everything else is the context's)."""

    def __init__(self, ctx, record: str, pace: str, first_step: int, reporter: bool) -> None:
        self._ctx, self._record, self._pace, self._step, self._reporter = ctx, record, pace, first_step, reporter

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def train_step(self, batch):
        loss = self._ctx.train_step(batch)
        self._step += 1
        if self._reporter:
            line = {"step": self._step, "loss": loss, "world": int(os.environ["WORLD_SIZE"]),
                    "round": int(os.environ.get("TANGRAM_ROUND") or 0), "t": time.time()}
            with open(self._record, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())
        with open(self._pace, encoding="utf-8") as f:
            time.sleep(float(f.read().strip() or 0))
        return loss


def main() -> None:
    record, pace = sys.argv[1], sys.argv[2]
    real_train = train_gpt.train

    def train(ctx, data, **kw):
        wrapped = Recording(ctx, record, pace, kw.get("first_step", 0), kw["reporter"])
        return real_train(wrapped, data, **kw)

    train_gpt.train = train
    sys.exit(train_gpt.main(sys.argv[3:]))


if __name__ == "__main__":
    main()

"""Fault-test worker: runs examples/train_gpt.py with the torch runtime's loss turned to nan from step NAN_STEP on
(the same value on every rank, as a diverged run would report it).

Usage: nan_at_step.py NAN_STEP [train_gpt.py arguments]
"""
import os
import runpy
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "train_gpt.py")


def main() -> None:
    nan_step = int(sys.argv[1])
    from runtime_adapters.torch_native import TorchTrainingContext

    real_step = TorchTrainingContext.train_step
    calls = []

    def step_with_nan(self, batch):
        loss = real_step(self, batch)
        calls.append(loss)
        return float("nan") if len(calls) >= nan_step else loss

    TorchTrainingContext.train_step = step_with_nan
    sys.argv = [EXAMPLE, *sys.argv[2:]]
    runpy.run_path(EXAMPLE, run_name="__main__")


if __name__ == "__main__":
    main()

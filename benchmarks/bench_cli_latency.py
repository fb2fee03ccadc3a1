"""How fast the command line answers when there is nothing to plan: ``--help`` and the mistakes pre-flight refuses.

Wall time of a fresh ``python -m tangram_launch.cli ...`` process (what ``tangram-launch ...`` runs), the median of
``--runs`` runs per row, beside ``python -c pass`` for scale. Rows (each answers without starting a worker):

    help            tangram-launch --help
    plan-help       tangram-launch plan --help
    missing-script  tangram-launch --standalone --nproc-per-node 2 examples/train_gtp.py   (misspelled)
    missing-plan    tangram-launch --standalone --nproc-per-node 2 --plan no-such-plan.json examples/train_gpt.py
    wrong-nproc     tangram-launch --standalone --nproc-per-node 3 --plan examples/data/plan-tiny-2cpu.json ...

The target is at most 1 s a row (``--target-s``); the exit status is 1 when a row's median exceeds it. The
``exit`` column is the command's own status (0 for help, 2 for a refusal before any worker starts). The tree
measured is the one Python imports ``tangram_launch`` from (``PYTHONPATH``), so two trees compare with the same
command::

    python benchmarks/bench_cli_latency.py
    PYTHONPATH=/path/to/other/tree python benchmarks/bench_cli_latency.py --runs 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(REPO, "examples", "data", "plan-tiny-2cpu.json")
SCRIPT = os.path.join(REPO, "examples", "train_gpt.py")
ROWS: dict[str, list[str]] = {
    "help": ["--help"],
    "plan-help": ["plan", "--help"],
    "missing-script": ["--standalone", "--nproc-per-node", "2", os.path.join(REPO, "examples", "train_gtp.py")],
    "missing-plan": ["--standalone", "--nproc-per-node", "2", "--plan", "no-such-plan.json", SCRIPT],
    "wrong-nproc": ["--standalone", "--nproc-per-node", "3", "--plan", PLAN, SCRIPT],
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def time_command(cmd: list[str], runs: int, cwd: str) -> tuple[list[float], int]:
    """Wall times of ``runs`` runs, and the exit status of the last."""
    times, rc = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        rc = subprocess.run(cmd, env=_env(), cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        times.append(time.perf_counter() - start)
    return times, rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per row (default 5); the median is reported")
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS), help="rows to measure")
    parser.add_argument("--target-s", type=float, default=1.0, help="the most a row may take (default 1 s)")
    args = parser.parse_args(argv)
    import tangram_launch

    print(f"tree: {os.path.dirname(os.path.dirname(os.path.abspath(tangram_launch.__file__)))}; "
          f"median of {args.runs} runs; target {args.target_s:g} s")
    with tempfile.TemporaryDirectory() as cwd:  # not the repository: `python -m` would import from the cwd
        base, _ = time_command([sys.executable, "-c", "pass"], args.runs, cwd)
        print(f"{'row':16} {'median s':>9} {'min s':>7} {'exit':>5}  verdict")
        print(f"{'python -c pass':16} {statistics.median(base):9.2f} {min(base):7.2f} {0:5d}  (scale)")
        slow = []
        for name in args.rows:
            times, rc = time_command([sys.executable, "-m", "tangram_launch.cli", *ROWS[name]], args.runs, cwd)
            median = statistics.median(times)
            verdict = "ok" if median <= args.target_s else f"over {args.target_s:g} s"
            if median > args.target_s:
                slow.append(name)
            print(f"{name:16} {median:9.2f} {min(times):7.2f} {rc:5d}  {verdict}")
    if slow:
        print(f"over the target: {', '.join(slow)}")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())

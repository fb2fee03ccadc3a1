"""The README's main job on a cold profile cache: wall time after the install, and where it goes.

    python benchmarks/bench_first_run.py [--emulate-no-bf16] [--steps 5]

Runs, from the repository root, in a fresh temporary ``HOME`` (no cached profile, no plan):

    OMP_NUM_THREADS=1 tangram-launch --standalone --nproc-per-node 2 --profile --model tiny --global-batch 8 \\
        --seq-len 64 examples/train_gpt.py --steps 5

with the ``tangram-launch`` next to this Python (the venv's). Every output line is time-stamped as it arrives; the
phases are cut at the lines that open them. ``--emulate-no-bf16`` caps oneDNN and ATen at AVX2
(``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``): bf16 matmul then runs without AVX-512 BF16 or AMX, tens
of times slower than fp32, as on a Zen 3 CPU. Output format:

    first run: 30.6 s wall (exit 0), longest silence 4.1 s, emulate no bf16: yes
    longest silence after: [tangram] planned launch: plan /tmp/...
    dtype fp32: fastest measured on this cluster (fp32 0.0748 TFLOP/s, bf16 0.000657); pass --dtype to choose
    | phase                                   | s     |
    |-----------------------------------------|-------|
    | launcher start -> profiling starts      |  2.1  |
    | profiler workers start                  |  4.0  |
    | profile: GEMM                           |  2.6  |
    | profile: memory copy                    |  3.9  |
    | ...                                     |       |
    | training (5 steps)                      |  1.2  |
    | exit                                    |  0.4  |

before the phases, the run's predicted-vs-measured summary (per stage and the iteration) and the launch's line on
how each stage was priced (from layer times the profile measured, or by the analytic model).

The profile's own phases come from the workers' ``[  t s] phase`` lines (rank 0), the rest from the launcher's.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_BF16_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

# launcher milestones: (label of the phase that ends at this line, pattern of the line)
MILESTONES = [
    ("launcher start -> profiling starts", re.compile(r"no cached profile|profiling this node")),
    ("profiler workers start", re.compile(r"\[profile rank 0/")),
    ("profile measured (worker phases below)", re.compile(r"\[profile rank 0/.*\] wrote .* in [\d.]+ s")),
    ("profile cached", re.compile(r"cached the profile as")),
    ("planning", re.compile(r"plan written to")),
    ("training workers start", re.compile(r"^step\s+1\b")),
    ("training", re.compile(r"steps 1-\d+: loss")),
]
WORKER_PHASE = re.compile(r"\[profile rank 0/\d+ node \d+\] \[\s*([\d.]+)s\] (.*)")


def _group(phase: str) -> str:
    """Worker phases folded into what a reader asks about (one GEMM row, not one per dtype)."""
    for key in ("GEMM", "memory copy", "optimizer", "model layer", "wake-up cost", "stage-like sequence", "intra-node",
                "inter-node", "assemble"):
        if phase.startswith(key) or key in phase:
            return f"profile: {key}"
    return f"profile: {phase.split(' (')[0]}"


def run(steps: int, emulate_no_bf16: bool, launcher: str) -> dict:
    cmd = [launcher, "--standalone", "--nproc-per-node", "2", "--profile", "--model", "tiny", "--global-batch", "8",
           "--seq-len", "64", "examples/train_gpt.py", "--steps", str(steps)]
    with tempfile.TemporaryDirectory(prefix="tangram-first-run-") as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TANGRAM_", "XDG_CACHE", "PET_"))}
        env.update(HOME=home, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        if emulate_no_bf16:
            env.update(NO_BF16_ENV)
        lines: list[tuple[float, str]] = []
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def read() -> None:
            for line in proc.stdout:
                lines.append((time.perf_counter() - t0, line.rstrip("\n")))
        reader = threading.Thread(target=read)
        reader.start()
        rc = proc.wait()
        reader.join()
        wall = time.perf_counter() - t0
    return {"rc": rc, "wall_s": wall, "lines": lines, "cmd": cmd}


def phases(lines: list[tuple[float, str]], wall_s: float) -> list[tuple[str, float]]:
    rows: list[tuple[str, float]] = []
    last = 0.0
    worker: list[tuple[float, str]] = []
    for label, pattern in MILESTONES:
        hit = next(((t, text) for t, text in lines if t >= last and pattern.search(text)), None)
        if hit is None:
            continue
        rows.append((label, hit[0] - last))
        last = hit[0]
    rows.append(("exit", wall_s - last))
    for t, text in lines:
        m = WORKER_PHASE.search(text)
        if m:
            worker.append((float(m.group(1)), m.group(2)))
    grouped: dict[str, float] = {}
    for (t, phase), nxt in zip(worker, worker[1:] + [(None, "")]):
        end = nxt[0]
        if end is None:
            wrote = next((float(m.group(1)) for _, x in lines
                          if (m := re.search(r"\] wrote .* in ([\d.]+) s", x))), t)
            end = wrote
        grouped[_group(phase)] = grouped.get(_group(phase), 0.0) + (end - t)
    at = next((i for i, (label, _) in enumerate(rows) if label.startswith("profile measured")), len(rows) - 1)
    return rows[:at + 1] + sorted(grouped.items(), key=lambda kv: -kv[1]) + rows[at + 1:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--emulate-no-bf16", action="store_true", help="cap oneDNN and ATen at AVX2 (no bf16 hardware)")
    p.add_argument("--launcher", default=str(Path(sys.executable).with_name("tangram-launch")))
    p.add_argument("--show-output", action="store_true", help="also print the job's own output")
    args = p.parse_args(argv)
    r = run(args.steps, args.emulate_no_bf16, args.launcher)
    lines = r["lines"]
    if args.show_output or r["rc"] != 0:
        for t, text in lines:
            print(f"{t:7.2f}  {text}")
    stamps = [(0.0, "(start)")] + lines + [(r["wall_s"], "(exit)")]
    silence, after = max((b[0] - a[0], a[1]) for a, b in zip(stamps, stamps[1:]))
    print(f"first run: {r['wall_s']:.1f} s wall (exit {r['rc']}), longest silence {silence:.1f} s, "
          f"emulate no bf16: {'yes' if args.emulate_no_bf16 else 'no'}")
    print(f"longest silence after: {after[:110]}")
    for _, text in lines:
        if re.search(r"\] dtype \w+:|MFU", text):
            print(text.split("] ", 1)[-1])
    table = [text for _, text in lines]
    at = next((i for i, text in enumerate(table) if text.startswith("predicted vs measured")), None)
    if at is not None:  # the run's own predicted-vs-measured summary, stages and iteration
        for text in table[at:]:
            if not text.startswith(("predicted vs measured", "  ")):
                break
            print(text)
    for text in table:
        if "priced from measured layer times" in text or "priced by the analytic model" in text:
            print(text.split("] ", 1)[-1])
    print("| phase | s |\n|---|---|")
    for label, s in phases(lines, r["wall_s"]):
        print(f"| {label} | {s:.1f} |")
    return 0 if r["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

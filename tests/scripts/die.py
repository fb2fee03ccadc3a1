"""Launcher test worker: records each attempt, then rank DIE_RANK exits with status DIE_CODE.

Usage: die.py OUT_DIR DIE_RANK DIE_CODE   -> OUT_DIR/attempt<TORCHELASTIC_RESTART_COUNT>.rank<RANK>
"""
import os
import sys


def main() -> None:
    out_dir, die_rank, die_code = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    name = f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}.rank{rank}"
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
        f.write(os.environ.get("TANGRAM_TORCHRUN_RANK", str(rank)))
    if rank == die_rank:
        sys.exit(die_code)


if __name__ == "__main__":
    main()

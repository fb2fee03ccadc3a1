"""Launcher test worker: writes its environment and argv to OUT_DIR/rank<RANK>.json (torch's test_run.py style).

Usage: dump_env.py OUT_DIR [args...]   (also runnable as ``-m dump_env`` with tests/scripts on sys.path)
"""
import json
import os
import sys


def main() -> None:
    out_dir = sys.argv[1]
    record = {
        "env": dict(os.environ),
        "argv": list(sys.argv),
        "name": __name__,
        "file": os.path.abspath(__file__),
        "path0": sys.path[0],
        "cwd": os.getcwd(),
    }
    path = os.path.join(out_dir, f"rank{os.environ['RANK']}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()

"""Bad inputs for the CLI, and a runner that calls the CLI in this process and reports how it ended.

Used by tests/test_bad_inputs.py (the listed regression cases and a seeded fuzz run). ``run_cli(argv)`` returns
(exit status, stderr, seconds); a Python exception escaping ``main`` (a traceback) or a run past the time bound
fails the calling test with the exception.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "examples" / "clusters" / "cpu-2.yaml"
PLAN = REPO / "examples" / "data" / "plan-tiny-2cpu.json"


class TimeBoundExceeded(Exception):
    pass


def run_cli(argv: list[str], *, time_bound_s: float = 20.0) -> tuple[int, str, float]:
    from tangram_launch.cli import main

    def on_alarm(signum, frame):
        raise TimeBoundExceeded(f"{argv} ran longer than {time_bound_s} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, time_bound_s)
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as exc:  # argparse's usage errors
                rc = exc.code if isinstance(exc.code, int) else 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return int(rc), err.getvalue(), time.perf_counter() - t0


def tiny_model() -> dict[str, Any]:
    return {"name": "tiny", "num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 4,
            "ffn_hidden_size": 256, "vocab_size": 256, "max_seq_len": 64, "ffn_type": "gelu"}


def hf_config() -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def cluster_yaml(**node: Any) -> str:
    import yaml

    entry = {"name": "n0", "gpu": "a100-80gb", "count": 2, **node}
    return yaml.safe_dump({"name": "c", "nodes": [entry]})


def frozen_plan(**changes: Any) -> dict[str, Any]:
    plan = json.loads(PLAN.read_text())
    plan.update(changes)
    return plan


# --- file contents that must be refused whatever the file is for ---------------------------------------------

def hostile_files(tmp: Path) -> dict[str, str]:
    """name -> path of a file (or special file) no input may accept."""
    out = {}

    def put(name: str, data: bytes) -> None:
        p = tmp / name
        p.write_bytes(data)
        out[name] = str(p)

    put("invalid-utf8.yaml", b"name: \xff\xfe\n")
    put("deep-json.json", b"[" * 100_000 + b"]" * 100_000)
    put("deep-yaml.yaml", b"a: " + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    put("deep-json-object.json", b'{"a":' * 50_000 + b"1" + b"}" * 50_000)
    put("huge-int.yaml", b"name: x\nnum_layers: " + b"9" * 5000 + b"\n")
    put("huge-int.json", b'{"name": "x", "num_layers": ' + b"9" * 5000 + b"}")
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i, (prev, cur) in enumerate(zip("abcdefgh", "bcdefghi")):
        bomb.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]")
    put("alias-bomb.yaml", ("\n".join(bomb) + "\n").encode())
    put("too-big.yaml", b"# " + b"x" * (17 << 20) + b"\n")
    put("duplicate-key.yaml", b"name: x\nnodes: []\nname: y\n")
    put("duplicate-key.json", b'{"name": "x", "nodes": [], "name": "y"}')
    fifo = tmp / "fifo.yaml"
    os.mkfifo(fifo)
    out["fifo"] = str(fifo)
    out["dev-zero"] = "/dev/zero"
    out["directory"] = str(tmp)
    return out


# --- a seeded generator of malformed inputs ------------------------------------------------------------------------

HOSTILE_VALUES: list[Any] = [None, True, False, -1, 0, 1.5, 1.0, 1e30, float("nan"), float("inf"), -float("inf"),
                             10 ** 40, 2 ** 63, "x", "", "1e30", "\u202e", [], {}, [1, 2], {"a": 1}, [[[[]]]],
                             "a" * 300]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return obj


def mutate(doc: Any, rng) -> Any:
    """One to three random edits: a value replaced by a hostile one, a key deleted or added, a list emptied."""
    import copy

    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        paths = _paths(doc)
        path = paths[rng.randrange(len(paths))]
        kind = rng.random()
        if kind < 0.7 or not path:
            doc = _set(doc, path, copy.deepcopy(rng.choice(HOSTILE_VALUES)))
        elif kind < 0.85:
            parent = doc
            for p in path[:-1]:
                parent = parent[p]
            if isinstance(parent, dict):
                parent.pop(path[-1], None)
            elif isinstance(parent, list) and parent:
                parent.pop(path[-1] if path[-1] < len(parent) else -1)
        else:
            parent = doc
            for p in path[:-1]:
                parent = parent[p]
            if isinstance(parent, dict):
                parent[rng.choice(["extra", "nmae", "count", "layers"])] = rng.choice(HOSTILE_VALUES)
    return doc


def write_doc(path: Path, doc: Any, rng) -> str:
    """As YAML or JSON (JSON with NaN/Infinity when the document holds them: what a careless writer emits)."""
    import yaml

    if path.suffix == ".json" or rng.random() < 0.3:
        path = path.with_suffix(".json")
        path.write_text(json.dumps(doc))
    else:
        path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return str(path)

"""The worker's side of a switch, through files in the run directory (no collective on the training path).

The launcher asks for a checkpoint at a step boundary by writing ``RUN_DIR/adapt/switch-request.json``
(``{"at_step": S}``, S a few steps ahead of every rank). Each rank looks at the file after every step (one ``stat``,
and a read when it changed); all ranks pass step S knowing the request, because the launcher only keeps a request
it wrote before any rank had timed step S (:func:`request_in_time`). At S every rank saves into the launcher's
checkpoint directory (collective) and stops; the launcher restarts them under the new plan and they resume there.

The reporting rank also writes what the launcher cannot see: the step the script trains to
(``progress.json``), and how long each save took (``saves.jsonl``), which prices the next switch.
"""
from __future__ import annotations

import json
import os
import time
from typing import Mapping

from tangram_launch.specs.yamlio import dump_text_file

ENV_RUN_DIR = "TANGRAM_RUN_DIR"  # the same name as runtime_adapters.stage_timing.ENV_RUN_DIR
REQUEST_NAME = "switch-request.json"
SAVES_NAME = "saves.jsonl"
PROGRESS_NAME = "progress.json"


def adapt_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "adapt")


def _write_json(path: str, data: Mapping) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    dump_text_file(json.dumps(data), path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --- the launcher's side -------------------------------------------------------------------------------------------

def write_request(run_dir: str, at_step: int, *, plan_hash: str) -> str:
    path = os.path.join(adapt_dir(run_dir), REQUEST_NAME)
    _write_json(path, {"at_step": int(at_step), "new_plan_hash": plan_hash})
    return path


def clear_request(run_dir: str) -> None:
    try:
        os.remove(os.path.join(adapt_dir(run_dir), REQUEST_NAME))
    except FileNotFoundError:
        pass


def request_in_time(max_step_timed: int, at_step: int) -> bool:
    """A request written before any rank timed ``at_step`` is seen by every rank at ``at_step``: a rank reads the
    file after writing its timing line of a step."""
    return max_step_timed < at_step


def read_saves(run_dir: str) -> list[dict]:
    out = []
    try:
        with open(os.path.join(adapt_dir(run_dir), SAVES_NAME), encoding="utf-8") as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and isinstance(line.get("save_s"), (int, float)):
                    out.append(line)
    except OSError:
        pass
    return out


def read_steps_total(run_dir: str) -> int | None:
    data = _read_json(os.path.join(adapt_dir(run_dir), PROGRESS_NAME)) or {}
    value = data.get("steps_total")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- the worker's side ---------------------------------------------------------------------------------------------

class SwitchWatch:
    """Reads the request file when it changed (a ``stat`` per step otherwise)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        run_dir = (os.environ if env is None else env).get(ENV_RUN_DIR)
        self.path = os.path.join(adapt_dir(run_dir), REQUEST_NAME) if run_dir else None
        self.run_dir = run_dir
        self._seen: tuple[float, int] | None = None
        self._at_step: int | None = None

    def at_step(self) -> int | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self._at_step = None, None
            return None
        key = (st.st_mtime, st.st_size)
        if key != self._seen:
            self._seen = key
            value = (_read_json(self.path) or {}).get("at_step")
            self._at_step = value if isinstance(value, int) else None
        return self._at_step

    def stop_at(self, step: int) -> bool:
        """Whether this step is the one to checkpoint at and stop."""
        return self.at_step() == step

    def record_save(self, step: int, save_s: float) -> None:
        if self.run_dir is None:
            return
        path = os.path.join(adapt_dir(self.run_dir), SAVES_NAME)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "save_s": save_s, "end_unix_s": time.time()}) + "\n")

    def announce_steps(self, steps_total: int) -> None:
        if self.run_dir is not None:
            _write_json(os.path.join(adapt_dir(self.run_dir), PROGRESS_NAME), {"steps_total": int(steps_total)})

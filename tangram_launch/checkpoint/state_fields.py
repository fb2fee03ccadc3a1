"""RNG states and optimizer state from a checkpoint, checked field by field before anything is restored.

``rng/rank_<r>.json`` and ``optimizer.json`` are input: a state of the wrong length, ``lr: "abc"``, ``betas:
[2, 0]`` or ``step: -1`` would otherwise fail deep inside torch, numpy or the first optimizer step (or train on
silently). Each is refused with a SpecError naming the file, the field, the value and what would be valid.
"""
from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Mapping

from tangram_launch.errors import SpecError

_MT_WORDS = 624  # Mersenne Twister state words (python's random and numpy's legacy RandomState)
_U32 = (1 << 32) - 1
_MAX_B64_CHARS = 1 << 20
_NONNEGATIVE = frozenset({"lr", "initial_lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay",
                          "initial_accumulator_value", "max_lr", "base_lr"})
_UNIT_INTERVAL = frozenset({"betas", "beta1", "beta2", "alpha", "rho"})  # each in [0, 1)
_RNG_KEYS = frozenset({"torch", "python", "numpy", "cuda"})
ABSENT = object()  # check_hparam's ``current`` for a key the optimizer's group does not have


def _refuse(message: str, *, source: str, field: str, value: Any = None, valid: str | None = None) -> SpecError:
    if isinstance(value, str):
        value = value[:80]
    elif isinstance(value, (list, dict)):
        value = type(value).__name__
    return SpecError(message, source=source, field=field, value=value, valid=valid)


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def rng_bytes(value: Any, *, length: int, source: str, field: str) -> bytes:
    """A base64 RNG state of exactly ``length`` bytes."""
    if not isinstance(value, str) or len(value) > _MAX_B64_CHARS:
        raise _refuse("an RNG state is base64 text", source=source, field=field, value=value)
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse("not base64", source=source, field=field, value=value) from None
    if len(raw) != length:
        raise _refuse(f"an RNG state of {len(raw)} bytes", source=source, field=field,
                      valid=f"{length} bytes (this torch's generator state)")
    return raw


def _words(value: Any, n: int, *, source: str, field: str) -> None:
    if not isinstance(value, list) or len(value) != n or not all(
            type(w) is int and 0 <= w <= _U32 for w in value):
        raise _refuse(f"must be {n} unsigned 32-bit integers", source=source, field=field, value=value)


def check_rng_state(state: Any, *, source: str, torch_bytes: int) -> None:
    """Everything ``restore_rng_state`` reads, checked (``torch_bytes``: the length of this torch's CPU state)."""
    if not isinstance(state, Mapping):
        raise _refuse("an RNG state file holds a JSON object", source=source, field="rng", value=type(state).__name__)
    unknown = sorted(set(state) - _RNG_KEYS)
    if unknown or "torch" not in state or "python" not in state:
        raise _refuse("an RNG state holds torch and python states (and numpy, cuda)", source=source,
                      field=f"rng.{unknown[0]}" if unknown else "rng", valid=", ".join(sorted(_RNG_KEYS)))
    rng_bytes(state["torch"], length=torch_bytes, source=source, field="rng.torch")
    py = state["python"]
    if not isinstance(py, Mapping) or py.get("version") != 3 or isinstance(py.get("version"), bool):
        raise _refuse("python's random state is {version: 3, state, gauss_next}", source=source,
                      field="rng.python.version", value=py.get("version") if isinstance(py, Mapping) else py)
    _words(py.get("state"), _MT_WORDS + 1, source=source, field="rng.python.state")
    if py["state"][-1] > _MT_WORDS:
        raise _refuse("the position in python's random state", source=source, field="rng.python.state[624]",
                      value=py["state"][-1], valid=f"0..{_MT_WORDS}")
    if py.get("gauss_next") is not None and not _finite(py.get("gauss_next")):
        raise _refuse("must be a finite number or null", source=source, field="rng.python.gauss_next",
                      value=py.get("gauss_next"))
    if "numpy" in state:
        n = state["numpy"]
        if not isinstance(n, Mapping) or n.get("name") != "MT19937":
            raise _refuse("numpy's RNG state is a legacy MT19937 state", source=source, field="rng.numpy.name",
                          value=n.get("name") if isinstance(n, Mapping) else n, valid="MT19937")
        _words(n.get("keys"), _MT_WORDS, source=source, field="rng.numpy.keys")
        if type(n.get("pos")) is not int or not 0 <= n["pos"] <= _MT_WORDS:
            raise _refuse("out of range", source=source, field="rng.numpy.pos", value=n.get("pos"),
                          valid=f"0..{_MT_WORDS}")
        if n.get("has_gauss") not in (0, 1) or isinstance(n.get("has_gauss"), bool):
            raise _refuse("must be 0 or 1", source=source, field="rng.numpy.has_gauss", value=n.get("has_gauss"))
        if not _finite(n.get("cached_gaussian")):
            raise _refuse("must be a finite number", source=source, field="rng.numpy.cached_gaussian",
                          value=n.get("cached_gaussian"))
    if "cuda" in state and not isinstance(state["cuda"], str):
        raise _refuse("a CUDA RNG state is base64 text", source=source, field="rng.cuda", value=state["cuda"])


# --- optimizer ------------------------------------------------------------------------------------------------------

def _scalar_ok(value: Any) -> bool:
    if isinstance(value, list):
        return len(value) <= 64 and all(_scalar_ok(v) for v in value)
    return value is None or isinstance(value, (bool, str)) or _finite(value)


def check_optimizer_file(extra: Any, *, source: str) -> dict[str, dict[str, Any]]:
    """optimizer.json: {parameter name: {"hparams": {...}, "scalars": {...}}} with JSON scalars only."""
    if not isinstance(extra, dict):
        raise _refuse("optimizer.json holds a JSON object", source=source, field="optimizer", value=extra)
    for name, entry in extra.items():
        if not isinstance(entry, dict) or set(entry) - {"hparams", "scalars"}:
            raise _refuse("each parameter's entry is {hparams, scalars}", source=source, field=name, value=entry)
        for part in ("hparams", "scalars"):
            values = entry.get(part, {})
            if not isinstance(values, dict):
                raise _refuse("must be a JSON object", source=source, field=f"{name}.{part}", value=values)
            for k, v in values.items():
                if not _scalar_ok(v):
                    raise _refuse("must be null, true/false, a string, a finite number or a list of them",
                                  source=source, field=f"{name}.{part}.{k}", value=v)
        step = entry.get("scalars", {}).get("step")
        if step is not None and not (_finite(step) and step >= 0):
            raise _refuse("an optimizer step count is a number >= 0", source=source, field=f"{name}.scalars.step",
                          value=step)
    return extra


def check_hparam(key: str, saved: Any, current: Any, *, source: str, field: str) -> Any:
    """A saved group hyper-parameter checked against the current group's value of the same key: same kind (bool,
    number, string, tuple of the same length), finite, in range for the keys we know; returns it typed like the
    current value."""
    import torch

    if isinstance(saved, torch.Tensor):  # Megatron's format keeps torch values: check the number, keep the tensor
        if saved.numel() != 1 or saved.is_complex():
            raise _refuse("an optimizer hyper-parameter must be one number", source=source, field=field,
                          value=f"tensor of shape {list(saved.shape)}")
        check_hparam(key, saved.item(), current, source=source, field=field)
        return saved
    if current is ABSENT:  # a key this optimizer's group lacks (an LR scheduler's initial_lr, another class's)
        if key in _NONNEGATIVE and not (_finite(saved) and saved >= 0):
            raise _refuse("must be a finite number >= 0", source=source, field=field, value=saved)
        return saved
    if isinstance(current, torch.Tensor) and current.numel() == 1:
        current = current.item()
    if isinstance(current, bool):
        if not isinstance(saved, bool):
            raise _refuse("must be true or false", source=source, field=field, value=saved)
        return saved
    if isinstance(current, (int, float)):
        if isinstance(saved, str) and isinstance(current, float) and math.isinf(current):
            saved = float(saved) if saved in ("inf", "-inf") else saved  # _jsonable writes inf as text
        if not (_finite(saved) or (isinstance(saved, float) and math.isinf(saved) and math.isinf(current))):
            raise _refuse("an optimizer hyper-parameter must be a finite number", source=source, field=field,
                          value=saved, valid="a number like the optimizer's own")
        if key in _NONNEGATIVE and saved < 0:
            raise _refuse("must be >= 0", source=source, field=field, value=saved)
        if key in _UNIT_INTERVAL and not 0 <= saved < 1:
            raise _refuse("must be in [0, 1)", source=source, field=field, value=saved)
        return saved
    if isinstance(current, (tuple, list)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(current):
            raise _refuse(f"must be a list of {len(current)} values", source=source, field=field, value=saved)
        return type(current)(check_hparam(key, s, c, source=source, field=f"{field}[{i}]")
                             for i, (s, c) in enumerate(zip(saved, current)))
    if isinstance(current, str) and not isinstance(saved, str):
        raise _refuse("must be a string", source=source, field=field, value=saved)
    if current is None and not (saved is None or isinstance(saved, (bool, str))):
        raise _refuse("must be null, true/false or a string", source=source, field=field, value=saved)
    return saved


__all__ = ["ABSENT", "check_rng_state", "rng_bytes", "check_optimizer_file", "check_hparam"]

"""What an FFN activation written as separate tensor ops costs beyond one kernel (ModelSpec.activation_impl): the
bytes it keeps for the backward (memory.py), the bytes its ops move (compute.py) and the operators it dispatches
(host_floor.py), one row per implementation so the three stay one account of the same ops.

Each op of the formula is its own kernel and keeps its own operands. Counted on transformers' modules
(tests/test_composed_activation.py: saved-tensor hooks, aten dispatch counts, a TorchFunctionMode emulating CUDA
autocast):

* gelu_new, 0.5 x (1 + tanh(c (x + 0.044715 x^3))) (Hugging Face's NewGELUActivation, minGPT's NewGELU):
  - kept beyond the kernel's input: the tanh output, 0.5 x and 1 + tanh beside the input pow keeps, 3 p. Under CUDA
    autocast pow is an fp32 op: it keeps an fp32 copy of the input instead of the input, and tanh and the sums follow
    it into fp32: 4 + 4 + 4 + p against the kernel's p, 12 bytes in 16 bit;
  - moved: pow, 0.044715 *, x +, c *, tanh, 1 +, 0.5 * x, the product: 2+2+3+2+2+2+2+3 = 18 p; under autocast pow
    reads x and writes an fp32 copy first, everything up to the product is fp32 and the down GEMM casts it back:
    6+8+8+10+8+8+8+4+10+6 = 76 bytes against the kernel's 4;
  - dispatched: 9 operators forward against F.gelu's 1, 14 backward against 3.
* gelu_fast (x x and a product of two sums instead of pow; nothing of autocast's fp32 list): keeps 6 p, moves 21 p.
* quick_gelu, x sigmoid(1.702 x): keeps its sigmoid, p; moves 7 p.
"""
from __future__ import annotations

from typing import NamedTuple

from tangram_launch.specs.training import DTYPE_BYTES


class PerElement(NamedTuple):
    """Bytes per FFN element: ``per_p`` in units of the activation dtype's bytes, or ``autocast_bytes`` flat where
    autocast at 16 bit promotes the ops (None: nothing of autocast's fp32 list, the dtype's figure holds)."""

    per_p: int
    autocast_bytes: float | None

    def bytes(self, dtype_bytes: int, autocast: bool) -> float:
        if autocast and dtype_bytes < DTYPE_BYTES["fp32"] and self.autocast_bytes is not None:
            return self.autocast_bytes
        return float(self.per_p * dtype_bytes)


class Composed(NamedTuple):
    saved: PerElement  # kept for the backward beyond a kernel's input
    traffic: PerElement  # moved by all of the forward's ops: it replaces a kernel's figure (2 p)
    ops: tuple[int, int]  # (forward, backward) operators dispatched beyond one F.gelu


COMPOSED = {
    "gelu_new": Composed(PerElement(3, 12.0), PerElement(18, 76.0), (8, 11)),
    "gelu_fast": Composed(PerElement(6, None), PerElement(21, None), (9, 13)),
    "quick_gelu": Composed(PerElement(1, None), PerElement(7, None), (3, 5)),
}

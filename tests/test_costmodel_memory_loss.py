"""The loss's bytes per logit as the caching allocator reserves them (memory.CROSS_ENTROPY_KINDS): the live tensors
of each implementation, replayed through a model of PyTorch's caching allocator (a freed block serves only a request
it can hold, best fit, split on reuse; blocks of different segments never merge; with expandable segments one
segment per stream that grows at its end), give the reserved peak the cost model charges."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.memory import (
    CROSS_ENTROPY_KINDS,
    cross_entropy_allocated_bytes_per_logit,
    cross_entropy_bytes_per_logit,
    cross_entropy_stranded_bytes_per_logit,
)


class CachingAllocator:
    """Segments of [size, free] blocks; ``expandable``: one segment, grown at its end when no free block fits."""

    def __init__(self, expandable: bool) -> None:
        self.expandable = expandable
        self.segments: list[list[list]] = []
        self.live = self.peak_live = self.peak_reserved = 0

    @property
    def reserved(self) -> int:
        return sum(size for seg in self.segments for size, _ in seg)

    def alloc(self, size: int) -> list:
        """The block now holding ``size`` bytes (its handle for free)."""
        fits = [(blk[0], i, j) for i, seg in enumerate(self.segments) for j, blk in enumerate(seg)
                if blk[1] and blk[0] >= size]
        block = [size, False]
        if fits:
            _, i, j = min(fits)
            seg = self.segments[i]
            rest = seg[j][0] - size
            seg[j] = block
            if rest:
                seg.insert(j + 1, [rest, True])
        elif self.expandable and self.segments:
            seg = self.segments[0]
            if seg[-1][1]:  # a free block at the end grows into the request
                seg[-1] = block
            else:
                seg.append(block)
        else:
            self.segments.append([block])
        self.live += size
        self.peak_live = max(self.peak_live, self.live)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: list) -> None:
        seg = next(s for s in self.segments if any(b is block for b in s))
        self.live -= block[0]
        block[1] = True
        k = 0
        while k < len(seg) - 1:  # merge neighbouring free blocks of the segment
            if seg[k][1] and seg[k + 1][1]:
                seg[k] = [seg[k][0] + seg.pop(k + 1)[0], True]
            else:
                k += 1


def replay_eager_loss(n: int, p: int, expandable: bool, keep_logits: bool = False) -> CachingAllocator:
    """torchtitan's step: logits = output(h) (p bytes); F.cross_entropy(logits.float()): the upcast (a new fp32
    tensor unless p is 4), the saved log-softmax output, the upcast freed; `del pred` (unless ``keep_logits``: a
    trainer that returns the logits); the backward: nll_loss's fp32 gradient, then log_softmax's."""
    a = CachingAllocator(expandable)
    pred = a.alloc(p * n)
    upcast = a.alloc(4 * n) if p < 4 else None
    a.alloc(4 * n)  # log-softmax output, saved
    if upcast is not None:
        a.free(upcast)
    if not keep_logits:
        a.free(pred)
    a.alloc(4 * n)  # nll_loss backward
    a.alloc(4 * n)  # log_softmax backward: the loss's peak
    return a


def replay_megatron_loss(n: int, p: int, expandable: bool) -> CachingAllocator:
    """Megatron's vocab-parallel loss: the logits (p), their fp32 copy (the softmax, in place), the logits freed after
    the forward, the gradient formed in the softmax's place and cast back to p bytes."""
    a = CachingAllocator(expandable)
    logits = a.alloc(p * n)
    if p < 4:
        a.alloc(4 * n)
        a.free(logits)
        a.alloc(p * n)  # the cast of the fp32 gradient back to the logits' dtype
    return a


def replay_compiled_loss(n: int, p: int, expandable: bool) -> CachingAllocator:
    """The eager loss compiled: the logits (p) saved for the backward, whose fused kernel writes their gradient (p)."""
    a = CachingAllocator(expandable)
    a.alloc(p * n)
    a.alloc(p * n)
    return a


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=1, max_value=1 << 20), p=st.sampled_from([2, 4]), expandable=st.booleans())
def test_the_allocator_reserves_what_the_cost_model_charges_per_logit(n, p, expandable):
    eager = replay_eager_loss(n, p, expandable)
    assert eager.peak_live == cross_entropy_allocated_bytes_per_logit("eager", p) * n
    assert eager.peak_reserved == cross_entropy_bytes_per_logit("eager", p) * n
    megatron = replay_megatron_loss(n, p, expandable)
    assert megatron.peak_live == cross_entropy_allocated_bytes_per_logit("fused", p) * n
    assert megatron.peak_reserved == cross_entropy_bytes_per_logit("fused", p) * n
    if p < 4:  # 16-bit logits kept alive: the same reserve, all of it live
        kept = replay_eager_loss(n, p, expandable, keep_logits=True)
        assert kept.peak_reserved == kept.peak_live == cross_entropy_bytes_per_logit("eager", p) * n
    compiled = replay_compiled_loss(n, p, expandable)
    assert compiled.peak_reserved == compiled.peak_live == cross_entropy_bytes_per_logit("compiled", p) * n


@pytest.mark.unit
def test_only_the_upcast_eager_loss_strands_a_block():
    """bf16 eager: 12 bytes live, 14 reserved; fp32 eager and every other loss: nothing stranded."""
    assert cross_entropy_bytes_per_logit("eager", 2) == 14
    assert cross_entropy_bytes_per_logit("eager", 4) == 12
    assert cross_entropy_bytes_per_logit("fused", 2) == 6
    assert cross_entropy_bytes_per_logit("fused", 4) == 4
    for kind in CROSS_ENTROPY_KINDS:
        if kind != "eager":
            for p in (1, 2, 4):
                assert cross_entropy_stranded_bytes_per_logit(kind, p) == 0
    with pytest.raises(ValueError, match="cross_entropy 'chunked'.*fused, eager"):
        cross_entropy_bytes_per_logit("chunked", 2)

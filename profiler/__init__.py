"""The profiler's workers (``python -m profiler.worker``, started by ``tangram-launch profile``)."""

# how a CPU device's --model calls are timed (worker --layer-timing): each call followed by an all-to-all of the
# node's processes, or blocks of back-to-back calls with an all-to-all after each block
LAYER_TIMINGS = ("interleaved", "back-to-back")

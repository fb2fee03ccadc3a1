"""The order the micro-batch sizes are searched in does not change the plan where the composer is exact (up to
``PlannerOptions.exact_islands`` islands): the default search scores as well as the best of one search per size
(``microbatch_sequences=(d,)``), whichever size it visits first and whatever that size's plan then bounds.

Above exact_islands islands it can (docs/planner.md, restriction 3): the merged search over island sets is exact for
the closed form, not for the simulated 1F1B the plan is ranked by (it has no complete pass), so which near-tie plans
reach the simulation depends on the bounds and options a size is composed with. The slow test pins the measured
case so that a fix shows."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram_launch.errors import InfeasibleError
from tangram_launch.islands import build_islands
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.planner.size_search import divisors
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec

# GPU types that each form their own island and all train in fp16
GPUS = ("a100-80gb", "a100-40gb", "v100-32gb", "v100-16gb", "t4", "h100-sxm", "l4")
RUNTIMES = ("torch", "deepspeed", "megatron")
SCHEDULES = ("1F1B", "auto", "interleaved-1F1B")
EXACT_ISLANDS = PlannerOptions().exact_islands


@st.composite
def small_cases(draw) -> tuple[ClusterSpec, ModelSpec, TrainingSpec, str, str, int]:
    """A cluster of 2..exact_islands islands (one GPU type each, 1-4 GPUs per node, 1-2 nodes, some behind a slow
    link), a small model, a batch of 12, 16 or 24 sequences, a runtime, a schedule, and the composer's exact_islands
    (the default, or as low as the island count: the exact search is then the only one that runs)."""
    k = draw(st.integers(2, EXACT_ISLANDS))
    types = draw(st.permutations(GPUS))[:k]
    nodes, fast = [], []
    for t in types:
        per_node = draw(st.sampled_from((1, 2, 4)))
        on_fabric = draw(st.booleans())
        for j in range(draw(st.integers(1, 2))):
            nodes.append({"name": f"{t}-{j}", "gpu": t, "count": per_node})
            if on_fabric:
                fast.append(nodes[-1]["name"])
    net = {"default": {"bandwidth_GBps": draw(st.sampled_from((1.0, 6.0))), "latency_us": 30}}
    if len(fast) > 1:
        net["fabrics"] = [{"name": "ib", "nodes": fast, "bandwidth_GBps": 25, "latency_us": 2}]
    cluster = ClusterSpec.from_dict({"name": "size-order", "network": net, "nodes": nodes})
    heads = draw(st.sampled_from((4, 8)))
    hidden = heads * 64
    model = ModelSpec(name="size-order", num_layers=draw(st.integers(4, 8)), hidden_size=hidden, num_heads=heads,
                      num_kv_heads=heads, ffn_hidden_size=4 * hidden, vocab_size=1000, max_seq_len=256)
    training = TrainingSpec(global_batch=draw(st.sampled_from((12, 16, 24))), seq_len=draw(st.sampled_from((128, 256))),
                            dtype="fp16")
    exact = draw(st.sampled_from((EXACT_ISLANDS, len(build_islands(cluster, dtype="fp16").islands))))
    return cluster, model, training, draw(st.sampled_from(RUNTIMES)), draw(st.sampled_from(SCHEDULES)), exact


def _score(case, sizes=None) -> float | None:
    """The search over the islands as built (the idle-island split searches again from whichever plan this finds,
    so the independence of the size order is the first search's property)."""
    cluster, model, training, runtime, schedule, exact = case
    try:
        plan = search(cluster, model, training, runtime=runtime, parallelizer="megatron",
                      options=PlannerOptions(max_workers=1, progress=False, schedule=schedule, exact_islands=exact,
                                             microbatch_sequences=sizes, split_idle_islands=False)).plan
    except InfeasibleError:
        return None
    return plan.predicted.iteration_time_s


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(small_cases())
def test_up_to_exact_islands_the_plan_does_not_depend_on_the_size_order(case):
    cluster, _, training, *_ = case
    assert len(build_islands(cluster, dtype="fp16").islands) <= case[-1]
    default = _score(case)
    each = [s for d in divisors(training.global_batch) if (s := _score(case, (d,))) is not None]
    if not each:
        assert default is None, "the default search found a plan no single size has"
        return
    assert default is not None, f"the default search found nothing; a single size found {min(each)}"
    # every size alone, so visited first and bounded by nothing else: the default search's order changes nothing
    assert default == pytest.approx(min(each), rel=1e-12, abs=0.0)


@pytest.mark.slow  # two searches of 4,096 GPUs: about a minute on a loaded machine
def test_llama3_405b_on_4096_gpus_b16_after_b8_finds_b16s_own_plan():
    """benchmarks/bench_planner_scale.py's llama3-405b-4096gpu row under torch (8 islands, 6 of them usable: the
    merged search composes b = 16's classes): b = 16 alone finds a plan (A100 islands in front) that b = 16 after
    b = 8 missed (H200 in front, slower by the same model) until the bottleneck floors (bounds.py) pruned what the
    merged search composes with. The order dependence above exact_islands remains (docs/planner.md, restriction 3;
    the seven-island case below); this pins that the row no longer shows it."""
    from tangram_launch.specs.model import load_model

    root = Path(__file__).resolve().parent.parent
    cluster = ClusterSpec.load(str(root / "examples" / "clusters" / "llama3-405b-4096gpu.yaml"))
    model, training = load_model("llama3-405b"), TrainingSpec(global_batch=1024, seq_len=8192, dtype="bf16")
    islands = build_islands(cluster, dtype="bf16")

    def score(sizes):
        return search(cluster, model, training, runtime="torch", islands=islands,
                      options=PlannerOptions(max_workers=1, progress=False, microbatch_sequences=sizes)
                      ).plan.predicted.iteration_time_s

    assert score((8, 16)) == pytest.approx(score((16,)), rel=1e-12, abs=0.0)


def _seven_islands() -> ClusterSpec:
    """28 GPUs in 7 islands: 8 A100-80GB in a node, 2 V100-16GB and 2 L4 nodes of 2, A100-40GB, H100, T4 and
    V100-32GB in 2 nodes of 2 each; the A100-40GB, T4 and V100-32GB nodes on a 25 GB/s fabric, the rest at 6 GB/s."""
    nodes = [{"name": "a100-80gb-0", "gpu": "a100-80gb", "count": 8},
             {"name": "v100-16gb-0", "gpu": "v100-16gb", "count": 2}, {"name": "l4-0", "gpu": "l4", "count": 2}]
    for t in ("a100-40gb", "h100-sxm", "t4", "v100-32gb"):
        nodes += [{"name": f"{t}-{j}", "gpu": t, "count": 2} for j in range(2)]
    fast = [n["name"] for n in nodes if n["gpu"] in ("a100-40gb", "t4", "v100-32gb")]
    return ClusterSpec.from_dict({"name": "seven-islands", "nodes": nodes, "network": {
        "default": {"bandwidth_GBps": 6.0, "latency_us": 30},
        "fabrics": [{"name": "ib", "nodes": fast, "bandwidth_GBps": 25, "latency_us": 2}]}})


@pytest.mark.slow  # two searches of a 7-island cluster: about half a minute on a loaded machine
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="above exact_islands the merged search is not exact for the simulated 1F1B (docs/planner.md, "
                          "restriction 3): after b = 4, b = 2's class keeps 6 islands and is composed merged")
def test_seven_islands_b2_after_b4_finds_b2s_own_plan():
    """Found by a hypothesis search over 6-7-island clusters. b = 2 alone: its seed round's plan leaves 5 hopeful
    islands in its full round (class_composition.hopeful_islands), composed exactly with a complete pass. After
    b = 4, whose plan bounds b = 2 less tightly, 6 remain and the merged search loses b = 2's best plan (4 islands,
    H100 in front)."""
    cluster = _seven_islands()
    model = ModelSpec(name="seven", num_layers=16, hidden_size=1024, num_heads=8, num_kv_heads=8,
                      ffn_hidden_size=4096, vocab_size=32000, max_seq_len=1024)
    training = TrainingSpec(global_batch=64, seq_len=1024, dtype="fp16")
    case = (cluster, model, training, "torch", "auto", EXACT_ISLANDS)
    assert len(build_islands(cluster, dtype="fp16").islands) == 7
    alone, after = _score(case, (2,)), _score(case, (2, 4))
    assert alone is not None and after is not None
    assert after == pytest.approx(alone, rel=1e-12, abs=0.0)

"""Stage-boundary p2p (costmodel/boundary.py): each DP replica's rows over its own node pair, a node's network
interface shared by the ranks it hosts, NVLink/PCIe inside a node; one function for the composer, the reference and
hand-written plans."""
from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.cli import main
from tangram_launch.costmodel import boundary
from tangram_launch.costmodel.efficiency import GBPS, NET_EFFICIENCY
from tangram_launch.islands import build_islands
from tangram_launch.planner.allocation import LinkModel
from tangram_launch.specs.cluster import ClusterSpec, GpuRef
from tangram_launch.specs.shape import StageShape

ROWS_BYTES = 64e6  # one replica's activations per micro-batch


def _cluster(nodes: int, per_node: int, *, latency_us: float = 50.0, gpu: str = "a100-40gb") -> ClusterSpec:
    return ClusterSpec.from_dict({"name": "gen", "network": {"default": {"bandwidth_GBps": 6.0,
                                                                         "latency_us": latency_us}},
                                  "nodes": [{"name": f"n{i}", "gpu": gpu, "count": per_node} for i in range(nodes)]})


def _gpus(*places: tuple[int, int]) -> tuple[GpuRef, ...]:
    return tuple(GpuRef(f"n{node}", local) for node, local in places)


def _boundary_s(cluster: ClusterSpec, nbytes: float, a: StageShape, gpus_a, b: StageShape, gpus_b) -> float:
    return LinkModel(cluster, [], nbytes).stage_s(a, gpus_a, b, gpus_b)


def test_eight_replicas_on_eight_node_pairs_cost_what_one_replica_costs_on_one_pair():
    cluster = _cluster(16, 8)
    one = _boundary_s(cluster, ROWS_BYTES, StageShape(dp=1), _gpus((0, 0)), StageShape(dp=1), _gpus((8, 0)))
    eight = _boundary_s(cluster, 8 * ROWS_BYTES, StageShape(dp=8), _gpus(*((k, 0) for k in range(8))),
                        StageShape(dp=8), _gpus(*((8 + k, 0) for k in range(8))))
    assert eight == pytest.approx(one, rel=1e-12)
    # what one replica pays: its rows at the pair's bandwidth (as NCCL achieves it), plus the pair's latency
    assert one == pytest.approx(ROWS_BYTES / (6.0 * GBPS * NET_EFFICIENCY) + 50e-6)


def test_eight_replicas_sharing_one_nodes_interface_cost_eight_times_one():
    cluster = _cluster(9, 8, latency_us=0.0)
    one = _boundary_s(cluster, ROWS_BYTES, StageShape(dp=1), _gpus((0, 0)), StageShape(dp=1), _gpus((1, 0)))
    shared = _boundary_s(cluster, 8 * ROWS_BYTES, StageShape(dp=8), _gpus(*((0, k) for k in range(8))),
                         StageShape(dp=8), _gpus(*((1 + k, 0) for k in range(8))))
    assert shared == pytest.approx(8 * one, rel=1e-12)


def test_a_boundary_inside_a_node_uses_its_gpu_links_not_the_network():
    cluster = _cluster(2, 8)
    inside = _boundary_s(cluster, 4 * ROWS_BYTES, StageShape(dp=4), _gpus(*((0, k) for k in range(4))),
                         StageShape(dp=4), _gpus(*((0, 4 + k) for k in range(4))))
    across = _boundary_s(cluster, 4 * ROWS_BYTES, StageShape(dp=4), _gpus(*((0, k) for k in range(4))),
                         StageShape(dp=4), _gpus(*((1, k) for k in range(4))))
    intra_bw, intra_lat = LinkModel(cluster, [], 1.0).net.intra("n0")
    assert inside == pytest.approx(ROWS_BYTES / intra_bw + intra_lat)  # each GPU sends its own replica's rows
    assert across > 20 * inside  # A100 NVLink against one 6 GB/s interface carrying four replicas


def test_tp_ranks_split_the_rows_under_sequence_parallelism_and_dp_splits_meet_by_rows():
    """A tp-2 stage's two ranks each send half a replica's tokens; between dp 2 and dp 4 each row goes once."""
    traffic = boundary.shard_traffic(boundary.Port(2, 1, 2, ("a",) * 4), boundary.Port(1, 1, 4, ("b",) * 4))
    assert sum(f for _i, _j, f in traffic) == pytest.approx(1.0)
    sent: dict[int, float] = {}
    got: dict[int, float] = {}
    for i, j, f in traffic:
        sent[i] = sent.get(i, 0.0) + f
        got[j] = got.get(j, 0.0) + f
    assert sent == pytest.approx({i: 0.25 for i in range(4)}) and got == pytest.approx({j: 0.25 for j in range(4)})
    # replica 0 of the sender (ranks 0, 1) holds sequences [0, 1/2): the receivers 0 and 1
    assert {j for i, j, _f in traffic if i in (0, 1)} == {0, 1}


# --- properties over generated layouts -------------------------------------------------------------------------

_NET = boundary.UniformNetwork(5.4e9, 50e-6, 240e9, 2e-6)
_grids = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 3, 4, 8]))


@st.composite
def _port(draw, prefix: str, max_nodes: int = 6) -> boundary.Port:
    tp, cp, dp = draw(_grids)
    nodes = tuple(f"{prefix}{draw(st.integers(0, max_nodes - 1))}" for _ in range(tp * cp * dp))
    return boundary.Port(tp, cp, dp, nodes)


@settings(max_examples=200, deadline=None)
@given(_port("a"), _port("b"), st.floats(1e3, 1e10), st.floats(1.0, 8.0))
def test_cost_is_monotone_in_bytes(a, b, nbytes, more):
    assert boundary.boundary_s(nbytes, a, b, _NET) <= boundary.boundary_s(nbytes * more, a, b, _NET)


@settings(max_examples=200, deadline=None)
@given(_port("a"), _port("b"), st.floats(1e3, 1e10))
def test_inside_one_node_is_never_slower_than_across_nodes(a, b, nbytes):
    """The same two stages with every rank in one node (NVLink/PCIe only) against their own node layout."""
    one = boundary.Port(b.tp, b.cp, b.dp, ("a0",) * len(b.nodes))
    same = boundary.Port(a.tp, a.cp, a.dp, ("a0",) * len(a.nodes))
    assert boundary.boundary_s(nbytes, same, one, _NET) <= boundary.boundary_s(nbytes, a, b, _NET)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.floats(1e3, 1e10))
def test_sharing_a_nodes_interface_is_linear_in_the_replicas_it_hosts(k, rows_bytes):
    net = boundary.UniformNetwork(5.4e9, 0.0, 240e9, 0.0)
    one = boundary.boundary_s(rows_bytes, boundary.Port(1, 1, 1, ("a",)), boundary.Port(1, 1, 1, ("b0",)), net)
    shared = boundary.boundary_s(k * rows_bytes, boundary.Port(1, 1, k, ("a",) * k),
                                 boundary.Port(1, 1, k, tuple(f"b{i}" for i in range(k))), net)
    assert shared == pytest.approx(k * one, rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_the_composers_island_floor_is_under_every_boundary_between_the_islands(nodes_a, nodes_b, data):
    """LinkModel.island_matrix (what the composer prunes by) never exceeds the exact boundary of any two stages
    the islands can hold."""
    per_node = 4
    cluster = ClusterSpec.from_dict({"name": "gen", "network": {"default": {"bandwidth_GBps": 6.0, "latency_us": 50}},
                                     "nodes": [{"name": f"a{i}", "gpu": "a100-40gb", "count": per_node}
                                               for i in range(nodes_a)]
                                     + [{"name": f"v{i}", "gpu": "v100-16gb", "count": per_node}
                                        for i in range(nodes_b)]})
    islands = build_islands(cluster, dtype="fp32").islands
    links = LinkModel(cluster, islands, 1e8)
    floor = links.island_matrix()

    def stage(isl):
        gpus = list(isl.gpus)
        tp = data.draw(st.sampled_from([1, 2, 4]))
        dp = data.draw(st.integers(1, len(gpus) // tp))
        picked = data.draw(st.permutations(gpus))[:tp * dp]
        return StageShape(tp=tp, dp=dp), picked

    (sa, ga), (sb, gb) = stage(islands[0]), stage(islands[1])
    assert floor[0][1] <= links.stage_s(sa, ga, sb, gb) * (1 + 1e-12)
    assert floor[1][0] <= links.stage_s(sb, gb, sa, ga) * (1 + 1e-12)


# --- the planner: searched and hand-written plans ----------------------------------------------------------------

A100_32_V100_96 = {"name": "a100x32-v100x96", "network": {"default": {"bandwidth_GBps": 6.0, "latency_us": 50}},
                   "nodes": [{"name": f"a100-{i}", "gpu": "a100-40gb", "count": 4} for i in range(8)]
                   + [{"name": f"v100-{i}", "gpu": "v100-16gb", "count": 4} for i in range(24)]}
OPT_TF32 = ["--model", "opt-350m", "--global-batch", "1024", "--seq-len", "2048", "--dtype", "tf32", "--workers", "1",
            "--schedule", "1F1B", "--format", "json"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """OPT-350M at global batch 1024 x 2048 tokens in tf32 on 32 A100-40GB + 96 V100-16GB (4 per node, 6 GB/s),
    planned by ``tangram-launch plan``: (its folder, the plan as JSON)."""
    d = tmp_path_factory.mktemp("boundary")
    (d / "cluster.yaml").write_text(yaml.safe_dump(A100_32_V100_96))
    rc = main(["plan", "--cluster", str(d / "cluster.yaml"), *OPT_TF32, "-o", str(d / "searched.json"),
               "--stages-out", str(d / "manual.yaml")])
    assert rc == 0
    return d, json.loads((d / "searched.json").read_text())


@pytest.mark.slow
def test_tf32_on_32_a100_and_96_v100_plans_on_both_kinds(mixed):
    """The V100s (FP32, a tenth of an A100's TF32) pay for their place once a boundary costs what its replicas move
    over their own node pairs; the planner API and the CLI agree."""
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    _d, plan = mixed
    assert {s["island"] for s in plan["stages"]} == {"a100-40gb", "v100-16gb"}
    cluster = ClusterSpec.from_dict(A100_32_V100_96)
    result = search(cluster, load_model("opt-350m"), TrainingSpec(global_batch=1024, seq_len=2048, dtype="tf32"),
                    runtime="torch", options=PlannerOptions(max_workers=1, progress=False, schedule="1F1B"))
    assert {cluster.gpu(GpuRef(*s.gpus[0])).type for s in result.plan.stages} == {"a100-40gb", "v100-16gb"}
    assert plan["predicted"]["iteration_time_s"] == pytest.approx(result.plan.predicted.iteration_time_s)


def test_a_searched_plan_written_by_hand_costs_its_boundaries_identically(mixed):
    """The searched plan's stages, written as a hand-written plan and costed by ``plan --plan``: the stages get the
    same GPUs, every boundary between islands is priced the same (one function on the same GPUs), and so is the
    iteration."""
    d, searched = mixed
    stages = searched["stages"]
    rc = main(["plan", "--cluster", str(d / "cluster.yaml"), *OPT_TF32, "--plan", str(d / "manual.yaml"),
               "-o", str(d / "hand.json")])
    assert rc == 0
    hand = json.loads((d / "hand.json").read_text())
    assert [s["gpus"] for s in hand["stages"]] == [s["gpus"] for s in stages]
    crossings = [k for k in range(len(stages) - 1) if stages[k]["island"] != stages[k + 1]["island"]]
    assert crossings
    for k in crossings:
        assert hand["planner"]["p2p_s"][k] == searched["planner"]["p2p_s"][k] > 0.0
    # the same stages at the same boundaries: the same predicted iteration
    assert hand["predicted"]["iteration_time_s"] == pytest.approx(searched["predicted"]["iteration_time_s"], rel=1e-9)


@pytest.mark.parametrize("stage_gpus,same_node", [(4, False), (2, True)])
def test_a_hand_written_boundary_inside_an_island_costs_what_the_parallelizers_stage_p2p_costs(
        tmp_path, capsys, stage_gpus, same_node):
    """Two hand-written stages of one grid on one island (across its two nodes, or inside one node) are what the
    search plans as one slice of two stages, and are priced as it prices that slice: the boundary's p2p
    (communication.p2p_stage_s: one function, one network) in the first stage's forward and the second's backward,
    no link between them; stage for stage, and the iteration, what ``estimate`` gives the same slice."""
    from tangram_launch.costmodel import communication as comm
    from tangram_launch.costmodel.efficiency import DeviceModel
    from tangram_launch.specs.model import load_model

    cluster = {"name": "a100", "network": {"default": {"bandwidth_GBps": 6.0, "latency_us": 50}},
               "nodes": [{"name": f"a{i}", "gpu": "a100-40gb", "count": 4} for i in range(2)]}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    b = 8
    stages = {"microbatch_sequences": b,
              "stages": [{"layers": [0, 2], "island": "a100-40gb", "tp": 1, "dp": stage_gpus},
                         {"layers": [2, 4], "island": "a100-40gb", "tp": 1, "dp": stage_gpus}]}
    (tmp_path / "stages.yaml").write_text(yaml.safe_dump(stages))
    out = tmp_path / "plan.json"
    rc = main(["plan", "--cluster", str(tmp_path / "cluster.yaml"), "--model", "tiny", "--global-batch", "16",
               "--seq-len", "64", "--dtype", "fp32", "--plan", str(tmp_path / "stages.yaml"), "--workers", "1",
               "--schedule", "1F1B", "--format", "json", "-o", str(out)])
    assert rc == 0
    plan = json.loads(out.read_text())
    nodes = [{g["node"] for g in s["gpus"]} for s in plan["stages"]]
    assert (nodes[0] == nodes[1]) == same_node
    spec = ClusterSpec.from_dict(cluster)
    dev = DeviceModel.from_gpu(spec.gpu(GpuRef("a0", 0)), "fp32")
    nbytes = b * 64 * load_model("tiny").hidden_size * 4
    want = comm.p2p_stage_s(nbytes, stage_gpus=stage_gpus, gpus_per_node=4, same_node=same_node, dev=dev,
                            inter_bandwidth_GBps=6.0, inter_latency_us=50.0)
    assert plan["planner"]["p2p_s"] == [0.0]  # no link: the p2p lies in the stages' times
    first = plan["stages"][0]
    capsys.readouterr()
    rc = main(["estimate", "--cluster", str(tmp_path / "cluster.yaml"), "--model", "tiny", "--global-batch", "16",
               "--seq-len", "64", "--dtype", "fp32", "--island", "a100-40gb", "--tp", "1", "--pp", "2", "--dp",
               str(stage_gpus), "--mbs", str(b // stage_gpus), "--zero", str(first["zero_stage"]), "--recompute",
               first["recompute"], "--runtime", "torch", "--format", "json"])
    assert rc == 0
    sliced = json.loads(capsys.readouterr().out)
    assert [s["layers"] for s in sliced["stages"]] == [s["layers"] for s in plan["stages"]]
    assert [s["breakdown"]["p2p_s"] for s in sliced["stages"]] == [pytest.approx(want, rel=1e-12)] * 2
    for mine, theirs in zip(plan["predicted"]["stages"], sliced["stages"]):
        assert mine["forward_s"] == pytest.approx(theirs["forward_s"], rel=1e-12)
        assert mine["backward_s"] == pytest.approx(theirs["backward_s"], rel=1e-12)
    assert plan["predicted"]["iteration_time_s"] == pytest.approx(sliced["iteration_s"], rel=1e-9)

"""The words the commands print: devices named for what they are, counts agreeing with their nouns, one line per
reason."""
import os
import re

import pytest

from helpers_plans import make_plan as make_fixed_plan
from tangram_launch.errors import InfeasibleError
from tangram_launch.planner import PlannerOptions, make_plan
from tangram_launch.planner.report import format_plan_table
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import load_preset
from tangram_launch.specs.training import TrainingSpec
from tangram_launch.text import devices, on_cpu, plural

from conftest import CLUSTERS

SERIAL = PlannerOptions(max_workers=1)
CPU2 = os.path.join(CLUSTERS, "cpu-2.yaml")


@pytest.mark.parametrize("count, noun, many, text", [
    (1, "island", None, "1 island"), (3, "island", None, "3 islands"),
    (1, "micro-batch", "micro-batches", "1 micro-batch"), (4, "micro-batch", "micro-batches", "4 micro-batches"),
    (1, "slice plan", None, "1 slice plan"), (0, "slice plan", None, "0 slice plans"),
])
def test_counts_agree_with_their_nouns(count, noun, many, text):
    assert plural(count, noun, many) == text


def test_devices_are_named_for_what_they_are():
    assert devices(2, cpu=True) == "2 CPU processes" and devices(1, cpu=True) == "1 CPU process"
    assert devices(8, cpu=False) == "8 GPUs" and devices(1, cpu=False) == "1 GPU"
    assert on_cpu(["cpu", "cpu-2"]) and not on_cpu(["cpu", "a100-80gb"]) and not on_cpu([])


def test_a_cpu_plan_speaks_of_cpu_processes_and_one_micro_batch():
    cluster = ClusterSpec.load(CPU2)
    plan = make_plan(cluster, load_preset("tiny"), TrainingSpec(global_batch=2, seq_len=64, dtype="fp32"),
                     options=SERIAL)
    text = format_plan_table(plan, cluster_name=cluster.name, num_islands=1)
    head = text.splitlines()[0]
    assert "(2 of 2 CPU processes, 1 of 1 island used)" in head
    assert "GPU" not in text
    assert not re.search(r"\b1 (micro-batches|islands|sequences)\b", text)
    assert re.search(rf"\b{plural(plan.num_microbatches, 'micro-batch', 'micro-batches')} of ", text)


def test_the_header_says_how_many_islands_are_used():
    plan = make_fixed_plan("tiny", [(4, "n0")], global_batch=4, num_microbatches=4)
    text = format_plan_table(plan, num_islands=3)
    assert "1 of 3 islands used" in text.splitlines()[0]
    assert "GPUs" in text.splitlines()[0]  # not a CPU island: GPUs they are


def test_no_feasible_plan_gives_one_line_per_island():
    cluster = ClusterSpec.load(CPU2)
    with pytest.raises(InfeasibleError) as err:
        make_plan(cluster, load_preset("gpt3-2.7b"), TrainingSpec(global_batch=8, seq_len=512, dtype="fp32"),
                  options=SERIAL)
    on_island = [r for r in err.value.reasons if r.startswith("cpu:")]
    assert len(on_island) == 1, err.value.reasons
    assert re.search(r"shown at b=1, the smallest micro-batch; b=(\d+,)*\d+ fail too", on_island[0])
    assert len(set(err.value.reasons)) == len(err.value.reasons)


def _stage_rows(text: str) -> tuple[list[str], list[list[str]]]:
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    rows = []
    for line in lines[at + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return lines[at].split(), rows


def test_the_table_shows_where_a_stage_keeps_its_optimizer(capsys):
    """The fp16 plan of gpt3-13b on the paper's T4 + V100 cluster offloads the optimizer state of every stage (its
    step runs on the host, most of the iteration's tail): the table says so in its own column, through the CLI."""
    from tangram_launch.cli import main

    assert main(["plan", "--cluster", os.path.join(CLUSTERS, "c1-compute-het.yaml"), "--model", "gpt3-13b",
                 "--global-batch", "64", "--seq-len", "2048", "--dtype", "fp16", "--format", "json"]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    offloaded = [s["offload"] for s in plan["stages"]]
    assert any(offloaded)
    assert main(["plan", "--cluster", os.path.join(CLUSTERS, "c1-compute-het.yaml"), "--model", "gpt3-13b",
                 "--global-batch", "64", "--seq-len", "2048", "--dtype", "fp16"]) == 0
    text = capsys.readouterr().out
    head, rows = _stage_rows(text)
    col = head.index("offload")
    assert head[col - 1] == "recompute" and head[col + 1] == "mbs"
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    x = lines[at].index("offload")  # a left-aligned column: its cells start under its heading
    cells = [line[x:].split()[0] for line in lines[at + 1:at + 1 + len(rows)]]
    assert cells == ["optimizer" if o else "-" for o in offloaded]
    assert "math" not in head  # not a tf32 plan


def test_a_plan_without_offload_or_math_modes_keeps_its_columns():
    cluster = ClusterSpec.load(CPU2)
    plan = make_plan(cluster, load_preset("tiny"), TrainingSpec(global_batch=2, seq_len=64, dtype="fp32"),
                     options=SERIAL)
    head, rows = _stage_rows(format_plan_table(plan, cluster_name=cluster.name, num_islands=1))
    assert head == ["stage", "layers", "island", "devices", "tp", "dp", "cp", "ep", "zero", "recompute", "mbs",
                    "time/mb", "memory", "GiB", "(of)"]
    assert not any(s.offload for s in plan.stages) and all(len(r) == len(rows[0]) for r in rows)

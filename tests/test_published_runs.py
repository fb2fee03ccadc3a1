"""The published-runs validation set (benchmarks/data/published_runs.yaml) is well formed: it parses, has at least
30 rows, every row cites a source and a FLOP convention, every model and GPU name resolves, the benchmark turns
every published figure into seconds per iteration, and every row's dev/validation split is the one the file's rule
draws (so no row is moved between the two by hand)."""
import copy
import functools
import importlib.util
import json
import os
import statistics

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.specs.catalog import default_catalog
from tangram_launch.specs.model import ModelSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks", "bench_costmodel_published.py")


@functools.cache
def _bench():
    """The benchmark module, executed once for every test module that imports these fixtures."""
    spec = importlib.util.spec_from_file_location("bench_costmodel_published", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _data() -> dict:
    """The data file parsed once: each module gets its own copy."""
    return _bench().load_data()


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def data(bench):
    return copy.deepcopy(_data())


@pytest.mark.unit
def test_parses_with_at_least_30_unique_rows(data):
    assert data["schema_version"] == 1
    runs = data["runs"]
    assert len(runs) >= 30
    ids = [r["id"] for r in runs]
    assert len(ids) == len(set(ids)), "row ids must be unique"


@pytest.mark.unit
def test_every_row_has_a_source_and_a_flop_convention(data):
    sources, conventions = data["sources"], data["flop_conventions"]
    for r in data["runs"]:
        src = r.get("source") or {}
        assert src.get("ref") in sources, f"{r['id']}: unknown source {src.get('ref')!r}"
        assert str(src.get("where", "")).strip(), f"{r['id']}: source without table/figure/file"
        assert r.get("flop_convention") in conventions, f"{r['id']}: unknown FLOP convention"
        assert conventions[r["flop_convention"]].get("text"), r["id"]
        assert r.get("verified") in (True, "partial", False), r["id"]
        if r["verified"] is not True:
            assert r.get("verification") or r.get("assumed"), f"{r['id']}: say why it is not verified"
        assert r.get("subset") in ("fit", "held-out"), r["id"]


@pytest.mark.unit
def test_every_model_and_gpu_name_resolves(data, bench):
    catalog = default_catalog()
    for r in data["runs"]:
        model = bench.resolve_model(r["model"], data)
        assert isinstance(model, ModelSpec)
        assert model.max_seq_len >= r["parallel"]["seq_len"] or model.position_embedding != "learned", r["id"]
        assert catalog.lookup(r["gpu"]).name == r["gpu"], f"{r['id']}: use the catalog's canonical GPU name"


@pytest.mark.unit
def test_configurations_are_consistent(data, bench):
    for r in data["runs"]:
        p = r["parallel"]
        grid = p.get("tp", 1) * p.get("pp", 1) * p.get("dp", 1) * p.get("cp", 1)
        assert grid == r["num_gpus"], f"{r['id']}: tp*pp*dp*cp = {grid} != {r['num_gpus']}"
        assert p["global_batch"] % (p.get("mbs", 1) * p.get("dp", 1)) == 0, r["id"]
        assert p.get("schedule", "1F1B") in bench.SCHEDULES, r["id"]
        assert r["published"]["metric"] in bench.PUBLISHED_METRICS, r["id"]
        mem = r["published"].get("memory_gib")
        assert mem is None or 0 < mem <= 200, r["id"]


@pytest.mark.unit
def test_every_published_figure_converts_to_seconds(data, bench):
    for r in data["runs"]:
        model = bench.resolve_model(r["model"], data)
        t = bench.published_iteration_s(r, data, model)
        if r["published"]["metric"] == "memory_only":  # a source with a memory figure and no time
            assert t is None and r["published"].get("memory_gib"), r["id"]
            continue
        assert 0.01 < t < 1000, f"{r['id']}: {t} s per iteration"


@pytest.mark.unit
def test_benchmark_costs_a_few_rows(data, bench):
    rows = {r["id"]: r for r in data["runs"]}
    costed = bench.evaluate(rows["mpt-a100-80-7b-s2k-8"], data)
    assert costed["predicted_s"] > 0 and costed["predicted_gib"] > 0
    with_memory = bench.evaluate(rows["flagperf-llama3-8b-a800x8"], data)
    assert with_memory["mem_err"] is not None
    skipped = bench.evaluate(rows["llama3-405b-8k-gpus"], data)
    assert "interleaved" in skipped["not_expressible"] and skipped["approx"]["predicted_s"] > 0


@pytest.mark.unit
def test_memory_figures_say_how_they_were_measured(data, bench):
    conventions = data["memory_conventions"]
    assert set(conventions) == set(bench.MEMORY_CONVENTIONS)
    for r in data["runs"]:
        if r["published"].get("memory_gib"):
            assert r["published"].get("memory_convention") in conventions, r["id"]
        for key in r.get("gpu_overrides") or {}:
            assert key in bench.GPU_OVERRIDE_KEYS, f"{r['id']}: gpu_overrides.{key}"
        assert r.get("kernels", "fused") in bench.KERNELS, r["id"]


# What each source's memory figure measures, read in the source's own code: torchtitan's trainer logs its
# DeviceMemoryMonitor's max_reserved_gib (torch.cuda.max_memory_reserved); FlagPerf's harness samples nvidia-smi's
# used memory every 5 s (training/nvidia/nvidia_monitor.py); BLOOM's figure is a sentence of prose; the NeMo B200
# notes log NeMo's max_memory_reserved; the minGPT Lite README's Memory (MB) is read as torch.cuda.memory_summary's
# reserved peak (an assumption its rows list); torchao's training benchmarks take the largest torchtitan 'memory: X GiB'
# of the log (benchmarks/float8/training/parse_torchtitan_logs.py); BigScience's tr11 prequel read its Mem column with
# `pdsh ... nvidia-smi` on the first node.
METRIC_OF_SOURCE = {"torchtitan-h100": "allocator-reserved", "torchtitan-h200": "allocator-reserved",
                    "torchtitan-deepep": "allocator-reserved", "flagperf": "device-used", "bloom": "stated",
                    "titan-qwen3-h200-notes": "allocator-reserved", "nemo-b200-notes": "allocator-reserved",
                    "lite-mingpt-v100": "allocator-reserved", "torchao-moe-training": "allocator-reserved",
                    "torchao-training": "allocator-reserved",
                    # lambda-fa2: not stated by the source, read as nvidia-smi's (the rows' assumed say so)
                    "lambda-fa2": "device-used",
                    "bigscience-prequel": "device-used",
                    # nanotron logs max_memory_allocated and max_memory_reserved; the figure does not say which it
                    # plots, read as the reserve (the rows' assumed say so)
                    "nanotron-bench-summary": "allocator-reserved", "ultrascale-interactive": "allocator-reserved",
                    # the zero-bubble paper's Megatron fork prints max allocated and max reserved, the paper does not
                    # say which it tabulates; universal-llm-trainer prints torch.cuda.memory_reserved() (both read as
                    # the reserve, the rows' assumed say so); torchtune's README reports the allocator's peak of
                    # active bytes and ColossalAI's benchmark torch.cuda.max_memory_allocated
                    "zero-bubble-pp": "allocator-reserved", "univlt-gpu-test": "allocator-reserved",
                    "torchtune-opt-flags": "allocator-allocated", "colossalai-llama2-bench": "allocator-allocated",
                    # ms-swift's sft and megatron sft callbacks log torch.cuda.max_memory_reserved; the vocabulary-
                    # parallel paper's Figure 14 calls its figure the maximum allocated memory
                    "swift-megatron-bench": "allocator-reserved", "vocab-parallel-pp": "allocator-allocated",
                    # KempnerForge's tracker logs torch.cuda.max_memory_allocated (metrics/memory.py)
                    "kforge-mfu-h200": "allocator-allocated", "kforge-weak-h200": "allocator-allocated",
                    "kforge-175b-h200": "allocator-allocated",
                    # DLPerf's parsing script keeps the largest nvidia-smi memory.used reading of the run's log
                    "dlperf-oneflow-gpt": "device-used",
                    # blind10: Raschka's script prints torch.cuda.memory_reserved() after an epoch; gollem logs
                    # max_memory_allocated; DeepSpeed's ThroughputTimer its MaxMemAllocated; the KAUST workshop's
                    # slurm script logs nvidia-smi memory.used; Giles Thomas's post names no tool (read as the
                    # device's figure, the row's assumed says so)
                    "rasbt-llm-training-speed": "allocator-reserved", "gollem-gpt2-h100": "allocator-allocated",
                    "dschat-step1-opt13b-log": "allocator-allocated", "kaust-dsworkshop-bloom": "device-used",
                    "gilesthomas-fp32": "device-used",
                    # blind11: CS336's memory snapshot (torch.cuda.memory._record_memory_history) plots active bytes
                    "cs336-snider-h100": "allocator-allocated",
                    # blind12: torchtitan's step log prints max_memory_reserved (DeviceMemoryMonitor)
                    "titan-pr1690-qwen3-32b": "allocator-reserved"}


@pytest.mark.unit
def test_every_memory_figure_is_compared_as_its_sources_harness_measured_it(data):
    rows = [r for r in data["runs"] if r["published"].get("memory_gib")]
    assert len(rows) >= 15
    unknown = sorted({r["source"]["ref"] for r in rows} - set(METRIC_OF_SOURCE))
    assert not unknown, f"sources with memory figures whose metric is not recorded here: {unknown}"
    wrong = [r["id"] for r in rows if r["published"]["memory_convention"] != METRIC_OF_SOURCE[r["source"]["ref"]]]
    assert not wrong, f"rows compared as another metric than their source's harness reports: {wrong}"


@pytest.mark.unit
def test_allocator_reserved_figures_are_compared_without_the_memory_outside_the_allocator(data, bench):
    row = next(r for r in data["runs"] if r["published"].get("memory_convention") == "allocator-reserved")
    as_device = {**row, "published": {**row["published"], "memory_convention": "device-used"}}
    reserved, device = bench.evaluate(row, data), bench.evaluate(as_device, data)
    assert 0.4 < device["predicted_gib"] - reserved["predicted_gib"] < 4.0  # CUDA context + NCCL buffers


@pytest.mark.unit
def test_fit_rows_are_exactly_the_rows_of_the_fitted_constants(data):
    fitted = {rid for c in data["fitted_constants"].values() for rid in c["rows"]}
    ids = {r["id"] for r in data["runs"]}
    assert fitted <= ids
    assert fitted == {r["id"] for r in data["runs"] if r["subset"] == "fit"}


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gemm_efficiency.a100", "gemm_efficiency.h100-sxm"])
def test_each_shipped_constant_is_the_least_squares_fit_on_its_rows(data, bench, name):
    """Moving the shipped value 0.03 either way makes the squared log error on its fit rows worse (the full fit is
    `python benchmarks/bench_costmodel_published.py --fit`)."""
    import math

    spec = data["fitted_constants"][name]
    rows = {r["id"]: r for r in data["runs"]}
    shipped = bench._get_constant(name, spec)

    def loss(value):
        bench._set_constant(name, spec, value)
        try:
            out = [bench.evaluate(rows[rid], data) for rid in spec["rows"]]
        finally:
            bench._set_constant(name, spec, shipped)
        return sum(math.log(r["predicted_s"] / r["published_s"]) ** 2 for r in out)

    at = loss(shipped)
    assert at < loss(shipped - 0.03) and at < loss(shipped + 0.03)


@pytest.mark.unit
def test_runtime_variants_of_a_row_are_known_and_change_what_they_model(data, bench):
    """A row's `runtime:` says what its runtime did beyond the planner's defaults (TP without SP, op-level SAC,
    kept 16-bit gradients); an unknown key is refused by name, and each variant moves the row's memory."""
    from tangram_launch.errors import SpecError

    for r in data["runs"]:
        assert set(r.get("runtime") or {}) <= set(bench.RUNTIME_KEYS), r["id"]
    rows = {r["id"]: r for r in data["runs"]}
    bloom = rows["bloom-176b-384"]
    as_run = bench.evaluate(bloom, data)
    as_planner = bench.evaluate({k: v for k, v in bloom.items() if k != "runtime"}, data)
    assert as_run["predicted_gib"] > as_planner["predicted_gib"] + 5  # whole layer inputs on 4 TP ranks, bf16 grads
    with pytest.raises(SpecError, match="unknown runtime keys"):
        bench.predict({**bloom, "runtime": {"sequence_paralel": False}}, bench.resolve_model(bloom["model"], data))
    # a runtime that hides its DP sync under the backward (and the gathers under the forward) runs the step faster
    flag = rows["flagperf-llama3-8b-h100x16"]
    times = [bench.evaluate({**flag, "runtime": {"dp_overlap": kind}}, data)["predicted_s"]
             for kind in ("none", "grads", "grads-params")]
    assert times[0] > times[1] > times[2]
    # ... and one that pipelines its TP collectives with the GEMMs beside them, too
    tp = [bench.evaluate({**flag, "runtime": {"tp_overlap": kind}}, data)["predicted_s"]
          for kind in ("none", "backward", "pipelined")]
    assert tp[0] > tp[1] > tp[2]
    with pytest.raises(SpecError) as err:
        bench.predict({**flag, "runtime": {"dp_overlap": "yes"}}, bench.resolve_model(flag["model"], data))
    assert err.value.field == "dp_overlap"


@pytest.mark.unit
def test_every_row_has_a_split_and_a_cohort_and_fit_rows_are_dev(data, bench):
    generation = data["validation_split"]["generation_of_gpu"]
    for r in data["runs"]:
        assert r.get("split") in bench.SPLITS, f"{r['id']}: split {r.get('split')!r} (valid: {bench.SPLITS})"
        assert r.get("cohort") in bench.COHORTS, f"{r['id']}: cohort {r.get('cohort')!r} (valid: {bench.COHORTS})"
        assert r["gpu"] in generation, f"{r['id']}: GPU {r['gpu']!r} has no generation in validation_split"
        if r["subset"] == "fit":
            assert r["split"] == "dev", f"{r['id']}: a constant was fitted on it, so it cannot validate"
        if r["cohort"] in bench.VALIDATION_COHORTS:
            assert r["split"] == "validation" and r["subset"] == "held-out", r["id"]
        if r["cohort"] == "moe-dev":
            assert r["split"] == "dev" and r["subset"] == "held-out" and r["parallel"].get("ep", 1) > 1, r["id"]


@pytest.mark.unit
def test_the_rule_reproduces_every_recorded_split(data, bench):
    drawn = bench.draw_split(data["runs"], data["validation_split"]["generation_of_gpu"],
                             data["validation_split"]["fit_rows_when_drawn"])
    relabelled = {r["id"]: (r["split"], drawn[r["id"]]) for r in data["runs"] if r["split"] != drawn[r["id"]]}
    assert not relabelled, f"rows labelled (recorded, by the rule) otherwise than the rule draws: {relabelled}"


@pytest.mark.unit
def test_the_original_cohort_is_pinned(data, bench):
    """No row moves between cohorts: the ids in the file when the split was drawn are fixed by count and digest."""
    original = [r["id"] for r in data["runs"] if r["cohort"] == "original"]
    assert len(original) == data["validation_split"]["original_rows"]
    assert bench.original_ids_sha256(original) == data["validation_split"]["original_ids_sha256"]


@pytest.mark.unit
def test_a_third_of_each_generation_validates(data, bench):
    generation = data["validation_split"]["generation_of_gpu"]
    pool: dict[str, list[str]] = {}
    for r in data["runs"]:
        if r["cohort"] == "original" and r["subset"] != "fit":
            pool.setdefault(generation[r["gpu"]], []).append(r["split"])
    for gen, splits in pool.items():
        assert splits.count("validation") == -(-len(splits) // 3), gen


@pytest.mark.unit
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), extra=st.lists(st.text("abcdefgh-0123", min_size=1, max_size=12),
                                                     max_size=6, unique=True))
def test_the_draw_ignores_row_order_and_rows_added_later(data, bench, seed, extra):
    """An original row's split depends on the original rows alone: shuffling the file or adding unseen rows leaves
    it where it was."""
    import random

    generation = data["validation_split"]["generation_of_gpu"]
    fit = data["validation_split"]["fit_rows_when_drawn"]
    before = bench.draw_split(data["runs"], generation, fit)
    added = [{"id": f"new-{x}", "gpu": "h100-sxm", "subset": "held-out", "cohort": "unseen"} for x in extra]
    runs = list(data["runs"]) + added
    random.Random(seed).shuffle(runs)
    after = bench.draw_split(runs, generation, fit)
    assert {k: after[k] for k in before} == before
    assert all(after[a["id"]] == "validation" for a in added)


@pytest.mark.unit
def test_the_report_puts_dev_and_validation_medians_side_by_side(data, bench, capsys):
    rows = {r["id"]: r for r in data["runs"]}
    costed = [bench.evaluate(rows[rid], data) for rid in ("mpt-a100-80-7b-s2k-8", "mpt-a100-80-1b-s2k-8")]
    assert {c["split"] for c in costed} == {"dev", "validation"}
    bench.print_split_medians(costed)
    out = capsys.readouterr().out.splitlines()
    assert "dev" in out[1] and "validation" in out[1] and out[1].index("dev") < out[1].index("validation")
    time_row = next(line for line in out if line.strip().startswith("time |err|"))
    assert time_row.count("(n=1)") == 3 and time_row.endswith("(n=0)")  # dev, validation, its original cohort


_ERRORS = st.lists(st.tuples(st.sampled_from("abc"), st.floats(-90.0, 400.0)), min_size=1, max_size=30)


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(errors=_ERRORS, copies=st.integers(1, 5))
def test_a_source_counts_once_in_the_median_by_source(bench, errors, copies):
    """median_by_source: n counts sources; repeating one source's rows changes nothing (a source of many rows counts
    once); the figure is the median of the sources' median |error|s, so it lies between their least and largest."""
    rows = [{"source": g, "time_err": e} for g, e in errors]
    first = rows[0]["source"]
    repeated = rows + [r for r in rows if r["source"] == first] * (copies - 1)
    out = bench.median_by_source(rows, "time_err")
    assert out == bench.median_by_source(repeated, "time_err")
    per = {g: [abs(e) for h, e in errors if h == g] for g, _ in errors}
    assert out.endswith(f"(n={len(per)})")
    value = float(out.split("%")[0])
    medians = [statistics.median(v) for v in per.values()]
    assert min(medians) - 0.05 <= value <= max(medians) + 0.05
    assert bench.median_by_source([{"source": "a", "time_err": None}], "time_err").endswith("(n=0)")


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(errors=_ERRORS, factors=st.lists(st.floats(0.2, 5.0), min_size=3, max_size=3))
def test_the_calibrated_median_ignores_each_deployments_level(bench, errors, factors):
    """median_calibrated scales each row by the other rows of its source on its GPU type: one factor per deployment
    on every prediction (its stack's level) changes nothing, rows alone on their deployment drop out of n, and a
    deployment whose rows are all off alike reads 0."""
    rows = [{"source": g, "gpu": "h100-sxm", "time_err": e} for g, e in errors]
    level = dict(zip("abc", factors))
    shifted = [{**r, "time_err": 100.0 * ((1.0 + r["time_err"] / 100.0) * level[r["source"]] - 1.0)} for r in rows]
    out, moved = bench.median_calibrated(rows, "time_err"), bench.median_calibrated(shifted, "time_err")
    sizes = {g: sum(1 for h, _ in errors if h == g) for g, _ in errors}
    assert out.endswith(f"(n={sum(n for n in sizes.values() if n > 1)})")
    if not out.endswith("(n=0)"):
        assert abs(float(out.split("%")[0]) - float(moved.split("%")[0])) <= 0.1 + 1e-9
    alike = [{"source": "a", "gpu": "a100-80gb", "time_err": errors[0][1]}] * 3
    assert bench.median_calibrated(alike, "time_err").startswith("  0.0 %")


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(errors=_ERRORS, factor=st.floats(0.2, 5.0))
def test_the_ceiling_centres_each_group_and_ignores_a_common_factor(bench, errors, factor):
    """scaled_errors: each group's scaled ratios have median 1 (its median error is 0 where the group has an odd
    size), the order inside a group is kept, and predictions all off by one more factor scale to the same errors."""
    rows = [{"g": g, "time_err": e} for g, e in errors]
    shifted = [{"g": g, "time_err": 100.0 * ((1.0 + e / 100.0) * factor - 1.0)} for g, e in errors]
    group = lambda r: r["g"]  # noqa: E731
    out = bench.scaled_errors(rows, "time_err", group)
    assert bench.scaled_errors(shifted, "time_err", group) == pytest.approx(out, rel=1e-9, abs=1e-6)
    by_group: dict[str, list[tuple[float, float]]] = {}
    first = {g: i for i, (g, _) in reversed(list(enumerate(errors)))}
    for (g, e), x in zip(sorted(errors, key=lambda t: first[t[0]]), out):  # group by group, in order of appearance
        by_group.setdefault(g, []).append((e, x))
    for pairs in by_group.values():
        xs = [x for _, x in sorted(pairs)]
        assert all(a <= b for a, b in zip(xs, xs[1:]))  # the order inside a group is kept
        if len(pairs) % 2:
            assert sorted(x for _, x in pairs)[len(pairs) // 2] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(errors=_ERRORS)
def test_a_left_out_row_never_sets_its_own_factor(bench, errors):
    """left_out_errors: a row alone in its group is left out; a row's scaled ratio is its own ratio times the median
    of the other rows' published / predicted ratios, its own never among them."""
    rows = [{"g": g, "time_err": e} for g, e in errors]
    group = lambda r: r["g"]  # noqa: E731
    out = bench.left_out_errors(rows, "time_err", group)
    sizes = {g: sum(1 for h, _ in errors if h == g) for g, _ in errors}
    assert len(out) == sum(n for n in sizes.values() if n > 1)
    first = {g: i for i, (g, _) in reversed(list(enumerate(errors)))}
    kept = [(g, e) for g, e in sorted(errors, key=lambda t: first[t[0]]) if sizes[g] > 1]
    for (g, e), x in zip(kept, out):
        others = [1.0 + f / 100.0 for h, f in errors if h == g]
        others.remove(1.0 + e / 100.0)
        factor = sorted(1.0 / y for y in others)
        mid = len(factor) // 2
        median = factor[mid] if len(factor) % 2 else (factor[mid - 1] + factor[mid]) / 2.0
        assert x == pytest.approx(100.0 * ((1.0 + e / 100.0) * median - 1.0), rel=1e-9, abs=1e-6)


@pytest.mark.unit
def test_the_report_prints_the_ceiling_of_a_constant_per_group_beside_each_split(data, bench, capsys):
    rows = {r["id"]: r for r in data["runs"]}
    costed = [bench.evaluate(rows[rid], data) for rid in ("mpt-a100-80-7b-s2k-8", "mpt-a100-80-1b-s2k-8")]
    bench.print_ceiling(costed)
    out = capsys.readouterr().out.splitlines()
    assert "dev time" in out[1] and "validation memory" in out[1]
    per_source = next(line for line in out if line.strip().startswith("one per source"))
    assert per_source.count("0.0 % (n=1)") == 2  # one row per split: its own factor leaves no error


@pytest.mark.unit
def test_unseen_rows_come_from_sources_the_original_rows_did_not_use(data):
    """Rows added after the split are unseen data only if their sources are new: no unseen row may cite a source
    that an original row (which the model's structure was tuned on) cites."""
    original = {r["source"]["ref"] for r in data["runs"] if r["cohort"] == "original"}
    reused = {r["id"]: r["source"]["ref"] for r in data["runs"]
              if r["cohort"] == "unseen" and r["source"]["ref"] in original}
    assert not reused, f"unseen rows citing a source of the original rows: {reused}"


@pytest.mark.unit
def test_moe_dev_rows_share_no_source_with_a_validation_row(data):
    """The moe-dev cohort is development evidence added after the split: a row citing a source that a validation
    row cites would let the model be shaped to that source, so its validation rows would no longer be unseen."""
    validation = {r["source"]["ref"] for r in data["runs"] if r["split"] == "validation"}
    shared = {r["id"]: r["source"]["ref"] for r in data["runs"]
              if r["cohort"] == "moe-dev" and r["source"]["ref"] in validation}
    assert not shared, f"moe-dev rows citing a source of validation rows: {shared}"
    assert any(r["cohort"] == "moe-dev" for r in data["runs"])


@pytest.mark.unit
@pytest.mark.parametrize("cohort", _bench().BLIND_COHORTS)
def test_a_blind_cohort_has_twenty_rows_and_cites_only_sources_no_other_cohort_cites(data, cohort):
    """The blind cohorts (the benchmark's BLIND_COHORTS) are validation batches, each gathered after the cohorts
    before it had been seen: a batch is unseen data only if no row of another cohort (which the model may have been
    shaped to) cites any of its sources."""
    rows = [r for r in data["runs"] if r["cohort"] == cohort]
    assert len(rows) >= 20, f"{len(rows)} {cohort} rows"
    others = {r["source"]["ref"] for r in data["runs"] if r["cohort"] != cohort}
    shared = {r["id"]: r["source"]["ref"] for r in rows if r["source"]["ref"] in others}
    assert not shared, f"{cohort} rows citing a source that rows of another cohort cite: {shared}"


@pytest.mark.unit
@pytest.mark.parametrize("cohort", _bench().BLIND_COHORTS)
def test_a_blind_cohort_row_is_validation_whatever_its_gpu_and_id(bench, cohort):
    runs = [{"id": f"f-{i}", "gpu": gpu, "subset": "held-out", "cohort": cohort}
            for i, gpu in enumerate(("h200", "b200", "a100-80gb", "v100-16gb"))]
    generation = {"h200": "hopper", "b200": "blackwell", "a100-80gb": "ampere", "v100-16gb": "volta"}
    assert set(bench.draw_split(runs, generation, fit_when_drawn=()).values()) == {"validation"}


@pytest.mark.unit
def test_a_moe_dev_row_is_dev_whatever_its_gpu_and_id(bench):
    runs = [{"id": f"m-{i}", "gpu": gpu, "subset": "held-out", "cohort": "moe-dev"}
            for i, gpu in enumerate(("h200", "b200", "a100-80gb"))]
    generation = {"h200": "hopper", "b200": "blackwell", "a100-80gb": "ampere"}
    assert set(bench.draw_split(runs, generation, fit_when_drawn=()).values()) == {"dev"}


@pytest.mark.unit
@pytest.mark.parametrize("cohort", _bench().BLIND_COHORTS)
def test_a_sealed_cohort_is_costed_only_when_unsealed(data, bench, tmp_path, capsys, cohort):
    """Blind rows validate the next cost-model change only if no one saw the model predict them before:
    the report leaves a sealed cohort out unless --unseal. A copy of a seen row relabelled to the cohort stands in for
    its rows, so this test itself computes no prediction of theirs."""
    seen = copy.deepcopy(next(r for r in data["runs"] if r["id"] == "mpt-a100-80-7b-s2k-8"))
    seen.update(id="sealed-stand-in", cohort=cohort, split="validation")
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({**data, "sealed_cohorts": [cohort], "runs": [seen]}), encoding="utf-8")
    assert bench.main(["--data", str(path), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == [] and f"sealed: 1 validation rows of cohort {cohort}" in out.err
    assert bench.main(["--data", str(path), "--json", "--unseal"]) == 0
    costed = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in costed] == ["sealed-stand-in"] and costed[0]["predicted_s"] > 0
    bench.print_split_medians(costed)
    assert f"val: {cohort}" in capsys.readouterr().out
    path.write_text(yaml.safe_dump({**data, "sealed_cohorts": [], "runs": [seen]}), encoding="utf-8")
    assert bench.main(["--data", str(path), "--json"]) == 0  # unsealed in the data file: costed by default
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == ["sealed-stand-in"]


@pytest.mark.unit
def test_each_source_allocator_is_known_and_changes_only_reserved_memory(data, bench):
    """`allocators:` names sources of the file with the allocator their launch path set; the caching allocator's
    reserve raises a reserved or device-used figure, never an allocated one, and never the time."""
    from tangram_launch.costmodel.allocator import ALLOCATOR_KINDS

    for source, kind in data["allocators"].items():
        assert source in data["sources"] and kind in ALLOCATOR_KINDS, (source, kind)
    row = next(r for r in data["runs"] if r["source"]["ref"] == "flagperf" and r["published"].get("memory_gib"))
    as_kind = {k: bench.evaluate({**row, "runtime": {**(row.get("runtime") or {}), "allocator": k}}, data)
               for k in ALLOCATOR_KINDS}
    assert as_kind["caching"]["predicted_gib"] > as_kind["expandable"]["predicted_gib"]
    assert as_kind["caching"]["predicted_s"] == as_kind["expandable"]["predicted_s"]
    allocated = {**row, "published": {**row["published"], "memory_convention": "allocator-allocated"}}
    costed = bench.evaluate(allocated, data)
    assert costed["predicted_gib"] < as_kind["expandable"]["predicted_gib"]  # no reserve, no CUDA context
    with pytest.raises(ValueError, match="allocator 'slab'"):
        bench.evaluate({**row, "runtime": {"allocator": "slab"}}, data)


@pytest.mark.unit
def test_unseal_can_name_the_cohorts_it_costs(data, bench, tmp_path, capsys):
    """`--unseal blind3` costs blind3's rows and keeps every other sealed cohort sealed, so judging a change on a
    cohort already unsealed never shows the one kept for the next change; a name that is not sealed is refused."""
    seen = next(r for r in data["runs"] if r["id"] == "mpt-a100-80-7b-s2k-8")
    rows = [{**copy.deepcopy(seen), "id": f"stand-in-{c}", "cohort": c, "split": "validation"} for c in ("b1", "b2")]
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({**data, "sealed_cohorts": ["b1", "b2"], "runs": rows}), encoding="utf-8")
    assert bench.main(["--data", str(path), "--json", "--unseal", "b1"]) == 0
    out = capsys.readouterr()
    assert [r["id"] for r in json.loads(out.out)] == ["stand-in-b1"] and "cohort b2 not costed" in out.err
    with pytest.raises(SystemExit):
        bench.main(["--data", str(path), "--json", "--unseal", "b3"])
    assert "--unseal b3: not a sealed cohort (sealed: b1, b2)" in capsys.readouterr().err

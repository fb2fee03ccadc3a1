"""The published-runs validation set (benchmarks/data/published_runs.yaml) is well formed: it parses, has at least
30 rows, every row cites a source and a FLOP convention, every model and GPU name resolves, and the benchmark turns
every published figure into seconds per iteration."""
import importlib.util
import os

import pytest

from tangram_launch.specs.catalog import default_catalog
from tangram_launch.specs.model import ModelSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks", "bench_costmodel_published.py")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_costmodel_published", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def data(bench):
    return bench.load_data()


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

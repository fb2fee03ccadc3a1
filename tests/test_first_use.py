"""What a new user meets first: the README's commands as printed, the CLI's messages, the pictures, the profile
cache, the benchmarks' claims and the test tiers themselves."""
from __future__ import annotations

import datetime as dt
import logging
import os
import re
import shlex
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from tangram_launch.cli import main

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
BENCHMARKS_README = (REPO / "benchmarks" / "README.md").read_text(encoding="utf-8")
CLUSTERS = REPO / "examples" / "clusters"
SVG = "{http://www.w3.org/2000/svg}"


def readme_command(subcommand: str, contains: str = "") -> list[str]:
    """The README's `tangram-launch SUBCOMMAND ...` line (continuations joined), without its [optional] parts."""
    block = README.split("## Commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    line = next(x for x in lines if x.split()[:2] == ["tangram-launch", subcommand] and contains in x)
    line = re.sub(r"\[[^\]]*\]", "", line.split("#", 1)[0])
    return shlex.split(line)[1:]


def readme_yaml(name: str) -> dict:
    block = next(b.split("```", 1)[0] for b in README.split("```yaml")[1:] if b.lstrip().startswith(f"# {name}"))
    return yaml.safe_load(block)


# --- the README's commands -------------------------------------------------------------------------------------------

def test_readme_estimate_example_fits_and_exits_0(capsys):
    argv = readme_command("estimate")
    assert main([a.replace("examples/", f"{REPO}/examples/") for a in argv]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" not in out
    assert "64 micro-batches x 1 sequence;" in out  # not "1 sequences"


def test_readme_plan_command_is_the_quality_tables_c3_iii_scenario():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from bench_planner_quality import SCENARIOS
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    argv = readme_command("plan", "--compare")
    opts = dict(zip(argv[1::2], argv[2::2]))
    label, cluster, model, batch, seq, dtype, runtime = next(s for s in SCENARIOS if s[0] == "C3 (iii)")
    assert (opts["--cluster"], opts["--model"], int(opts["--global-batch"]), int(opts["--seq-len"]),
            opts["--dtype"]) == (f"examples/clusters/{cluster}.yaml", model, batch, seq, dtype)
    assert runtime == "torch"  # the command's default runtime


def _quality_row(label: str) -> list[str]:
    row = next(x for x in BENCHMARKS_README.splitlines() if x.startswith(f"| {label} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def _printed_iteration_s(out: str) -> float:
    return float(re.search(r"^iteration ([\d.]+) s", out, re.M).group(1))


@pytest.mark.slow
def test_readme_plan_command_prints_the_tables_figures(capsys):
    argv = readme_command("plan", "--compare")
    assert main([a.replace("examples/", f"{REPO}/examples/") for a in argv]) == 0
    out = capsys.readouterr().out
    row = _quality_row("C3 (iii)")  # scenario, model, GPUs, runtime, Tangram s, islands, homogeneous, best, uniform
    assert f"{_printed_iteration_s(out):.2f}" == row[4]
    for name, cell in (("homogeneous", row[6]), ("best-island", row[7]), ("uniform-split", row[8])):
        if cell == "infeasible":
            assert re.search(rf"^{name}\s+infeasible\s", out, re.M), (name, cell)
            continue
        seconds, speedup = re.fullmatch(r"([\d.]+) \(([\d.]+x)\)", cell).groups()
        got = re.search(rf"^{name}\s+([\d.]+) s\s+[\d,]+\s+[\d.]+ %\s+([\d.]+x)$", out, re.M)
        # the CLI prints 3 decimals, the table 2 (rounded from the unrounded figure): within half a cent
        assert got and abs(float(got.group(1)) - float(seconds)) <= 0.0051 and got.group(2) == speedup, (name, cell)


@pytest.mark.slow
def test_readme_hand_written_plan_costs_like_the_searched_one(tmp_path, capsys):
    path = tmp_path / "my-plan.yaml"
    path.write_text(yaml.safe_dump(readme_yaml("my-plan.yaml")))
    argv = readme_command("plan", "--plan")
    argv = [str(path) if a == "my-plan.yaml" else a.replace("examples/", f"{REPO}/examples/") for a in argv]
    assert main(argv + ["--workers", "1", "-o", str(tmp_path / "hand.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("manual plan for gpt3-13b")
    hand = _printed_iteration_s(out)
    searched = float(_quality_row("C3 (iii)")[4])
    # the README's plan is the searched one written by hand, priced as the search prices it, so it costs what the
    # search does
    assert f"{hand:.2f}" == f"{searched:.2f}"  # (the benchmark table gives 2 decimals; exact below)
    assert f"it costs {hand:.3f} s, as the searched plan does" in " ".join(README.split())
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    result = search(ClusterSpec.load(os.path.join(REPO, "examples", "clusters", "c3-full-het-iii.yaml")),
                    load_model("gpt3-13b"), TrainingSpec(global_batch=128, seq_len=2048, dtype="fp16"),
                    runtime="torch", options=PlannerOptions(max_workers=1, progress=False))
    import json

    exact = json.loads((tmp_path / "hand.json").read_text())["predicted"]["iteration_time_s"]
    assert exact == pytest.approx(result.plan.predicted.iteration_time_s, rel=1e-12)


def test_readme_hand_written_plan_is_the_documented_format(tmp_path):
    from tangram_launch.planner.manual import load_manual_plan

    path = tmp_path / "my-plan.yaml"
    path.write_text(yaml.safe_dump(readme_yaml("my-plan.yaml")))
    manual = load_manual_plan(str(path), num_layers=40, island_names=["a100-80gb", "v100-32gb", "v100-16gb"])
    written = readme_yaml("my-plan.yaml")["stages"]
    assert [s.layers for s in manual.stages] == [tuple(w["layers"]) for w in written]
    assert manual.stages[0].layers[0] == 0 and manual.stages[-1].layers[1] == 40  # the whole model, in order
    assert [s.island for s in manual.stages] == [w["island"] for w in written]
    # every field the README writes besides layers and island is fixed as written; the parallelizer picks the rest
    assert [s.fixed for s in manual.stages] == [{k: v for k, v in w.items() if k not in ("layers", "island")}
                                               for w in written]
    assert {"tp", "dp", "zero_stage", "recompute"} <= {k for w in written for k in w}  # the fields it shows


# --- the CLI's messages ----------------------------------------------------------------------------------------------

def test_no_arguments_lists_the_subcommands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    for sub in ("islands", "estimate", "plan", "profile", "script.py"):
        assert f"tangram-launch {sub}" in err or sub in err
    assert "tangram-launch --help" in err


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError


def test_timeline_png_without_matplotlib_names_the_option_before_planning(no_matplotlib, capsys, monkeypatch):
    import tangram_launch.planner.plan_search as plan_search

    monkeypatch.setattr(plan_search, "search", lambda *a, **k: pytest.fail("planned before checking --timeline"))
    rc = main(["plan", "--cluster", str(CLUSTERS / "cpu-2.yaml"), "--model", "tiny", "--timeline", "x.png"])
    err = capsys.readouterr().err
    assert rc == 2 and "--timeline" in err and "matplotlib" in err and "output" not in err
    rc = main(["plan", "--cluster", str(CLUSTERS / "cpu-2.yaml"), "--model", "tiny", "--timeline", "x.jpg"])
    err = capsys.readouterr().err
    assert rc == 2 and "--timeline" in err and ".svg or .png" in err


def test_islands_draw_bad_name_names_the_option(no_matplotlib, capsys):
    assert main(["islands", "--cluster", str(CLUSTERS / "c3-full-het-iii.yaml"), "--draw", "i.png"]) == 2
    err = capsys.readouterr().err
    assert "--draw" in err and "output" not in err


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_islands_draw_says_where_it_wrote(tmp_path, capsys, fmt, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["islands", "--cluster", str(CLUSTERS / "c3-full-het-iii.yaml"), "--format", fmt,
                 "--draw", "isl.svg"]) == 0
    out = capsys.readouterr()
    note = f"islands picture written to {tmp_path / 'isl.svg'}"
    assert note in (out.out if fmt == "table" else out.err)
    if fmt == "json":
        import json

        json.loads(out.out)  # stdout stays pure JSON


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_plan_timeline_and_output_say_where_they_wrote(tmp_path, capsys, fmt, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["plan", "--cluster", str(CLUSTERS / "cpu-2.yaml"), "--model", "tiny", "--global-batch", "4",
               "--seq-len", "64", "--workers", "1", "--format", fmt, "--timeline", "t.svg", "-o", "p.json"])
    assert rc == 0
    out = capsys.readouterr()
    where = out.out if fmt == "table" else out.err
    assert f"timeline drawn to {tmp_path / 't.svg'}" in where
    assert f"plan written to {tmp_path / 'p.json'}" in where
    assert (tmp_path / "t.svg").exists() and (tmp_path / "p.json").exists()


def test_plan_table_says_1_sequence():
    from helpers_plans import make_plan
    from tangram_launch.planner.report import format_plan_table

    one = make_plan("tiny", [(2, "n0"), (2, "n1")], global_batch=4, num_microbatches=4)
    assert "4 micro-batches of 1 sequence," in format_plan_table(one)
    two = make_plan("tiny", [(2, "n0"), (2, "n1")], global_batch=8, num_microbatches=4)
    assert "4 micro-batches of 2 sequences," in format_plan_table(two)


# --- the profile cache -----------------------------------------------------------------------------------------------

def test_profile_age_in_words():
    from tangram_launch.launch.planning import profile_age

    now = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
    assert profile_age("2026-11-30T11:48:00+00:00", now) == "12 min ago"
    assert profile_age("2026-11-30T08:47:30+00:00", now) == "3 h 12 min ago"
    assert profile_age("2026-11-28T08:00:00+00:00", now) == "2 days 4 h ago"
    assert profile_age("2026-11-29T11:00:00+00:00", now) == "1 day 1 h ago"
    assert profile_age("?", now) == "age unknown"
    assert "clock" in profile_age("2026-12-01T00:00:00+00:00", now)


def test_reusing_a_cached_profile_says_how_old_it_is_and_how_to_measure_again(tmp_path, caplog):
    from tangram_launch.launch import planning as planned, profile_cache
    from tangram_launch.launch.torchrun import LaunchOptions
    from tangram_launch.specs.cluster import ClusterSpec

    options = LaunchOptions.from_argv(["--standalone", "--nproc-per-node", "2", "train.py"])
    fp = planned.live_fingerprint(2)
    path = tmp_path / "profiles" / (fp.split(":", 1)[-1] + ".yaml")
    path.parent.mkdir()
    path.write_text((CLUSTERS / "profiled-cpu-2.yaml").read_text())  # a quick profile, measured 2026-11-29
    profile_cache.seal(str(path), fp, ClusterSpec.load(path).fingerprint)  # as the profiler's caching does
    with caplog.at_level(logging.INFO, logger="tangram_launch.launch.planning"):
        spec, where, reused = planned.profile_cluster(options, quick=True, directory=str(tmp_path))
    assert reused and where == str(path)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "measured 2026-11-29T18:51:42+00:00" in text and " ago" in text
    assert "to measure again, pass --reprofile or delete that file" in text


# --- the pictures ----------------------------------------------------------------------------------------------------

def _svg_texts(path: Path) -> list[str]:
    return [t.text or "" for t in ET.parse(path).getroot().iter(f"{SVG}text")]


@pytest.mark.parametrize("name", ["c3-4-islands-20gpu", "c3-full-het-iii", "c1-compute-het", "c2-modern-het"])
def test_islands_picture_labels_are_not_crossed_by_arcs(name):
    from tangram_launch.draw import Curve, Rect, Text, _curve_points, islands_items
    from tangram_launch.islands import build_islands
    from tangram_launch.specs.cluster import ClusterSpec

    cluster = ClusterSpec.load(str(CLUSTERS / f"{name}.yaml"))
    iset = build_islands(cluster)
    items, _, _ = islands_items(cluster, iset)
    curves = [it for it in items if isinstance(it, Curve)]
    k = len(iset.islands)
    assert len(curves) == k * (k - 1) // 2
    labels = [it for it in items if isinstance(it, Text) and re.fullmatch(r"[\d.]+ GB/s, [\d.]+ us", it.text)]
    assert len(labels) == len(curves)
    boxes = []
    for lb in labels:  # the white box drawn under each label
        box = next(it for it in items if isinstance(it, Rect) and it.fill == "white" and it.x <= lb.x <= it.x + it.w
                   and it.y <= lb.y <= it.y + it.h and it.rx == 0)
        boxes.append((box.x, box.y, box.x + box.w, box.y + box.h))
    for c in curves:
        top = c.y1
        lift = (top - c.cy) / 2
        for x, y in _curve_points(c.x1, c.x2, lift):
            for x0, y0, x1, y1 in boxes:
                assert not (x0 <= x <= x1 and y0 <= top + y <= y1), (name, c, (x0, y0, x1, y1))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)


def test_islands_picture_has_a_legend_for_link_styles(tmp_path):
    assert main(["islands", "--cluster", str(CLUSTERS / "c3-full-het-iii.yaml"), "--draw",
                 str(tmp_path / "i.svg")]) == 0
    texts = " ".join(_svg_texts(tmp_path / "i.svg"))
    assert "link between two islands" in texts and "slow link (under 10 GB/s)" in texts


def test_picture_texts_have_no_runs_of_spaces(tmp_path):
    """SVG collapses runs of spaces, so text that relies on them (the timeline subtitle did) runs together."""
    assert main(["plan", "--cluster", str(CLUSTERS / "cpu-2.yaml"), "--model", "tiny", "--global-batch", "4",
                 "--seq-len", "64", "--workers", "1", "--timeline", str(tmp_path / "t.svg")]) == 0
    assert main(["islands", "--cluster", str(CLUSTERS / "c3-4-islands-20gpu.yaml"), "--draw",
                 str(tmp_path / "i.svg")]) == 0
    for picture in ("t.svg", "i.svg"):
        texts = _svg_texts(tmp_path / picture)
        assert texts and not [t for t in texts if "  " in t], picture


# --- benchmarks ------------------------------------------------------------------------------------------------------

def test_pruning_ablation_runs_all_eight_combinations_once():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from bench_planner_pruning import policy_rows
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    rows = policy_rows()
    assert len(rows) == 8 and len({flags for _, flags in rows}) == 8 and len({label for label, _ in rows}) == 8


# --- the tiers -------------------------------------------------------------------------------------------------------

def test_a_unit_test_that_starts_a_process_fails_even_if_the_error_is_swallowed(pytester):
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makeini((REPO / "pytest.ini").read_text().replace("testpaths = tests\n", ""))
    pytester.makepyfile(test_tiers="""
        import subprocess, sys
        import pytest

        def test_spawns():
            subprocess.run([sys.executable, "-c", "pass"])

        def test_swallows():
            try:
                subprocess.run([sys.executable, "-c", "pass"])
            except Exception:
                pass

        def test_pool():
            import concurrent.futures as cf
            with cf.ProcessPoolExecutor(1) as pool:
                pool.submit(print).result()

        def test_in_process():
            assert sum(range(4)) == 6

        @pytest.mark.distributed
        def test_marked():
            pass
    """)
    result = pytester.runpytest_inprocess("-m", "unit", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=3, deselected=1)
    result.stdout.fnmatch_lines(["*a unit test may not start a subprocess: mark test_swallows @pytest.mark.distributed*"])

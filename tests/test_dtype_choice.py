"""The launch's dtype when none is given: the fastest measured on CPU processes, printed with why; an explicit
--dtype (or the resumed checkpoint's) always wins; MFU names the peak it is a fraction of."""
from __future__ import annotations

import copy
from pathlib import Path

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.launch.dtype_choice import (CPU_CANDIDATE_DTYPES, choose_dtype, launch_dtype_choice,
                                                measured_cpu_tflops, mfu_peak_label)
from tangram_launch.specs.cluster import ClusterSpec

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"


def _profiled(bf16: float, fp32: float) -> ClusterSpec:
    """The example profiled 2-process CPU cluster with both devices' GEMM rates replaced."""
    raw = yaml.safe_load((CLUSTERS / "profiled-cpu-2.yaml").read_text())
    raw = copy.deepcopy(raw)
    for g in raw["nodes"][0]["gpus"]:
        g["tflops"].update(bf16=bf16, fp32=fp32)
        g["measured"]["gemm_tflops"] = {"bf16": bf16, "fp32": fp32}
    return ClusterSpec.from_dict(raw, source="test")


def test_a_cpu_without_bf16_hardware_trains_fp32_and_says_why():
    cluster = _profiled(bf16=0.000748, fp32=0.159)
    choice = launch_dtype_choice(cluster, default="bf16", given=None)
    assert choice.dtype == "fp32"
    assert choice.reason == ("dtype fp32: fastest measured on this cluster (fp32 0.159 TFLOP/s, bf16 0.000748); "
                             "pass --dtype to choose")


def test_a_cpu_with_bf16_hardware_trains_bf16():
    cluster = ClusterSpec.load(CLUSTERS / "profiled-cpu-2.yaml")  # bf16 0.19-0.24, fp32 0.06-0.10 TFLOP/s
    assert measured_cpu_tflops(cluster) == {"fp32": 0.05706, "bf16": 0.1881}  # the slower device's figures
    assert launch_dtype_choice(cluster, default="fp32", given=None).dtype == "bf16"


def test_an_explicit_or_resumed_dtype_wins_over_the_measurement():
    cluster = _profiled(bf16=0.001, fp32=0.2)
    given = launch_dtype_choice(cluster, default="bf16", given="bf16", resumed_plan={"training": {"dtype": "fp32"}})
    assert (given.dtype, given.reason) == ("bf16", "dtype bf16: given with --dtype")
    resumed = launch_dtype_choice(cluster, default="fp32", given=None, resumed_plan={"training": {"dtype": "bf16"}})
    assert resumed.dtype == "bf16" and "checkpoint" in resumed.reason


def test_placeholder_cpus_and_gpus_keep_the_default():
    for name in ("cpu-2.yaml", "c1-compute-het.yaml", "profiled-h200.yaml"):
        cluster = ClusterSpec.load(CLUSTERS / name)
        assert measured_cpu_tflops(cluster) is None, name
        choice = launch_dtype_choice(cluster, default="bf16", given=None)
        assert choice.dtype == "bf16" and "default" in choice.reason, name


def test_mfu_names_its_peak():
    assert mfu_peak_label(_profiled(bf16=0.001, fp32=0.2), "fp32") == \
        "the measured fp32 GEMM rate of the CPU processes used, not a hardware peak"
    assert "placeholder" in mfu_peak_label(ClusterSpec.load(CLUSTERS / "cpu-2.yaml"), "bf16")
    assert mfu_peak_label(ClusterSpec.load(CLUSTERS / "c1-compute-het.yaml"), "fp16") == \
        "the catalog fp16 peak of the GPUs used"


rates = st.one_of(st.none(), st.floats(min_value=1e-6, max_value=1e4, allow_nan=False))


@settings(max_examples=60, deadline=None)
@given(measured=st.fixed_dictionaries({d: rates for d in CPU_CANDIDATE_DTYPES}),
       explicit=st.one_of(st.none(), st.sampled_from(["bf16", "fp16", "fp32"])))
def test_the_choice_is_the_explicit_one_else_the_fastest_measured_else_the_default(measured, explicit):
    choice = choose_dtype(explicit, "bf16", measured)
    known = {d: v for d, v in measured.items() if v}
    if explicit:
        assert choice.dtype == explicit
    elif known:
        assert known[choice.dtype] == max(known.values())
        assert choice.reason.startswith(f"dtype {choice.dtype}: fastest measured") and "--dtype" in choice.reason
    else:
        assert choice.dtype == "bf16"

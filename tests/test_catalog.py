"""GPU catalog: name normalisation, figures against GPU-FACTS.md, validation of the data file, example clusters."""
from __future__ import annotations

import copy
import glob
import os

import pytest
import yaml

from tangram_launch.errors import SpecError
from tangram_launch.specs.catalog import (
    FIGURES,
    GpuCatalog,
    GpuType,
    default_catalog,
    normalize_gpu_name,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOG_FILE = os.path.join(REPO, "tangram_launch", "specs", "gpu_catalog.yaml")
CLUSTER_DIR = os.path.join(REPO, "examples", "clusters")

REQUIRED = [
    "t4", "v100-16gb", "v100-32gb", "v100-pcie-16gb", "v100-pcie-32gb", "a100-40gb", "a100-80gb", "a100-pcie-80gb",
    "h100-sxm", "h100-pcie", "h100-nvl", "h200", "b200", "l4", "l40s", "a10g", "rtx-4090", "cpu",
]


@pytest.fixture(scope="module")
def catalog() -> GpuCatalog:
    return default_catalog()


@pytest.fixture(scope="module")
def raw_once() -> dict:
    with open(CATALOG_FILE, encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture()
def raw(raw_once) -> dict:
    """The catalog file's mapping, parsed once: each test gets its own copy to edit."""
    return copy.deepcopy(raw_once)


# --- lookups ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", REQUIRED)
def test_canonical_names_resolve_to_themselves(catalog, name):
    assert name in catalog
    assert catalog.lookup(name).name == name
    assert normalize_gpu_name(name) == name


@pytest.mark.parametrize("nvml_name, expected", [
    ("Tesla T4", "t4"),
    ("Tesla V100-SXM2-16GB", "v100-16gb"),
    ("Tesla V100-SXM2-32GB", "v100-32gb"),
    ("Tesla V100-PCIE-16GB", "v100-pcie-16gb"),
    ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("A100-SXM-80GB", "a100-80gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"),
])
def test_nvml_names_resolve(catalog, nvml_name, expected):
    assert catalog.lookup(nvml_name).name == expected
    assert normalize_gpu_name(nvml_name) == expected
    assert nvml_name in catalog


@pytest.mark.parametrize("spelling, expected", [
    ("A100_80GB", "a100-80gb"),             # underscores
    ("a100 80gb", "a100-80gb"),             # spaces
    ("a100-sxm4-80gb", "a100-80gb"),        # SXM form dropped
    ("a100 pcie 80gb", "a100-pcie-80gb"),   # token order does not matter after the model
    ("H100-SXM5-80GB", "h100-sxm"),
    ("h100 sxm5", "h100-sxm"),
    ("NVIDIA H200 141GB HBM3e", "h200"),
    ("V100-SXM2-16GB", "v100-16gb"),
    ("  tesla   v100-sxm2-32gb ", "v100-32gb"),
    ("RTX4090", "rtx-4090"),
    ("GeForce RTX 4090", "rtx-4090"),
    ("CPU", "cpu"),
])
def test_normalisation_variants(catalog, spelling, expected):
    assert catalog.lookup(spelling).name == expected


def test_short_memory_suffix_is_suggested_not_matched(catalog):
    # "80G" could be the SXM or the PCIe part: a suggestion of both, never a silent pick.
    with pytest.raises(SpecError) as exc:
        catalog.lookup("A100-80G")
    assert "ambiguous" in str(exc.value) and "a100-80gb or a100-pcie-80gb" in str(exc.value)
    assert "A100-80G" not in catalog and catalog.canonical_name("A100-80G") is None


def test_unknown_name_keeps_normal_form():
    # Not in the catalog: still normalised, so equal hardware compares equal.
    assert normalize_gpu_name("NVIDIA Foo-X_24GB HBM3") == "foo-x-24gb"
    assert normalize_gpu_name("NVIDIA Foo X 24G") == normalize_gpu_name("foo-x-24gb")


def test_unknown_name_suggests_closest(catalog):
    with pytest.raises(SpecError) as exc:
        catalog.lookup("b100")
    msg = str(exc.value)
    assert "'b100'" in msg and "did you mean 'b200'" in msg
    assert exc.value.value == "b100"


def test_ambiguous_family_lists_variants(catalog):
    with pytest.raises(SpecError) as exc:
        catalog.lookup("a100")
    msg = str(exc.value)
    for variant in ("a100-40gb", "a100-80gb", "a100-pcie-40gb", "a100-pcie-80gb"):
        assert variant in msg
    with pytest.raises(SpecError, match="v100-16gb"):
        catalog.lookup("Tesla V100S-PCIE-32GB")  # V100S is not in the catalog; its family is suggested


def test_unknown_name_lookup_names_field_and_source(catalog):
    with pytest.raises(SpecError) as exc:
        catalog.lookup("mi300x", field="nodes[0].gpu", source="cluster.yaml")
    assert "cluster.yaml" in str(exc.value) and "nodes[0].gpu" in str(exc.value)
    assert "mi300x" not in catalog
    assert 42 not in catalog


def test_default_catalog_is_loaded_once():
    assert default_catalog() is default_catalog()
    assert set(REQUIRED) <= set(default_catalog().names())


# --- dtypes -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["t4", "v100-16gb", "v100-32gb", "v100-pcie-16gb", "v100-pcie-32gb"])
def test_bf16_unsupported_on_turing_and_volta(catalog, name):
    gpu = catalog.lookup(name)
    assert gpu.tflops["bf16"] is None
    with pytest.raises(SpecError) as exc:
        gpu.peak_tflops("bf16")
    msg = str(exc.value)
    assert "bf16" in msg and "fp16" in msg and "fp32" in msg  # names the alternatives
    assert gpu.peak_tflops("fp16") > gpu.peak_tflops("fp32") > 0
    assert gpu.supported_dtypes() == ("fp16", "fp32")


def test_dtype_spellings(catalog):
    h100 = catalog.lookup("h100-sxm")
    assert h100.peak_tflops("torch.bfloat16") == h100.peak_tflops("bf16") == 989
    assert h100.peak_tflops("float16") == 989
    assert h100.peak_tflops("float32") == 67
    assert h100.peak_tflops("float8") == h100.peak_tflops("fp8") == 1979  # 3,958 sparse / 2
    assert h100.peak_tflops("tf32") == 494.5
    with pytest.raises(SpecError, match="unknown dtype"):
        h100.peak_tflops("fp4")


def test_fp8_only_on_hopper_ada_and_blackwell_and_tf32_from_ampere(catalog):
    fp8 = sorted(g.name for g in catalog if g.tflops.get("fp8"))
    assert fp8 == ["b200", "h100-nvl", "h100-pcie", "h100-sxm", "h200", "l4", "l40s"]
    with pytest.raises(SpecError, match="no fp8 tensor support"):
        catalog.lookup("a100-80gb").peak_tflops("fp8")
    assert catalog.lookup("a100-80gb").peak_tflops("tf32") == 156  # vs 19.5 on the CUDA cores
    for name in ("t4", "v100-16gb", "v100-32gb"):
        assert catalog.lookup(name).tflops["tf32"] is None and catalog.lookup(name).tflops["fp8"] is None


# --- figures and sources ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, figure, expected", [
    # /work/shared/GPU-FACTS.md
    ("h100-sxm", "tflops.bf16", 989), ("h100-sxm", "memory_bandwidth_GBps", 3350),
    ("h100-sxm", "intra_node_bandwidth_GBps", 900), ("h100-sxm", "memory_gib", 80),
    ("h100-pcie", "tflops.bf16", 756), ("h100-pcie", "memory_bandwidth_GBps", 2000),
    ("h100-pcie", "intra_node_bandwidth_GBps", 128),
    ("h100-nvl", "memory_gib", 94), ("h100-nvl", "tflops.bf16", 835),
    ("a100-40gb", "tflops.bf16", 312), ("a100-40gb", "memory_bandwidth_GBps", 1555),
    ("a100-80gb", "tflops.bf16", 312), ("a100-80gb", "memory_bandwidth_GBps", 2039),
    ("a100-80gb", "intra_node_bandwidth_GBps", 600), ("a100-pcie-80gb", "memory_bandwidth_GBps", 1935),
    ("h200", "tflops.bf16", 989), ("h200", "memory_gib", 141), ("h200", "memory_bandwidth_GBps", 4800),
    ("b200", "tflops.bf16", 2250), ("b200", "memory_gib", 180), ("b200", "memory_bandwidth_GBps", 8000),
    ("b200", "intra_node_bandwidth_GBps", 1800),
    ("t4", "tflops.fp16", 65), ("t4", "memory_bandwidth_GBps", 320), ("t4", "intra_node_bandwidth_GBps", 32),
    ("v100-16gb", "tflops.fp16", 125), ("v100-16gb", "intra_node_bandwidth_GBps", 300),
    ("v100-32gb", "memory_gib", 32), ("v100-pcie-16gb", "tflops.fp16", 112),
    ("l4", "tflops.bf16", 121), ("l4", "memory_bandwidth_GBps", 300),
    ("l40s", "tflops.bf16", 362), ("l40s", "memory_bandwidth_GBps", 864),
    ("a10g", "memory_bandwidth_GBps", 600), ("rtx-4090", "tflops.fp16", 165),
    ("rtx-4090", "memory_bandwidth_GBps", 1008),
    # fp32 non-tensor, from the stored datasheet mirrors
    ("a100-80gb", "tflops.fp32", 19.5), ("h100-sxm", "tflops.fp32", 67), ("h100-pcie", "tflops.fp32", 51),
    ("b200", "tflops.fp32", 80), ("l40s", "tflops.fp32", 91.6), ("t4", "tflops.fp32", 8.1),
])
def test_figures_match_gpu_facts(catalog, name, figure, expected):
    gpu = catalog.lookup(name)
    value = gpu.tflops[figure.split(".")[1]] if figure.startswith("tflops.") else getattr(gpu, figure)
    assert value == pytest.approx(expected)


@pytest.mark.parametrize("name, gen, bw", [("t4", 3, 32), ("l4", 4, 64), ("l40s", 4, 64), ("a10g", 4, 64),
                                           ("rtx-4090", 4, 64), ("a100-pcie-80gb", 4, 64), ("h100-pcie", 5, 128),
                                           ("h100-nvl", 5, 128), ("v100-pcie-32gb", 3, 32)])
def test_pcie_parts_carry_pcie_x16_bidirectional(catalog, name, gen, bw):
    gpu = catalog.lookup(name)
    assert (gpu.interconnect, gpu.pcie_gen, gpu.intra_node_bandwidth_GBps) == ("pcie", gen, bw)


def test_nvlink_parts_beat_pcie(catalog):
    for gpu in catalog:
        if gpu.interconnect == "nvlink":
            assert gpu.intra_node_bandwidth_GBps >= 300, gpu.name
            assert gpu.intra_node_bandwidth_GBps > 16 * 2 ** gpu.pcie_gen, gpu.name


def test_every_figure_has_a_resolved_source(catalog):
    for gpu in catalog:
        needed = [f for f in FIGURES if f != "pcie_gen" or gpu.pcie_gen is not None]
        for fig in needed:
            text = gpu.sources.get(fig, "")
            assert text.strip(), f"{gpu.name}: no source for {fig}"
            assert "@" not in text, f"{gpu.name}.{fig}: unresolved reference in {text!r}"
            assert "http" in text or "GPU-FACTS" in text or "datasheet" in text or "placeholder" in text, \
                f"{gpu.name}.{fig}: source cites nothing: {text!r}"


def test_unverified_figures_are_marked(catalog):
    # GPU-FACTS.md marks these as unverified; the catalog must say so too.
    assert "[unverified" in catalog.lookup("h100-nvl").sources["tflops.bf16"]
    assert "[unverified" in catalog.lookup("a10g").sources["tflops.bf16"]
    assert "[unverified" in catalog.lookup("v100-16gb").sources["intra_node_bandwidth_GBps"]
    assert "placeholder" in catalog.lookup("cpu").sources["tflops.fp32"]


def test_cpu_is_a_host_placeholder(catalog):
    cpu = catalog.lookup("cpu")
    assert cpu.interconnect == "host" and cpu.pcie_gen is None
    assert all(cpu.peak_tflops(dt) > 0 for dt in ("bf16", "fp16", "fp32"))


def test_gpu_type_is_immutable_and_hashable(catalog):
    gpu = catalog.lookup("a100-80gb")
    with pytest.raises(TypeError):
        gpu.tflops["bf16"] = 1.0  # type: ignore[index]
    assert {gpu: 1}[catalog.lookup("NVIDIA A100-SXM4-80GB")] == 1


# --- validation -------------------------------------------------------------------------------------------------

def test_data_file_loads_as_shipped():
    cat = GpuCatalog.from_file(CATALOG_FILE)
    assert cat.names() == default_catalog().names()


@pytest.mark.parametrize("path, value, field", [
    (("gpus", "t4", "memory_gib"), -16, "gpus.t4.memory_gib"),
    (("gpus", "t4", "memory_gib"), 0, "gpus.t4.memory_gib"),
    (("gpus", "l4", "memory_bandwidth_GBps"), "fast", "gpus.l4.memory_bandwidth_GBps"),
    (("gpus", "b200", "intra_node_bandwidth_GBps"), True, "gpus.b200.intra_node_bandwidth_GBps"),
    (("gpus", "h100-sxm", "tflops", "bf16"), -989, "gpus.h100-sxm.tflops.bf16"),
    (("gpus", "h100-sxm", "tflops", "fp64"), 34, "gpus.h100-sxm.tflops.fp64"),
    (("gpus", "a100-80gb", "interconnect"), "infiniband", "gpus.a100-80gb.interconnect"),
    (("gpus", "a100-80gb", "pcie_gen"), 4.5, "gpus.a100-80gb.pcie_gen"),
    (("gpus", "a100-80gb", "sources", "memory_gib"), "", "gpus.a100-80gb.sources.memory_gib"),
    (("gpus", "a100-80gb", "sources", "memory_gib"), "@no-such-ref", "gpus.a100-80gb.sources.memory_gib"),
    (("gpus", "a100-80gb", "sources", "flops"), "x", "gpus.a100-80gb.sources.flops"),
    (("gpus", "l40s", "vram"), 48, "gpus.l40s.vram"),
])
def test_bad_figures_are_spec_errors_naming_entry_and_field(raw, path, value, field):
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(SpecError) as exc:
        GpuCatalog.from_dict(raw, source="gpu_catalog.yaml")
    assert exc.value.field == field
    assert "gpu_catalog.yaml" in str(exc.value)


@pytest.mark.parametrize("figure", ["tflops.fp16", "memory_gib", "intra_node_bandwidth_GBps", "pcie_gen",
                                    "tflops.bf16"])
def test_missing_source_is_an_error(raw, figure):
    del raw["gpus"]["t4"]["sources"][figure]
    with pytest.raises(SpecError, match="without a source") as exc:
        GpuCatalog.from_dict(raw)
    assert exc.value.field == f"gpus.t4.sources.{figure}"


def test_pcie_gen_source_not_needed_when_null(raw):
    raw["gpus"]["t4"]["pcie_gen"] = None
    del raw["gpus"]["t4"]["sources"]["pcie_gen"]
    assert GpuCatalog.from_dict(raw).lookup("t4").pcie_gen is None


def test_missing_field_and_all_dtypes_null(raw):
    bad = copy.deepcopy(raw)
    del bad["gpus"]["l4"]["memory_gib"]
    with pytest.raises(SpecError) as exc:
        GpuCatalog.from_dict(bad)
    assert exc.value.field == "gpus.l4.memory_gib"
    raw["gpus"]["l4"]["tflops"] = {"bf16": None, "fp16": None, "fp32": None}
    with pytest.raises(SpecError, match="no dtype is supported"):
        GpuCatalog.from_dict(raw)


def test_alias_shared_by_two_types_is_an_error(raw):
    raw["gpus"]["a100-40gb"]["aliases"].append("NVIDIA A100-SXM4-80GB")
    with pytest.raises(SpecError, match="ambiguous name") as exc:
        GpuCatalog.from_dict(raw)
    assert "a100" in exc.value.field


def test_bad_entry_name_and_top_level_key(raw):
    bad = copy.deepcopy(raw)
    bad["gpus"]["A100 Big"] = bad["gpus"].pop("a100-80gb")
    with pytest.raises(SpecError, match="lower case"):
        GpuCatalog.from_dict(bad)
    raw["gpu"] = {}
    with pytest.raises(SpecError, match="did you mean 'gpus'"):
        GpuCatalog.from_dict(raw)


def test_gpu_type_validates_when_built_in_code():
    good = dict(name="x", display_name="X", tflops={"bf16": 1, "fp16": 1, "fp32": 1}, memory_gib=8,
                memory_bandwidth_GBps=100, intra_node_bandwidth_GBps=10, interconnect="pcie", pcie_gen=4)
    assert GpuType(**good).sources == {}
    for key, value in [("memory_gib", 0), ("interconnect", "nvswitch"), ("pcie_gen", 0),
                       ("tflops", {"bf16": 1, "fp16": 1}), ("intra_node_bandwidth_GBps", float("nan"))]:
        with pytest.raises(SpecError):
            GpuType(**{**good, key: value})
    with pytest.raises(SpecError, match="unknown figure"):
        GpuType(**good, sources={"tflops.fp4": "x"})


# --- example clusters -------------------------------------------------------------------------------------------

EXPECTED_CLUSTERS = {
    # file: {gpu type: count}
    "c1-compute-het.yaml": {"t4": 8, "v100-16gb": 8},
    "c1-compute-het-4x4.yaml": {"t4": 4, "v100-16gb": 4},
    "c1-t4-only.yaml": {"t4": 8},
    "c1-v100-only.yaml": {"v100-16gb": 8},
    "c2-modern-het.yaml": {"h100-sxm": 8, "a100-80gb": 8},
    "c3-full-het-i.yaml": {"a100-80gb": 4},
    "c3-full-het-ii.yaml": {"a100-80gb": 4, "v100-32gb": 8},
    "c3-full-het-iii.yaml": {"a100-80gb": 4, "v100-32gb": 8, "v100-16gb": 4},
    "c3-4-islands-20gpu.yaml": {"a100-80gb": 4, "v100-32gb": 8, "v100-16gb": 4, "t4": 4},
    "cpu-2.yaml": {"cpu": 2},
    "two-pods-slow-link.yaml": {"a100-80gb": 32},  # issue 14: two pods joined by 1 GbE, not from the paper
    # issues 12 and 13: planning at cluster scale, interleaved 1F1B (not from the paper)
    "opt350m-128gpu.yaml": {"a100-40gb": 32, "v100-16gb": 96},
    "opt350m-320gpu.yaml": {"a100-40gb": 80, "v100-16gb": 240},
    "opt350m-512gpu.yaml": {"a100-40gb": 128, "v100-16gb": 384},
    "llama3-405b-256gpu.yaml": {"h200": 128, "h100-sxm": 128},
    "llama3-405b-4096gpu.yaml": {gpu: 512 for gpu in ("b200", "h200", "h100-sxm", "a100-80gb", "a100-40gb", "l40s",
                                                     "v100-32gb", "v100-16gb")},
}
NOT_FROM_THE_PAPER = {"cpu-2.yaml", "two-pods-slow-link.yaml", "opt350m-128gpu.yaml", "opt350m-320gpu.yaml",
                      "opt350m-512gpu.yaml", "llama3-405b-256gpu.yaml", "llama3-405b-4096gpu.yaml"}


def test_all_example_clusters_are_expected():
    # Hand-written examples only; profiled-*.yaml files are profiler output (tested in test_profiler_*).
    found = {os.path.basename(p) for p in glob.glob(os.path.join(CLUSTER_DIR, "*.yaml"))}
    assert {f for f in found if not f.startswith("profiled-")} == set(EXPECTED_CLUSTERS)


@pytest.mark.parametrize("fname", sorted(EXPECTED_CLUSTERS))
def test_example_cluster_yaml_names_catalog_gpus(catalog, fname):
    path = os.path.join(CLUSTER_DIR, fname)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.startswith("#"), "each example starts with a comment saying what it models"
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    if fname not in NOT_FROM_THE_PAPER:
        assert "paper §6" in header, "the header cites the paper section"
    data = yaml.safe_load(text)
    counts: dict[str, int] = {}
    for node in data["nodes"]:
        gpu = catalog.lookup(node["gpu"])  # raises if unknown
        counts[gpu.name] = counts.get(gpu.name, 0) + node.get("count", 1)
    assert counts == EXPECTED_CLUSTERS[fname]


@pytest.mark.parametrize("fname", sorted(EXPECTED_CLUSTERS))
def test_example_cluster_loads_as_cluster_spec(fname):
    from tangram_launch.specs.cluster import ClusterSpec

    spec = ClusterSpec.load(os.path.join(CLUSTER_DIR, fname))
    assert spec.num_gpus == sum(EXPECTED_CLUSTERS[fname].values())
    for node in spec.nodes:
        assert len({g.type for g in node.gpus}) == 1  # each example node holds one GPU type


def test_c3_iii_v100_16gb_node_has_the_slow_link():
    from tangram_launch.specs.cluster import ClusterSpec

    spec = ClusterSpec.load(os.path.join(CLUSTER_DIR, "c3-full-het-iii.yaml"))
    by_type = {n.gpus[0].type: n.name for n in spec.nodes}
    ib = spec.link(by_type["a100-80gb"], by_type["v100-32gb"])
    assert ib.bandwidth_GBps == 25  # HDR 200 Gb/s
    for other in ("a100-80gb", "v100-32gb"):
        slow = spec.link(by_type["v100-16gb"], by_type[other])
        assert slow.bandwidth_GBps < ib.bandwidth_GBps / 4
        assert slow.latency_us > ib.latency_us


def test_c1_interconnects_differ_within_nodes():
    from tangram_launch.specs.cluster import ClusterSpec

    spec = ClusterSpec.load(os.path.join(CLUSTER_DIR, "c1-compute-het.yaml"))
    bw = {n.gpus[0].type: n.gpus[0].intra_node_bandwidth_GBps for n in spec.nodes}
    assert bw == {"t4": 32, "v100-16gb": 300}  # PCIe Gen3 vs NVLink 2

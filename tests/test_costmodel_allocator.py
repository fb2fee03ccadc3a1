"""What the CUDA caching allocator reserves beyond what a plan needs (costmodel/allocator.py): read from the
environment the workers inherit as torch reads it, shown by ``tangram-launch estimate``, never a reason to refuse a
plan that fits."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.cli import main
from tangram_launch.costmodel.allocator import (
    ALLOC_CONF_VARIABLES,
    CACHING_FRAGMENTATION_FRACTION,
    allocator_kind,
    allocator_settings,
    reserved_bytes,
)
from tangram_launch.errors import SpecError
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.constants import GIB

pytestmark = pytest.mark.unit

OTHER_SETTINGS = st.lists(st.sampled_from(["max_split_size_mb:128", "garbage_collection_threshold:0.6",
                                           "roundup_power2_divisions:4", "backend:native"]), max_size=3)


@settings(max_examples=200, deadline=None)
@given(before=OTHER_SETTINGS, after=OTHER_SETTINGS, value=st.sampled_from(["True", "False", "true", "1"]),
       variable=st.sampled_from(ALLOC_CONF_VARIABLES), spaces=st.booleans())
def test_expandable_exactly_where_torch_reads_expandable_segments_true(before, after, value, variable, spaces):
    sep = ", " if spaces else ","
    conf = sep.join([*before, f"expandable_segments:{value}", *after])
    assert allocator_settings(conf)["expandable_segments"] == value
    assert allocator_kind({variable: conf}) == ("expandable" if value == "True" else "caching")


def test_the_cuda_variable_wins_over_the_generic_one_as_in_torch():
    """c10/cuda/CUDAAllocatorConfig.h reads PYTORCH_CUDA_ALLOC_CONF first, PYTORCH_ALLOC_CONF only where it is unset."""
    expandable, plain = "expandable_segments:True", "max_split_size_mb:256"
    assert allocator_kind({}) == "caching"
    assert allocator_kind({"PYTORCH_ALLOC_CONF": expandable}) == "expandable"
    assert allocator_kind({"PYTORCH_CUDA_ALLOC_CONF": plain, "PYTORCH_ALLOC_CONF": expandable}) == "caching"
    assert allocator_kind({"PYTORCH_CUDA_ALLOC_CONF": expandable, "PYTORCH_ALLOC_CONF": plain}) == "expandable"


GIBS = st.floats(min_value=0.0, max_value=200.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(needed=GIBS, overhead=st.floats(min_value=0.0, max_value=2.0), device=st.floats(min_value=8.0, max_value=192.0))
def test_the_reserve_holds_the_need_and_stays_within_the_device(needed, overhead, device):
    needed = max(needed, overhead)  # the need includes the overhead
    kw = {"overhead_bytes": overhead * GIB, "device_bytes": device * GIB}
    caching = reserved_bytes(needed * GIB, allocator="caching", **kw)
    expandable = reserved_bytes(needed * GIB, allocator="expandable", **kw)
    assert expandable == pytest.approx(needed * GIB)
    assert caching >= expandable * (1 - 1e-12)
    assert caching <= max(needed, device) * GIB * (1 + 1e-12)  # freed cached blocks before any out-of-memory
    inside = (needed - overhead) * GIB
    if inside / (1 - CACHING_FRAGMENTATION_FRACTION) + overhead * GIB <= device * GIB:  # room: the full reserve
        assert (caching - overhead * GIB) == pytest.approx(inside / (1 - CACHING_FRAGMENTATION_FRACTION))
        if inside > 0:
            assert 1 - inside / (caching - overhead * GIB) == pytest.approx(CACHING_FRAGMENTATION_FRACTION)


@settings(max_examples=200, deadline=None)
@given(a=GIBS, b=GIBS, device=st.floats(min_value=8.0, max_value=192.0))
def test_more_need_never_shows_less(a, b, device):
    lo, hi = sorted((a + 1.0, b + 1.0))
    kw = {"overhead_bytes": 1.0 * GIB, "device_bytes": device * GIB, "allocator": "caching"}
    assert reserved_bytes(lo * GIB, **kw) <= reserved_bytes(hi * GIB, **kw) * (1 + 1e-12)


def test_an_unknown_allocator_names_the_field_and_the_valid_kinds():
    with pytest.raises(SpecError, match=r"field 'allocator'.*'slab'.*caching, expandable"):
        reserved_bytes(GIB, overhead_bytes=0.0, device_bytes=80 * GIB, allocator="slab")


# --- tangram-launch estimate -------------------------------------------------------------------------------------
def _estimate(tmp_path, capsys, monkeypatch, *extra: str, env: dict | None = None) -> dict:
    for name in ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "c.yaml"
    ClusterSpec.from_dict({"name": "h100x8", "nodes": [{"name": "n0", "gpu": "h100-sxm", "count": 8}]}).dump(path)
    rc = main(["estimate", "--cluster", str(path), "--model", "llama3-8b", "--dp", "8", "--zero", "3",
               "--recompute", "full", "--global-batch", "16", "--seq-len", "4096", "--dtype", "bf16",
               "--format", "json", *extra])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"]
    return out


def test_estimate_shows_the_caching_reserve_and_judges_the_fit_on_the_need(tmp_path, capsys, monkeypatch):
    out = _estimate(tmp_path, capsys, monkeypatch)
    stage = out["stages"][0]
    overhead = stage["breakdown"]["overhead_bytes"] / GIB
    assert out["allocator"] == "caching"
    assert stage["reserved_memory_gib"] - overhead == pytest.approx(
        (stage["peak_memory_gib"] - overhead) / (1 - CACHING_FRAGMENTATION_FRACTION))


def test_estimate_reads_expandable_segments_from_the_environment(tmp_path, capsys, monkeypatch):
    out = _estimate(tmp_path, capsys, monkeypatch, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert out["allocator"] == "expandable"
    assert out["stages"][0]["reserved_memory_gib"] == pytest.approx(out["stages"][0]["peak_memory_gib"])
    flag = _estimate(tmp_path, capsys, monkeypatch, "--allocator", "caching",
                     env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert flag["allocator"] == "caching"
    assert flag["stages"][0]["reserved_memory_gib"] > out["stages"][0]["peak_memory_gib"]


def test_estimate_table_names_the_allocator(tmp_path, capsys, monkeypatch):
    for name in ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "c.yaml"
    ClusterSpec.from_dict({"name": "h100x8", "nodes": [{"name": "n0", "gpu": "h100-sxm", "count": 8}]}).dump(path)
    assert main(["estimate", "--cluster", str(path), "--model", "llama3-8b", "--dp", "8", "--zero", "3",
                 "--global-batch", "16", "--seq-len", "4096", "--dtype", "bf16"]) == 0
    assert "shown in use (caching allocator)" in capsys.readouterr().out

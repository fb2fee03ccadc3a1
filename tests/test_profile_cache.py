"""The profile cache is trusted by its seal, not its file name: an edited or moved cache file is not reused."""
from __future__ import annotations

import logging
from pathlib import Path

from tangram_launch.launch import planning as planned, profile_cache, torchrun as launch
from tangram_launch.specs.cluster import ClusterSpec

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "examples" / "clusters" / "profiled-cpu-2.yaml"  # a quick profile of 2 CPU devices


def _cached(tmp_path: Path, key_hex: str) -> Path:
    path = tmp_path / "profiles" / f"{key_hex}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(SRC.read_text())
    profile_cache.seal(str(path), "sha256:" + key_hex, ClusterSpec.load(path).fingerprint)
    return path


def _get(tmp_path: Path, key_hex: str):
    return planned.cached_profile(str(tmp_path), "sha256:" + key_hex, nproc_per_node=2, need_full=False)


def test_an_edited_cache_file_with_another_fingerprint_is_not_reused(tmp_path, caplog):
    path = _cached(tmp_path, "ab" * 16)
    assert _get(tmp_path, "ab" * 16).num_gpus == 2
    text = path.read_text()
    fp = ClusterSpec.load(path).fingerprint
    assert fp and fp in text
    path.write_text(text.replace(fp, "sha256:" + "ee" * 32))
    with caplog.at_level(logging.WARNING, logger="tangram_launch"):
        assert _get(tmp_path, "ab" * 16) is None
    assert "the file changed after it was cached" in caplog.text and "profiling again" in caplog.text


def test_an_edited_figure_a_copy_under_another_key_or_no_seal_is_not_reused(tmp_path, caplog):
    path = _cached(tmp_path, "ab" * 16)
    path.write_text(path.read_text() + "\n")  # same content to YAML, other bytes
    assert _get(tmp_path, "ab" * 16) is None
    other = _cached(tmp_path, "cd" * 16)
    (tmp_path / "profiles" / ("ef" * 16 + ".yaml")).write_bytes(other.read_bytes())
    (tmp_path / "profiles" / ("ef" * 16 + ".yaml.seal")).write_bytes((Path(str(other) + ".seal")).read_bytes())
    with caplog.at_level(logging.WARNING, logger="tangram_launch"):
        assert _get(tmp_path, "ef" * 16) is None
    assert f"cached for hardware fingerprint sha256:{'cd' * 16}" in caplog.text
    (tmp_path / "profiles" / ("cd" * 16 + ".yaml.seal")).unlink()
    assert _get(tmp_path, "cd" * 16) is None


def test_reprofile_is_an_option_that_asks_for_planning():
    args = launch.build_parser().parse_args(["--reprofile", "--model", "tiny", "train.py"])
    opts = launch.TangramOptions.from_args(args)
    assert opts.reprofile and "reprofile" in opts.planning_given()

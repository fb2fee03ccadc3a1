"""``profile --model``'s shape options are checked before any worker starts: exit 2, the field, the value."""
from __future__ import annotations

import pytest

from tangram_launch.cli import main


@pytest.mark.parametrize("args, field", [
    (["--micro-batch", "0"], "--micro-batch"),
    (["--micro-batch", "1,x"], "--micro-batch"),
    (["--seq-len", "65"], "--seq-len"),  # tiny has 64 learned positions
    (["--tp", "3"], "--tp"),  # tiny has 4 heads
    (["--tp", "0"], "--tp"),
    (["--layer-budget-s", "0"], "--layer-budget-s"),
])
def test_a_bad_shape_option_is_refused_naming_it(tmp_path, capsys, args, field):
    assert main(["profile", "--standalone", "--nproc-per-node", "1", "--model", "tiny", *args,
                 "-o", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert field in err and args[1] in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written

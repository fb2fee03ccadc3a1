"""parse_yaml keeps what it parsed (specs/limits.py _ParsedTexts): a kept text answers as a first parse does."""
from __future__ import annotations

import datetime

import pytest

from tangram_launch.errors import SpecError
from tangram_launch.specs.limits import parse_yaml

TEXT = "a: &shared [1, 2.5, {b: x}]\nc: *shared\nd: 2024-01-02\ne: !!set {p, q}\n"


def test_a_kept_text_gives_a_fresh_equal_copy_each_time():
    first = parse_yaml(TEXT, source="one.yaml")
    first["a"][2]["b"] = "changed by a caller"
    first["e"].add("r")
    second = parse_yaml(TEXT, source="two.yaml")
    third = parse_yaml(TEXT, source="two.yaml")
    assert second == third == {"a": [1, 2.5, {"b": "x"}], "c": [1, 2.5, {"b": "x"}],
                               "d": datetime.date(2024, 1, 2), "e": {"p", "q"}}
    assert second is not third and second["a"] is not third["a"]
    assert second["a"] is second["c"]  # an alias's value shared, as the first parse shares it


@pytest.mark.parametrize("text", ["a: [1, 2\n", "a: 1\na: 2\nb: {c: 1, d: [\n", "x: !!python/object:os.system 1\n"])
def test_a_text_that_fails_fails_again_naming_each_source(text):
    messages = []
    for source in ("first.yaml", "second.yaml"):
        with pytest.raises(SpecError) as info:
            parse_yaml(text, source=source)
        messages.append(str(info.value))
    assert messages[0].startswith("first.yaml: ") and messages[1].startswith("second.yaml: ")
    assert messages[0][len("first.yaml"):] == messages[1][len("second.yaml"):]

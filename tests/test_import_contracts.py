"""The layering is enforced: the import-linter contracts in .importlinter (layers from specs to the CLI, the planner
never imports a runtime, adapters never import the planner or cost model, no cycles) hold for every import, the
function-level (lazy) ones included."""
from __future__ import annotations

import logging
import os

import grimp
import pytest

importlinter_cli = pytest.importorskip("importlinter.cli")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, ".importlinter")


def test_import_contracts_hold(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(REPO)
    # import-linter configures logging with dictConfig, which disables every logger that exists already (ours
    # included): later tests in this process would see no log records. Put their state back afterwards.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = [lg.disabled for lg in loggers]
    try:
        assert importlinter_cli.lint_imports(config_filename=CONFIG, no_cache=True) == 0  # 0: every contract kept
    finally:
        for lg, was in zip(loggers, disabled):
            lg.disabled = was


def test_lazy_imports_are_in_the_graph_the_contracts_check(monkeypatch):
    """grimp reads imports inside functions too: the CLI imports the launcher only inside main(), and the graph
    still has that edge, so a lazy import upwards would break the layers contract."""
    monkeypatch.syspath_prepend(REPO)
    graph = grimp.build_graph("tangram_launch", exclude_type_checking_imports=True)
    assert "tangram_launch.launch.torchrun" in graph.find_modules_directly_imported_by("tangram_launch.cli")
    # and `if TYPE_CHECKING:` imports, which never run, are the only ones left out
    assert "tangram_launch.launch.torchrun" not in graph.find_modules_directly_imported_by(
        "tangram_launch.launch.planning")


def test_contracts_name_the_layers_the_design_asks_for():
    with open(CONFIG, encoding="utf-8") as f:
        text = f.read()
    for needle in ("type = layers", "tangram_launch.cli", "tangram_launch.specs", "type = forbidden",
                   "type = acyclic_siblings", "exclude_type_checking_imports = True"):
        assert needle in text

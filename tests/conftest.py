"""Shared test fixtures: paths to the repository's example files."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
CLUSTERS = os.path.join(EXAMPLES, "clusters")

if REPO not in sys.path:  # tests import helpers (tests/helpers_*.py) as modules
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cluster_path():
    def get(name: str) -> str:
        return os.path.join(CLUSTERS, f"{name}.yaml")

    return get


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs (e.g. the long fuzz run of test_bad_inputs.py)")

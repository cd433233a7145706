"""The suite's isolation (offline, a throwaway HF_HOME) and its tiers: every test is marked
`unit`, `integration` or `e2e` from the folder it lives in (tests/unit, tests/integration, tests/e2e),
so `-m unit` and `-m "not e2e"` select what `make test-fast` and friends run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
TIERS = ("unit", "integration", "e2e")

# Hub and module caches of every test live in a throwaway directory; nothing reaches the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# One thread per test process and per process a test starts: the models are tiny, so a second
# thread only spin-waits, and CI runs several test processes on two cores side by side (a sampled
# decode: 0.65 s of CPU with two threads, 0.02 s with one, on a busy machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _isolated_hf_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf_home"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(item.fspath).resolve().relative_to(TESTS.resolve()).parts
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))

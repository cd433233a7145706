"""`dflash2 train` from features streamed by a (fake) vLLM server that computes the tiny target's
real hidden states: the logged losses equal in-process capture's, the training processes hold the
target's embedding and LM head only, and a training killed with SIGKILL resumes asking only the
samples it had not trained on, with the uninterrupted run's losses. tests/e2e/engines repeats the
equality and the resume against a real vLLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.fake_vllm_features import FakeFeatureServer
from trainer.commands import train
from trainer.models.target import FrozenTarget

REPO = Path(__file__).resolve().parents[2]


def target_hidden_of(target: FrozenTarget, layer_ids: list[int]):
    """What vLLM's extract_hidden_states writes for `ids`: the outputs of the draft's layers
    (transformers' hidden_states[id + 1]), sorted, as [tokens, layers, H]."""
    engine_ids = sorted({layer_id + 1 for layer_id in layer_ids})

    def hidden_of(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            output = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        return torch.stack([output.hidden_states[index][0] for index in engine_ids], dim=1)

    return hidden_of


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    recipe = write_tiny_run(root, max_steps=6, save_steps=3)
    target = FrozenTarget.load(str(root / "target"))
    layer_ids = json.loads((root / "draft.json").read_text())["dflash_config"]["target_layer_ids"]
    return root, recipe, target, layer_ids


def losses(output: Path) -> list[tuple[int, str, float]]:
    state = json.loads((output / "trainer_state.json").read_text())
    return [
        (entry["step"], key, entry[key])
        for entry in state["log_history"]
        for key in ("loss", "eval_loss")
        if key in entry
    ]


def streamed_recipe(root: Path, recipe: Path, name: str, server: FakeFeatureServer, **keys) -> Path:
    values = yaml.safe_load(recipe.read_text())
    values.update(
        output_dir=str(root / name),
        feature_endpoint=[server.url],
        feature_storage_path=str(server.storage),
        **{"feature_prefetch": 2, **keys},
    )
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_streamed_training_logs_the_losses_of_in_process_capture(tiny, tmp_path: Path, caplog):
    _, recipe, target, layer_ids = tiny
    local = yaml.safe_load(recipe.read_text())
    local["output_dir"] = str(tmp_path / "in-process")
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(local))
    train.main([str(tmp_path / "local.yaml")])
    storage = tmp_path / "storage"
    storage.mkdir()
    with FakeFeatureServer(storage, 2, target.hidden_size, hidden_of=target_hidden_of(target, layer_ids)) as server:
        streamed = streamed_recipe(tmp_path, recipe, "streamed", server)
        with caplog.at_level("INFO"):
            train.main([str(streamed)])
    reference, got = losses(tmp_path / "in-process"), losses(tmp_path / "streamed")
    assert [entry[:2] for entry in got] == [entry[:2] for entry in reference]  # every train and eval loss
    assert [entry[2] for entry in got] == pytest.approx([entry[2] for entry in reference], rel=1e-5, abs=1e-6)
    assert "Streaming target features from" in caplog.text
    assert sorted(path.name for path in storage.iterdir()) == []  # every server file read and removed


def test_a_streamed_training_killed_with_sigkill_resumes_with_only_the_samples_it_lacks(tiny, tmp_path: Path):
    _, recipe, target, layer_ids = tiny
    storage = tmp_path / "storage"
    storage.mkdir()
    hidden_of = target_hidden_of(target, layer_ids)
    # one loader process: micro-batches are asked strictly in training order (the two samples of each at once)
    whole = {"num_eval_samples": 0, "eval_strategy": "no", "feature_prefetch": 1}
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    with FakeFeatureServer(storage, 2, target.hidden_size, hidden_of=hidden_of) as server:
        uninterrupted = streamed_recipe(tmp_path, recipe, "whole", server, **whole)
        train.main([str(uninterrupted)])
        asked_by_whole = list(server.samples)
    # steps 1-3 use six samples; the window and the loader's own one ahead, four more: the eleventh waits
    with FakeFeatureServer(storage, 2, target.hidden_size, hidden_of=hidden_of, hold_after=10) as server:
        killed = streamed_recipe(tmp_path, recipe, "killed", server, **whole)
        process = subprocess.Popen(
            [sys.executable, "-m", "trainer", "train", str(killed)],
            cwd=REPO,
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        checkpoint = tmp_path / "killed" / "checkpoint-3" / "trainer_state.json"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (checkpoint.exists() and server.holding.is_set()):
            assert process.poll() is None, "the run ended before it was killed"
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
        server.release.set()
    assert checkpoint.exists() and not (tmp_path / "killed" / "checkpoint-6").exists()
    with FakeFeatureServer(storage, 2, target.hidden_size, hidden_of=hidden_of) as server:
        resumed = streamed_recipe(tmp_path, recipe, "killed", server, **whole)
        train.main([str(resumed), "--resume_from_checkpoint", "true"])
        asked_by_resumed = set(server.samples)
    steps_4_to_6 = [entry for entry in losses(tmp_path / "whole") if entry[0] > 3]
    assert [entry for entry in losses(tmp_path / "killed") if entry[0] > 3] == steps_4_to_6  # bit for bit
    # steps 1-3 trained on the first six samples asked, steps 4-6 on the next six: the resumed run asks
    # the latter and never the former
    assert len(set(asked_by_whole[:12])) == 12
    assert set(asked_by_whole[6:12]) <= asked_by_resumed
    assert not set(asked_by_whole[:6]) & asked_by_resumed


def test_a_head_only_target_reuses_cached_answers_and_refuses_to_generate(tiny, tmp_path: Path):
    """A streamed run answers no prompt itself: answers cached by the whole target (a `prepare
    --regenerate-only` where it fits) are reused under the same key; without them, one line."""
    from trainer.data.regeneration import GenerationSettings, prompt_conversation, regenerate
    from trainer.models.target_head import TargetHead

    root, _, target, _ = tiny
    head = TargetHead.load(str(root / "target"))
    conversations = [prompt_conversation("hello how are you"), prompt_conversation("tell me about the weather")]
    settings = GenerationSettings(max_new_tokens=3, batch_size=2)
    with pytest.raises(ValueError, match="regenerating in process needs the whole target") as error:
        regenerate(head, conversations, settings, tmp_path / "cache", "prompts")
    assert "\n" not in str(error.value) and str(error.value).startswith("prompts: ")
    answered = regenerate(target, conversations, settings, tmp_path / "cache", "prompts")
    reused = regenerate(head, conversations, settings, tmp_path / "cache", "prompts")
    assert reused["input_ids"] == answered["input_ids"]


def test_two_ranks_each_stream_their_own_samples_with_the_losses_of_in_process_capture(tiny, tmp_path: Path):
    """DDP on two CPU ranks: each rank's loader processes ask only that rank's micro-batches (no
    sample asked twice), and the logged losses are in-process capture's."""
    from tests.e2e.test_distributed import logged_losses, torchrun

    _, recipe, target, layer_ids = tiny
    alone = {"num_eval_samples": 0, "eval_strategy": "no", "max_steps": 4}
    local = {**yaml.safe_load(recipe.read_text()), **alone, "output_dir": str(tmp_path / "in-process")}
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(local))
    torchrun("-m", "trainer", "train", str(tmp_path / "local.yaml"), cwd=tmp_path)
    storage = tmp_path / "storage"
    storage.mkdir()
    with FakeFeatureServer(storage, 2, target.hidden_size, hidden_of=target_hidden_of(target, layer_ids)) as server:
        streamed = streamed_recipe(tmp_path, recipe, "streamed", server, **alone)
        torchrun("-m", "trainer", "train", str(streamed), cwd=tmp_path)
    assert len(server.samples) == len(set(server.samples)) >= 4 * 2 * 2  # steps x ranks x micro-batch
    reference, got = (
        logged_losses(json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"])
        for name in ("in-process", "streamed")
    )
    assert [key for key, _ in got] == [key for key, _ in reference]
    assert [value for _, value in got] == pytest.approx([value for _, value in reference], rel=1e-5)


def test_prepare_of_a_streamed_recipe_tokenizes_and_asks_no_server(tiny, tmp_path: Path, capsys):
    """Nothing is stored for a streamed run: `dflash2 prepare` builds its token samples and says the
    features come while training (the endpoint, never contacted, may be down)."""
    from trainer.commands import prepare

    _, recipe, _, _ = tiny
    values = yaml.safe_load(recipe.read_text())
    values.update(
        feature_endpoint=["http://127.0.0.1:9/v1"], feature_storage_path=str(tmp_path), cache_dir=str(tmp_path / "c")
    )
    (tmp_path / "streamed.yaml").write_text(yaml.safe_dump(values))
    prepare.main([str(tmp_path / "streamed.yaml")])
    assert "features are streamed from feature_endpoint while training (offline: false)" in capsys.readouterr().out
    assert not (tmp_path / "c" / "features").exists()

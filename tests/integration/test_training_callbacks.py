"""trainer.training.callbacks: every callback a run asks for is registered, and works in a real run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Trainer

from modeling_dflash2 import DFlash2DraftModel
from tests.support.tiny_target import tiny_chat_dataset, tiny_draft_config_for, tiny_target
from trainer.data.dataset import DFlashCollator
from trainer.evaluation.report import SpeculativeEvalCallback
from trainer.training import callbacks
from trainer.training.arguments import DFlashTrainingArguments
from trainer.training.callbacks import PushExportOnSaveCallback, ResumedLearningRateCallback, expected_callbacks
from trainer.training.checkpoints import checkpoint_problems
from trainer.training.preemption import PreemptionCallback
from trainer.training.trainer import DFlash2Trainer


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def dataset(target):
    return tiny_chat_dataset(target, 12, seed=5)


def make_trainer(target, dataset, output_dir: Path, **overrides) -> DFlash2Trainer:
    values = {
        "output_dir": str(output_dir),
        "max_steps": 4,
        "per_device_train_batch_size": 2,
        "learning_rate": 5e-3,
        "save_strategy": "no",
        "num_anchors": 6,
        "report_to": [],
        "use_cpu": True,
        "dataloader_num_workers": 0,
        **overrides,
    }
    torch.manual_seed(0)
    return DFlash2Trainer(
        model=DFlash2DraftModel(tiny_draft_config_for(target)),
        args=DFlashTrainingArguments(**values),
        target=target,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(2)),
        data_collator=DFlashCollator(target.tokenizer.pad_token_id),
    )


def registered(trainer: DFlash2Trainer) -> list[type]:
    ours = (PreemptionCallback, ResumedLearningRateCallback, PushExportOnSaveCallback, SpeculativeEvalCallback)
    return [type(callback) for callback in trainer.callback_handler.callbacks if isinstance(callback, ours)]


def test_every_callback_the_arguments_ask_for_is_registered_once(target, dataset, tmp_path, monkeypatch):
    plain = make_trainer(target, dataset, tmp_path / "plain")
    assert registered(plain) == expected_callbacks(plain) == [PreemptionCallback, ResumedLearningRateCallback]
    assert any(callback is plain.preemption for callback in plain.callback_handler.callbacks)  # train() installs it
    monkeypatch.setattr(Trainer, "init_hf_repo", lambda self, token=None: None)  # no Hub
    asks = {"push_to_hub": True, "hub_model_id": "org/never-pushed", "hub_strategy": "every_save"}
    full = make_trainer(target, dataset, tmp_path / "full", spec_eval_prompts=1, **asks)
    everything = [PreemptionCallback, ResumedLearningRateCallback, PushExportOnSaveCallback, SpeculativeEvalCallback]
    assert registered(full) == expected_callbacks(full) == everything
    end_only = make_trainer(target, dataset, tmp_path / "end", **{**asks, "hub_strategy": "end"})
    assert PushExportOnSaveCallback not in registered(end_only)


def test_each_save_is_staged_published_whole_and_pushed_as_an_export(target, dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "init_hf_repo", lambda self, token=None: None)  # no Hub
    pushed: list[tuple[int, str]] = []

    def export_and_publish(trainer, folder, commit_message):
        pushed.append((trainer.state.global_step, commit_message))

    monkeypatch.setattr(callbacks, "export_and_publish", export_and_publish)
    output = tmp_path / "run"
    trainer = make_trainer(
        target,
        dataset,
        output,
        save_strategy="steps",
        save_steps=2,
        push_to_hub=True,
        hub_model_id="org/never-pushed",
        hub_strategy="every_save",
    )
    trainer.train()
    assert pushed == [(2, "Checkpoint at step 2"), (4, "Checkpoint at step 4")]
    assert sorted(path.name for path in output.iterdir()) == ["checkpoint-2", "checkpoint-4"]  # nothing staged left
    assert all(checkpoint_problems(output / f"checkpoint-{step}") == [] for step in (2, 4))
    assert trainer.checkpointing.staging is None and trainer.last_checkpoint == output / "checkpoint-4"

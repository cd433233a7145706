"""DFlash2Trainer on a tiny target: exact GA, pooled logs, draft-only checkpoints, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from modeling_dflash2 import DFlash2DraftModel
from tests.tiny_target import tiny_chat_dataset, tiny_draft_config_for, tiny_target
from trainer.arguments import DFlashTrainingArguments
from trainer.data import DFlashCollator
from trainer.feature_store import OfflineDataset, prepare_features
from trainer.trainer import DFlash2Trainer

CHECKPOINT_FILES = {
    "config.json",
    "model.safetensors",
    "configuration_dflash2.py",
    "modeling_dflash2.py",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
    "training_args.bin",
    "dflash2_recipe.json",
    "dflash2_checkpoint.json",
}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def dataset(target):
    return tiny_chat_dataset(target, 24, seed=3)


def make_trainer(target, dataset, output_dir, seed=0, eval_dataset=None, **overrides) -> DFlash2Trainer:
    values = {
        "output_dir": str(output_dir),
        "max_steps": 4,
        "per_device_train_batch_size": 2,
        "learning_rate": 5e-3,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "num_anchors": 6,
        "report_to": [],
        "use_cpu": True,
        "seed": seed,
        "data_seed": seed,
        "dataloader_num_workers": 0,
    }
    values.update(overrides)
    torch.manual_seed(seed)
    draft = DFlash2DraftModel(tiny_draft_config_for(target))
    return DFlash2Trainer(
        model=draft,
        args=DFlashTrainingArguments(**values),
        target=target,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        data_collator=DFlashCollator(target.tokenizer.pad_token_id),
    )


def _weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_gradient_accumulation_is_exact(target, dataset, tmp_path):
    """GA=2 of batch 1 gives the same update as GA=1 of batch 2 (SGD: the update is the gradient)."""
    common = {"max_steps": 1, "optim": "sgd", "learning_rate": 1.0, "max_grad_norm": 0.0}
    one = make_trainer(target, dataset, tmp_path / "one", per_device_train_batch_size=2, **common)
    one.train()
    two = make_trainer(
        target, dataset, tmp_path / "two", per_device_train_batch_size=1, gradient_accumulation_steps=2, **common
    )
    two.train()
    first, second = _weights(one.model), _weights(two.model)
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=1e-5, atol=1e-6, msg=name)
    assert one.state.log_history[0]["loss"] == pytest.approx(two.state.log_history[0]["loss"], rel=1e-5)


def test_logs_carry_pooled_metrics_in_training_and_evaluation(target, dataset, tmp_path):
    trainer = make_trainer(
        target,
        dataset,
        tmp_path,
        eval_dataset=dataset.select(range(4)),
        eval_strategy="steps",
        eval_steps=2,
        selector_warmup_ratio=0.5,
    )
    trainer.train()
    train_logs = [log for log in trainer.state.log_history if "loss" in log and "eval_loss" not in log]
    eval_logs = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert len(train_logs) == 4 and len(eval_logs) == 2
    for name in ("accuracy", "tau_unary", "tau_walk", "coverage", "loss_selector", "accuracy_position_3"):
        assert name in train_logs[-1], name
        assert f"eval_{name}" in eval_logs[-1], name
    assert [log["selector_alpha"] for log in train_logs] == [0.0, 0.0, 1.0, 1.0]
    assert eval_logs[-1]["eval_tau_walk"] >= 1.0


def test_frozen_target_stays_out_of_the_optimizer(target, dataset, tmp_path):
    trainer = make_trainer(target, dataset, tmp_path, max_steps=1)
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainer.model.parameters()}
    assert not any(p.requires_grad or id(p) in optimized for p in target.model.parameters())


def test_selector_alpha_zero_freezes_the_selector(target, dataset, tmp_path):
    trainer = make_trainer(target, dataset, tmp_path, max_steps=1, selector_alpha=0.0)
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in optimized for p in trainer.model.candidate_selector.parameters())


def test_every_checkpoint_holds_only_the_draft(target, dataset, tmp_path):
    trainer = make_trainer(target, dataset, tmp_path, save_strategy="steps", save_steps=2)
    trainer.train()
    trainer.save_model()
    for directory in (tmp_path / "checkpoint-2", tmp_path / "checkpoint-4"):
        assert {p.name for p in directory.iterdir()} == CHECKPOINT_FILES
    final = {p.name for p in tmp_path.iterdir() if p.is_file()}
    assert final == {
        "config.json",
        "model.safetensors",
        "configuration_dflash2.py",
        "modeling_dflash2.py",
        "training_args.bin",
        "dflash2_recipe.json",
    }
    for directory in (tmp_path, tmp_path / "checkpoint-4"):
        config = json.loads((directory / "config.json").read_text())
        assert config["auto_map"] == {
            "AutoConfig": "configuration_dflash2.DFlash2Config",
            "AutoModel": "modeling_dflash2.DFlash2DraftModel",
        }
        assert config["architectures"] == ["DFlash2DraftModel"]
    reloaded = DFlash2DraftModel.from_pretrained(tmp_path)
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


def _losses(trainer) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log and "eval_loss" not in log]


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def test_resume_from_checkpoint_is_exact(target, dataset, tmp_path):
    """6 steps straight == 3 steps, stop, resume from checkpoint-3, 3 more (same recipe)."""
    straight = make_trainer(target, dataset, tmp_path / "straight", max_steps=6)
    straight.train()
    first = make_trainer(target, dataset, tmp_path / "resumed", max_steps=6, save_strategy="steps", save_steps=3)
    first.add_callback(StopAt(3))
    first.train()
    assert first.state.global_step == 3 and (tmp_path / "resumed" / "checkpoint-3").is_dir()
    resumed = make_trainer(target, dataset, tmp_path / "resumed", max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-3"))
    got = _losses(resumed)  # the log history of steps 1-3 comes back with the checkpoint
    assert len(got) == 6 and got[:3] == _losses(first)
    assert got == pytest.approx(_losses(straight), rel=1e-6, abs=1e-6)
    final_straight, final_resumed = _weights(straight.model), _weights(resumed.model)
    for name in final_straight:
        torch.testing.assert_close(final_straight[name], final_resumed[name], rtol=1e-6, atol=1e-7, msg=name)


def test_offline_features_train_like_the_online_target(target, dataset, tmp_path):
    features = prepare_features(target, dataset, [1, 2], tmp_path / "cache")
    online = make_trainer(target, dataset, tmp_path / "online", max_steps=2)
    online.train()
    offline = make_trainer(target, OfflineDataset(dataset, features), tmp_path / "offline", max_steps=2)
    offline.train()
    assert _losses(offline) == pytest.approx(_losses(online), rel=1e-6)


def test_distillation_trains_alike_online_and_offline_and_differs_from_cross_entropy(target, dataset, tmp_path):
    """kd_weight > 0: online, the target runs to its final norm; offline, the store holds the final
    states. Both give the same losses, which are not the cross-entropy recipe's."""
    features = prepare_features(target, dataset, [1, 2], tmp_path / "cache", final_hidden=True)
    settings = {"max_steps": 2, "kd_weight": 0.5, "kd_temperature": 2.0}
    online = make_trainer(target, dataset, tmp_path / "online", **settings)
    online.train()
    offline = make_trainer(target, OfflineDataset(dataset, features), tmp_path / "offline", **settings)
    offline.train()
    assert _losses(offline) == pytest.approx(_losses(online), rel=1e-6)
    assert all(entry["kd_divergence"] > 0 for entry in online.state.log_history if "loss" in entry)
    plain = make_trainer(target, dataset, tmp_path / "plain", max_steps=2)
    plain.train()
    assert _losses(plain) != pytest.approx(_losses(online), rel=1e-3)
    without = OfflineDataset(dataset, prepare_features(target, dataset, [1, 2], tmp_path / "cache"))
    with pytest.raises(ValueError, match="no target final hidden states"):
        make_trainer(target, without, tmp_path / "without", **settings).train()


def test_checkpoint_loads_through_automodel(target, dataset, tmp_path):
    from transformers import AutoModel

    trainer = make_trainer(target, dataset, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    loaded = AutoModel.from_pretrained(Path(tmp_path), trust_remote_code=True)
    assert type(loaded).__name__ == "DFlash2DraftModel"

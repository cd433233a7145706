"""DFlash2Trainer on a tiny target: exact GA, pooled logs, draft-only checkpoints, exact resume."""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import math
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from safetensors.torch import load_file
from transformers import Qwen3NextForCausalLM, TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler

from modeling_dflash2 import DFlash2DraftModel
from modeling_dflash2.checkpoint_dflash2 import REMOTE_CODE_FILES
from tests.support.tiny_target import (
    tiny_chat_dataset,
    tiny_draft_config_for,
    tiny_hybrid_config,
    tiny_target,
    tiny_tokenizer,
)
from trainer.data.dataset import DFlashCollator
from trainer.data.feature_store import OfflineDataset, prepare_features
from trainer.data.packing import PackedDataset
from trainer.fileio import DiskFullError
from trainer.models.target import FrozenTarget
from trainer.training import checkpointing
from trainer.training.arguments import DFlashTrainingArguments
from trainer.training.checkpoints import checkpoint_problems
from trainer.training.exports import draft_for_export
from trainer.training.trainer import DFlash2Trainer

CHECKPOINT_FILES = {
    "config.json",
    "model.safetensors",
    *REMOTE_CODE_FILES,
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
        *REMOTE_CODE_FILES,
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


# -- non-finite steps, non-finite weights and full disks: never a bad or partial checkpoint ---------


def poison_gradients(trainer: DFlash2Trainer, steps: set[int]) -> None:
    """The loss of each listed step stays finite but its gradients become NaN (what a learning rate
    of 10000 does to the tiny run at step 4)."""
    real = trainer.compute_loss

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = real(model, inputs, return_outputs, num_items_in_batch)
        if model.training and trainer.state.global_step + 1 in steps:
            loss = loss + (loss * float("nan") - loss.detach() * float("nan"))  # finite value, NaN gradient
        return loss

    trainer.compute_loss = compute_loss


def poison_loss(trainer: DFlash2Trainer, steps: set[int]) -> None:
    """The objective of each listed step returns a NaN loss."""
    real = trainer._objective

    def objective(model, draft, inputs):
        result = real(model, draft, inputs)
        if model.training and trainer.state.global_step + 1 in steps:
            result = dataclasses.replace(result, numerator=result.numerator * float("nan"))
        return result

    trainer._objective = objective


def test_a_non_finite_step_at_a_save_step_is_never_saved_and_rotates_nothing_away(target, dataset, tmp_path):
    trainer = make_trainer(
        target, dataset, tmp_path, max_steps=8, save_strategy="steps", save_steps=2, save_total_limit=1
    )
    poison_gradients(trainer, {4})
    with pytest.raises(FloatingPointError) as stopped:
        trainer.train()
    good = tmp_path / "checkpoint-2"
    assert str(stopped.value) == (
        f"non-finite gradient norm (nan) at step 4: no checkpoint saved; the last good checkpoint is {good}"
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["checkpoint-2"]
    assert all(torch.isfinite(p).all() for p in load_file(tmp_path / "checkpoint-2" / "model.safetensors").values())


def test_a_non_finite_loss_stops_the_run_naming_the_step(target, dataset, tmp_path):
    trainer = make_trainer(target, dataset, tmp_path, max_steps=4)
    poison_loss(trainer, {1})
    with pytest.raises(FloatingPointError, match=r"^non-finite loss at step 1: no checkpoint saved; there is no good"):
        trainer.train()


class Snapshots(TrainerCallback):
    """Weights and optimizer state after each step."""

    def __init__(self):
        self.after: dict[int, tuple[dict, dict]] = {}

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.after[state.global_step] = (weights, copy.deepcopy(optimizer.state_dict()))


def _same_state(left: dict, right: dict) -> bool:
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(_same_state(left[k], right[k]) for k in left)
    if isinstance(left, (list, tuple)):
        return len(left) == len(right) and all(_same_state(a, b) for a, b in zip(left, right, strict=True))
    if isinstance(left, torch.Tensor):
        return torch.equal(left, right)
    return left == right


def test_skip_nonfinite_steps_leaves_weights_and_optimizer_untouched_then_stops(target, dataset, tmp_path, caplog):
    trainer = make_trainer(target, dataset, tmp_path, max_steps=6, skip_nonfinite_steps=1, weight_decay=0.1)
    poison_gradients(trainer, {3, 5})
    snapshots = Snapshots()
    trainer.add_callback(snapshots)
    with pytest.raises(FloatingPointError, match=r"^non-finite gradient norm \(nan\) at step 5 after skipping 1 step"):
        trainer.train()
    assert trainer.nonfinite.skipped_steps == [3]
    assert "non-finite gradient norm (nan) at step 3: step skipped" in caplog.text
    (weights_2, optimizer_2), (weights_3, optimizer_3) = snapshots.after[2], snapshots.after[3]
    assert all(torch.equal(weights_2[name], weights_3[name]) for name in weights_2)  # not even weight decay
    assert _same_state(optimizer_2["state"], optimizer_3["state"])  # Adam's moments and step count too
    weights_4 = snapshots.after[4][0]
    assert not all(torch.equal(weights_3[name], weights_4[name]) for name in weights_3)  # step 4 trained
    assert all(torch.isfinite(tensor).all() for tensor in weights_4.values())


class PoisonWeights(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("inf")


def test_non_finite_weights_are_neither_checkpointed_nor_saved(target, dataset, tmp_path):
    trainer = make_trainer(target, dataset, tmp_path, save_strategy="steps", save_steps=2)
    trainer.add_callback(PoisonWeights(4))
    with pytest.raises(FloatingPointError) as stopped:
        trainer.train()
    good = tmp_path / "checkpoint-2"
    assert (
        str(stopped.value) == f"non-finite weights at step 4: no checkpoint saved; the last good checkpoint is {good}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    with pytest.raises(FloatingPointError) as refused:
        trainer.save_model()
    assert str(refused.value) == (
        f"non-finite weights after step 4: the draft was not saved to {tmp_path}; the last good checkpoint is {good}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_a_checkpoint_is_one_line_and_leaves_the_previous_checkpoint(
    target, dataset, tmp_path, monkeypatch
):
    trainer = make_trainer(target, dataset, tmp_path, save_strategy="steps", save_steps=2, save_total_limit=1)
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if "checkpoint-4" in str(path) and str(path).endswith("optimizer.pt"):
            no_space()
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(DiskFullError) as full:
        trainer.train()
    message = str(full.value)
    assert message.startswith(
        f"no space left on device while writing the checkpoint of step 4 {tmp_path / 'checkpoint-4'} ("
    )
    assert message.endswith(
        f" free); the last good checkpoint is {tmp_path / 'checkpoint-2'} (kept; nothing was rotated away)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # the staging folder is gone
    assert checkpoint_problems(tmp_path / "checkpoint-2") == []


def test_a_full_disk_reported_by_safetensors_is_a_full_disk_too(target, dataset, tmp_path, monkeypatch):
    from safetensors import SafetensorError

    trainer = make_trainer(target, dataset, tmp_path, max_steps=2, save_strategy="steps", save_steps=2)

    def save_file(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
    with pytest.raises(DiskFullError, match=r"^no space left on device while writing the checkpoint of step 2 "):
        trainer.train()
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_at_the_final_save_keeps_the_previous_draft(target, dataset, tmp_path, monkeypatch):
    trainer = make_trainer(target, dataset, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    before = (tmp_path / "model.safetensors").read_bytes()
    trainer.train()  # new weights, then a full disk while they are written
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", no_space)
    with pytest.raises(DiskFullError) as full:
        trainer.save_model()
    assert str(full.value).startswith(f"no space left on device while writing the draft of step 1 to {tmp_path} (")
    assert "free); the files there are the previous ones; there is no good checkpoint yet" in str(full.value)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    monkeypatch.setattr(trainer.state, "save_to_json", lambda path: no_space())
    with pytest.raises(DiskFullError, match=r"^no space left on device while writing the trainer state "):
        trainer.save_state()


def test_both_fsdp_paths_take_the_one_full_state_dict_gather(target, dataset, tmp_path, monkeypatch):
    """Under FSDP the draft save and the export both use `checkpointing.full_state_dict` (one collective
    gather): its result, and nothing else, is what they write and export."""
    trainer = make_trainer(target, dataset, tmp_path / "run")
    marked = {name: torch.full_like(value, 0.5) for name, value in trainer.model.state_dict().items()}
    calls = []
    monkeypatch.setattr(trainer, "is_fsdp_enabled", True)
    monkeypatch.setattr(checkpointing, "full_state_dict", lambda model: calls.append("gather") or marked)
    exported = draft_for_export(trainer)
    assert all(torch.equal(value, marked[name]) for name, value in exported.state_dict().items())
    trainer.checkpointing.write_draft(tmp_path / "draft")
    saved = load_file(tmp_path / "draft" / "model.safetensors")
    assert saved and all(torch.all(tensor == 0.5) for tensor in saved.values())
    assert calls == ["gather", "gather"]


def test_packed_rows_train_alike_online_and_offline(target, dataset, tmp_path):
    """Captured on the packed row (online) or stored per sample and concatenated (offline): one loss."""
    features = prepare_features(target, dataset, [1, 2], tmp_path / "cache")
    online = make_trainer(target, PackedDataset.pack(dataset, 48, seed=0), tmp_path / "online", max_steps=3)
    online.train()
    offline_rows = PackedDataset.pack(OfflineDataset(dataset, features), 48, seed=0)
    offline = make_trainer(target, offline_rows, tmp_path / "offline", max_steps=3)
    offline.train()
    assert len(offline_rows) < len(dataset) and offline_rows.rows == online.train_dataset.rows
    assert _losses(offline) == pytest.approx(_losses(online), rel=1e-5)
    unpacked = make_trainer(target, dataset, tmp_path / "unpacked", max_steps=3)
    unpacked.train()
    assert _losses(unpacked) != pytest.approx(_losses(online), rel=1e-3)


def test_group_by_length_groups_by_the_arrow_lengths_without_reading_a_sample(target, dataset, tmp_path, monkeypatch):
    features = prepare_features(target, dataset, [1, 2], tmp_path / "cache")
    offline = OfflineDataset(dataset, features)
    trainer = make_trainer(target, offline, tmp_path / "grouped", train_sampling_strategy="group_by_length")

    def no_reading(self, index):
        raise AssertionError("the sampler read a sample")

    monkeypatch.setattr(OfflineDataset, "__getitem__", no_reading)
    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, LengthGroupedSampler)
    assert sampler.lengths == [len(ids) for ids in dataset["input_ids"]]
    monkeypatch.undo()
    trainer.train()
    assert len(_losses(trainer)) == 4


def test_offline_features_pack_for_a_target_that_would_mix_documents(dataset, tmp_path):
    """Stored features are captured per sample, so packing them needs no packed capture: a hybrid
    (linear-attention) target, refused for online packing, trains packed from its offline store."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = tiny_hybrid_config(len(tokenizer), layers=4, pad_token_id=tokenizer.pad_token_id)
    hybrid = FrozenTarget(Qwen3NextForCausalLM(config), tokenizer)
    with pytest.raises(ValueError, match="lets packed documents see each other"):
        hybrid.check_packing([1, 2])
    features = prepare_features(hybrid, dataset, [1, 2], tmp_path / "cache")
    rows = PackedDataset.pack(OfflineDataset(dataset, features), 48, seed=0)
    trainer = make_trainer(hybrid, rows, tmp_path / "packed", max_steps=2)
    trainer.train()
    assert len(_losses(trainer)) == 2 and all(math.isfinite(loss) for loss in _losses(trainer))

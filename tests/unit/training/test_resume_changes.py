"""Resume refuses a changed run (trainer.training.resume_check): the recorded recipe against the new one,
before any weights load; allowed changes are logged, and an allowed learning rate takes effect."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from tests.support.tiny_target import tiny_chat_dataset, tiny_draft_config_for, tiny_target
from trainer.data.dataset import DFlashCollator
from trainer.training.arguments import DFlashTrainingArguments
from trainer.training.resume_check import (
    IDENTITY_KEY,
    RECIPE_FILE,
    changed_fields,
    check_unchanged,
    dataset_fingerprint,
    target_fingerprint,
)
from trainer.training.trainer import DFlash2Trainer


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def dataset(target):
    return tiny_chat_dataset(target, 24, seed=3)


def make_trainer(target, dataset, output_dir: Path, config: DFlash2Config | None = None, **overrides):
    values = {
        "output_dir": str(output_dir),
        "max_steps": 4,
        "per_device_train_batch_size": 2,
        "learning_rate": 5e-3,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 2,
        "num_anchors": 6,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    values.update(overrides)
    torch.manual_seed(0)
    draft = DFlash2DraftModel(config or tiny_draft_config_for(target))
    return DFlash2Trainer(
        model=draft,
        args=DFlashTrainingArguments(**values),
        target=target,
        train_dataset=dataset,
        data_collator=DFlashCollator(target.tokenizer.pad_token_id),
    )


@pytest.fixture(scope="module")
def trained(target, dataset, tmp_path_factory) -> Path:
    """A run folder holding checkpoint-2 of the base recipe (2 steps)."""
    output = tmp_path_factory.mktemp("trained") / "output"
    make_trainer(target, dataset, output, max_steps=2).train()
    assert (output / "checkpoint-2" / RECIPE_FILE).is_file()
    return output


def copy_run(trained: Path, where: Path) -> Path:
    """A fresh copy of the trained run folder (a resume writes into it)."""
    import shutil

    shutil.copytree(trained, where / "output")
    return where / "output"


def config_with(target, **dflash) -> DFlash2Config:
    config = tiny_draft_config_for(target)
    config.dflash_config.update(dflash)
    return config


class NoWeightsLoaded(AssertionError):
    pass


@pytest.fixture
def no_weight_loading(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise NoWeightsLoaded("weights were loaded before the run was checked")

    monkeypatch.setattr(DFlash2Trainer, "_load_from_checkpoint", refuse)


# -- the comparison itself -------------------------------------------------------------------------


def record(**training) -> dict:
    return {
        "model_arguments": {"target": "/t", "draft_config": "d.json", "target_dtype": "float32", "lora_r": 0},
        "data_arguments": {
            "dataset": "chat.jsonl",
            "max_length": 48,
            "packing": False,
            "cache_dir": "/c",
            "dataset_num_proc": None,
        },
        "training_arguments": {
            "learning_rate": 0.005,
            "num_anchors": 6,
            "loss_type": "ce",
            "logging_dir": "runs/Dec01_10-00-00",
            "output_dir": "/a",
            "save_steps": 2,
            "max_steps": 4,
            "report_to": [],
            "eval_steps": None,
            "dataloader_num_workers": 0,
            **training,
        },
        IDENTITY_KEY: {
            "draft_config": {"block_size": 4, "target_layer_ids": [1, 2], "hidden_size": 32},
            "target": "t1",
            "dataset": "d1",
            "world_size": 1,
        },
    }


def test_only_fields_that_change_the_run_are_listed_old_to_new():
    old = record()
    new = record(
        learning_rate=0.01,
        loss_type="kd",
        logging_dir="runs/Dec02_11-00-00",
        output_dir="/b",
        save_steps=5,
        max_steps=9,
        report_to=["tensorboard"],
        dataloader_num_workers=4,
    )
    new["model_arguments"].update(target="/moved/t", draft_config="other.json")  # same content: fingerprinted
    new["data_arguments"].update(max_length=64, packing=True, cache_dir="/elsewhere", dataset_num_proc=8)
    new[IDENTITY_KEY]["draft_config"].update(block_size=8, target_layer_ids=[1, 3])
    new[IDENTITY_KEY].update(dataset="d2", world_size=2)
    assert changed_fields(old, new) == [
        ("block_size", 4, 8),
        ("target_layer_ids", [1, 2], [1, 3]),
        ("dataset", "d1", "d2"),
        ("max_length", 48, 64),
        ("packing", False, True),
        ("loss_type", "ce", "kd"),
        ("learning_rate", 0.005, 0.01),
        ("world_size", 1, 2),
    ]


def test_a_refusal_is_one_line_naming_each_field_and_allowed_ones_pass(tmp_path, caplog):
    (tmp_path / RECIPE_FILE).write_text(json.dumps(record()))
    new = record(learning_rate=0.01)
    new[IDENTITY_KEY]["target"] = "t2"
    with pytest.raises(ValueError) as refused:
        check_unchanged(tmp_path, new)
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        f"resume from {tmp_path} refused: the run changed target t1 → t2, learning_rate 0.005 → 0.01 "
        "(set resume_allow_changes: [target, learning_rate] to resume anyway, or train into a new output_dir)"
    )
    with pytest.raises(ValueError, match="the run changed target t1 → t2 "):
        check_unchanged(tmp_path, new, allowed=["learning_rate"])
    with caplog.at_level(logging.WARNING):
        assert check_unchanged(tmp_path, new, allowed=["target", "learning_rate"]) == ["target", "learning_rate"]
    assert "learning_rate changed (allowed): 0.005 → 0.01" in caplog.text


def test_an_older_record_is_compared_on_what_it_holds_and_no_record_warns(tmp_path, caplog):
    old = record()
    del old[IDENTITY_KEY]
    (tmp_path / RECIPE_FILE).write_text(json.dumps(old))
    assert check_unchanged(tmp_path, record()) == []
    (tmp_path / RECIPE_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        assert check_unchanged(tmp_path, record(learning_rate=1.0)) == []
    assert f"{tmp_path} has no {RECIPE_FILE}" in caplog.text and "resuming without checking" in caplog.text


def test_fingerprints_are_stable_and_tell_data_and_targets_apart(target, dataset):
    assert dataset_fingerprint(dataset) == dataset_fingerprint(tiny_chat_dataset(target, 24, seed=3))
    assert dataset_fingerprint(dataset) != dataset_fingerprint(tiny_chat_dataset(target, 24, seed=3, max_length=20))
    assert dataset_fingerprint(dataset) != dataset_fingerprint(tiny_chat_dataset(target, 23, seed=3))
    assert target_fingerprint(target) == target_fingerprint(target)
    other = tiny_target()
    with torch.no_grad():
        other.model.get_input_embeddings().weight.mul_(2)
    assert target_fingerprint(other) != target_fingerprint(target)


# -- on resume, before any weights load --------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "listed"),
    [
        ({"config": {"block_size": 8}}, "block_size 4 → 8"),
        ({"config": {"target_layer_ids": [1, 3]}}, "target_layer_ids [1, 2] → [1, 3]"),
        ({"config": {"selector_top_k": 2}}, "selector_top_k 4 → 2"),
        ({"num_anchors": 5}, "num_anchors 6 → 5"),
        ({"loss_type": "kd"}, "loss_type ce → kd"),
        ({"learning_rate": 0.01}, "learning_rate 0.005 → 0.01"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps 1 → 2"),
    ],
    ids=["block_size", "target_layer_ids", "selector_top_k", "num_anchors", "loss_type", "learning_rate", "ga"],
)
def test_a_changed_run_is_refused_before_weights_load(
    target, dataset, trained, tmp_path, no_weight_loading, change, listed
):
    output = copy_run(trained, tmp_path)
    change = dict(change)
    config = config_with(target, **change.pop("config")) if "config" in change else None
    resumed = make_trainer(target, dataset, output, config=config, **change)
    with pytest.raises(ValueError, match="refused") as refused:
        resumed.train(resume_from_checkpoint=True)
    assert str(refused.value).startswith(f"resume from {output / 'checkpoint-2'} refused: the run changed {listed} (")


def test_a_wider_draft_is_refused_with_the_field_not_a_size_mismatch(target, dataset, trained, tmp_path):
    output = copy_run(trained, tmp_path)
    config = tiny_draft_config_for(target)
    config.intermediate_size = 96
    resumed = make_trainer(target, dataset, output, config=config)
    with pytest.raises(ValueError, match="the run changed intermediate_size 64 → 96 "):
        resumed.train(resume_from_checkpoint=str(output / "checkpoint-2"))


def test_the_dataset_is_part_of_the_run(target, trained, tmp_path, no_weight_loading):
    output = copy_run(trained, tmp_path)
    resumed = make_trainer(target, tiny_chat_dataset(target, 24, seed=4), output)
    with pytest.raises(ValueError, match=r"the run changed dataset \w+ → \w+ "):
        resumed.train(resume_from_checkpoint=True)


def test_safe_changes_resume_silently(target, dataset, trained, tmp_path, caplog):
    output = copy_run(trained, tmp_path)
    resumed = make_trainer(
        target, dataset, output, max_steps=3, save_steps=1, logging_steps=2, save_total_limit=1, disable_tqdm=True
    )
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3 and "changed" not in caplog.text
    assert IDENTITY_KEY in json.loads((output / "checkpoint-3" / RECIPE_FILE).read_text())  # recorded for the next


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_an_allowed_learning_rate_takes_effect(target, dataset, tmp_path, schedule):
    """Without the fix the scheduler's state brings the old base rate back: 0.005 would be used."""
    output = tmp_path / "output"
    make_trainer(target, dataset, output, max_steps=2, lr_scheduler_type=schedule, warmup_steps=1).train()
    resumed = make_trainer(
        target,
        dataset,
        output,
        lr_scheduler_type=schedule,
        warmup_steps=1,
        learning_rate=0.002,
        resume_allow_changes=["learning_rate"],
    )
    resumed.train(resume_from_checkpoint=True)
    rates = {log["step"]: log["learning_rate"] for log in resumed.state.log_history if "learning_rate" in log}
    # the rate logged at step N is the one step N used: warmup 1, then constant, or linear over 4 steps
    expected = {3: 0.002, 4: 0.002} if schedule == "constant" else {3: 0.002 * 2 / 3, 4: 0.002 * 1 / 3}
    assert rates[1] == (0.005 if schedule == "constant" else 0.0)  # linear: the warmup step
    assert {step: rates[step] for step in (3, 4)} == pytest.approx(expected)
    assert resumed.optimizer.param_groups[0]["initial_lr"] == 0.002
    recorded = json.loads((output / "checkpoint-4" / RECIPE_FILE).read_text())
    assert recorded["training_arguments"]["learning_rate"] == 0.002

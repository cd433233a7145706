"""transformers still calls the private Trainer internals as DFlash2Trainer relies on (trainer.training.hf_hooks).

A real `Trainer` on a one-parameter model, on CPU, in seconds: each hook is overridden to record how it
is called, the way DFlash2Trainer overrides it.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from trainer.training.hf_hooks import ATTRIBUTES, HOOKS, INSTANCE_ATTRIBUTES, check_hooks, hook_problems
from trainer.training.resume_check import apply_learning_rate
from trainer.training.trainer import DFlash2Trainer


class OneParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.weight * x - labels) ** 2).mean()}


class RecordingTrainer(Trainer):
    """Overrides each hook as DFlash2Trainer does (call super, then act), recording how HF called it."""

    def __init__(self, *args, staging: Path | None = None, **kwargs) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.staging = staging
        self.redirect: Path | None = None
        super().__init__(*args, **kwargs)

    def _build_accelerator_args(self, **kwargs):
        arguments = super()._build_accelerator_args(**kwargs)
        self.calls.append(("_build_accelerator_args", {"returned": arguments}))
        return arguments

    def _get_output_dir(self, trial) -> str:
        self.calls.append(("_get_output_dir", {"trial": trial}))
        return str(self.redirect) if self.redirect is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        self.redirect = self.staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.redirect = None

    def save_model(self, output_dir=None, _internal_call=False) -> None:
        self.calls.append(("save_model", {"output_dir": output_dir, "_internal_call": _internal_call}))
        super().save_model(output_dir, _internal_call=_internal_call)

    def _push_from_checkpoint(self, checkpoint_folder) -> None:
        self.calls.append(("_push_from_checkpoint", {"folder": checkpoint_folder}))  # never uploads

    def _get_grad_norm(self, model, grad_norm=None):
        weight = model.weight.detach().clone()
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.calls.append(("_get_grad_norm", {"given": grad_norm, "weight": weight, "norm": norm}))
        return norm

    def _get_train_sampler(self, train_dataset=None):
        sampler = ReversedSampler(len(self.train_dataset))
        self.calls.append(("_get_train_sampler", {"returned": sampler}))
        return sampler

    def named(self, name: str) -> list[dict]:
        return [details for called, details in self.calls if called == name]


class ReversedSampler(torch.utils.data.Sampler):
    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        return iter(range(self.count - 1, -1, -1))

    def __len__(self) -> int:
        return self.count


DATA = [{"x": torch.tensor([1.0]), "labels": torch.tensor([3.0])} for _ in range(8)]


def make(tmp_path: Path, run: str = "run", **values) -> RecordingTrainer:
    arguments = {
        "output_dir": str(tmp_path / run),
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "learning_rate": 0.1,
        "lr_scheduler_type": "constant",
        "save_strategy": "steps",
        "save_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "logging_steps": 1,
        "dataloader_num_workers": 0,
        **values,
    }
    return RecordingTrainer(
        model=OneParameter(), args=TrainingArguments(**arguments), train_dataset=DATA, staging=tmp_path / "staging"
    )


@pytest.fixture
def trained(tmp_path) -> RecordingTrainer:
    trainer = make(tmp_path, push_to_hub=False)
    trainer.train()
    return trainer


def test_save_checkpoint_writes_under_what_get_output_dir_returns(trained, tmp_path):
    assert sorted(path.name for path in (tmp_path / "staging").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # nothing under the run folder itself
    saved = tmp_path / "staging" / "checkpoint-2"
    assert {"trainer_state.json", "optimizer.pt", "scheduler.pt"} <= {path.name for path in saved.iterdir()}
    assert {"trial": None} in trained.named("_get_output_dir")
    internal = [call for call in trained.named("save_model") if call["_internal_call"]]
    assert [Path(call["output_dir"]) for call in internal[:2]] == [
        tmp_path / "staging" / f"checkpoint-{n}" for n in (1, 2)
    ]


def test_get_grad_norm_runs_once_per_optimizer_step_before_the_step(tmp_path):
    trainer = make(tmp_path, gradient_accumulation_steps=2, save_strategy="no")
    trainer.train()
    calls = trainer.named("_get_grad_norm")
    assert len(calls) == 2  # two optimizer steps of two micro-batches each
    assert calls[0]["weight"].item() == 1.0  # the weights were not stepped yet
    assert calls[1]["weight"].item() != 1.0  # the first step had been taken before the second call
    assert all(call["given"] is not None and torch.isfinite(torch.as_tensor(call["norm"])) for call in calls)


def test_push_from_checkpoint_is_called_by_save_checkpoint_with_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "init_hf_repo", lambda self, token=None: None)  # no Hub
    trainer = make(tmp_path, push_to_hub=True, hub_model_id="org/never-pushed", max_steps=1)
    monkeypatch.setattr(trainer, "push_to_hub", lambda *args, **kwargs: None)
    trainer.train()
    assert [Path(call["folder"]) for call in trainer.named("_push_from_checkpoint")] == [
        tmp_path / "staging" / "checkpoint-1"
    ]


class RateOnTrainBegin(TrainerCallback):
    """Changes the learning rate in on_train_begin, as ResumedLearningRateCallback does."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, int]] = []

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)
        self.seen.append((bool(optimizer.state), schedule.last_epoch))
        apply_learning_rate(optimizer, lr_scheduler, 0.25)


def test_on_train_begin_runs_on_resume_after_the_states_load_and_its_rate_change_sticks(trained, tmp_path):
    """ResumedLearningRateCallback changes the rate in on_train_begin: HF must have loaded the optimizer's
    and scheduler's states by then (they would overwrite it) and must hand both to the callback."""
    checkpoint = tmp_path / "staging" / "checkpoint-1"
    resumed = make(tmp_path, run="resumed", save_strategy="no", learning_rate=0.1)
    callback = RateOnTrainBegin()
    resumed.add_callback(callback)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert callback.seen == [(True, 1)]  # called once, the optimizer's and scheduler's states loaded
    step_two = [log["learning_rate"] for log in resumed.state.log_history if log.get("step") == 2 and "loss" in log]
    assert step_two == [0.25]  # the resumed step ran at the changed rate


def test_build_accelerator_args_is_called_at_init_and_returns_a_dynamo_plugin(trained):
    (call,) = trained.named("_build_accelerator_args")
    assert isinstance(call["returned"], dict) and "dynamo_plugin" in call["returned"]
    assert isinstance(trained.is_fsdp_enabled, bool)
    assert all(hasattr(trained, name) for name in INSTANCE_ATTRIBUTES)


def test_the_train_dataloader_samples_with_what_get_train_sampler_returns(tmp_path):
    data = [{"x": torch.tensor([float(index)]), "labels": torch.tensor([0.0])} for index in range(8)]
    trainer = make(tmp_path, save_strategy="no")
    trainer.train_dataset = data
    batches = [batch["x"].flatten().tolist() for batch in trainer.get_train_dataloader()]
    assert len(trainer.named("_get_train_sampler")) == 1
    assert batches == [[7.0, 6.0], [5.0, 4.0], [3.0, 2.0], [1.0, 0.0]]


def test_every_hook_accepts_the_call_we_make_and_is_overridden_or_called_by_the_trainer():
    assert hook_problems() == []
    check_hooks()
    source = inspect.getsource(DFlash2Trainer)
    for hook in HOOKS:
        assert f"def {hook.name}(" in source or f".{hook.name}(" in source, hook.name
    assert all(hasattr(Trainer, name) for name in ATTRIBUTES)


def test_a_changed_hook_is_one_clear_error():
    class Renamed(Trainer):
        _get_grad_norm = None

        def _get_output_dir(self, run):  # the parameter HF passes by name (trial=) renamed
            return run

    problems = hook_problems(Renamed)
    assert len(problems) == 2
    assert "Trainer._get_output_dir(self, run) no longer takes our call" in problems[0]
    assert problems[1] == "Trainer._get_grad_norm is gone"
    with pytest.raises(RuntimeError, match=r"hf_hooks\.py"):
        check_hooks(Renamed)


def test_our_own_private_names_do_not_shadow_the_trainers(trained):
    """DFlash2Trainer's own `_name` methods and attributes must not override an HF internal by accident."""
    hooks = {hook.name for hook in HOOKS}
    own_methods = {name for name in vars(DFlash2Trainer) if name.startswith("_") and not name.startswith("__")}
    own_attributes = set(re.findall(r"self\.(_[a-z]\w*) = ", inspect.getsource(DFlash2Trainer)))
    assert own_methods >= hooks - {"_prepare_inputs", "save_model"}  # the hooks it overrides are named here
    hf_names = set(dir(Trainer)) | set(vars(trained))
    assert sorted((own_methods - hooks) & hf_names) == []
    assert own_attributes and sorted(own_attributes & hf_names) == []

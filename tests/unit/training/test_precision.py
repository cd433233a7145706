"""Precision keys (bf16, fp16, tf32): parsed on any machine, applied at launch where the device runs them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import trainer.training.precision as precision
from trainer.training.arguments import DFlashTrainingArguments, parse_arguments

FLAGS = ["--target", "t", "--draft_config", "d.json"]


def _arguments(tmp_path, **values) -> DFlashTrainingArguments:
    return DFlashTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **values)


@pytest.mark.parametrize("flag", ["--bf16", "--fp16", "--tf32"])
def test_precision_flags_parse_on_a_cpu_machine_and_keep_what_was_asked(tmp_path, flag):
    _, _, training = parse_arguments([*FLAGS, "--output_dir", str(tmp_path), flag, "true"])
    name = flag.removeprefix("--")
    assert getattr(training, name) is True
    assert training.requested_precision[name] is True
    assert training.mixed_precision == ({"bf16": "bf16", "fp16": "fp16"}.get(name, "no"))


def test_bf16_in_a_recipe_parses_without_a_gpu(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"target: t\ndraft_config: d.json\noutput_dir: {tmp_path}\nbf16: true\ntf32: true\n")
    _, _, training = parse_arguments([str(recipe)])
    assert training.bf16 is True and training.tf32 is True and training.mixed_precision == "bf16"


def test_bf16_and_fp16_together_are_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="bf16 and fp16 are both true"):
        _arguments(tmp_path, bf16=True, fp16=True)


def _cpu_warnings(caplog, args) -> list[str]:
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        precision.apply_at_launch(args)
    return [record.getMessage() for record in caplog.records if record.name == precision.__name__]


def test_bf16_runs_on_cpu_and_tf32_is_off_in_one_warning_line(tmp_path, caplog):
    args = _arguments(tmp_path, bf16=True, tf32=True)
    lines = _cpu_warnings(caplog, args)
    assert lines == ["precision: tf32 is off: TF32 is an NVIDIA GPU format (the run is on CPU)"]
    assert (args.bf16, args.fp16, args.mixed_precision, args.tf32) == (True, False, "bf16", None)
    assert args.requested_precision == {"bf16": True, "fp16": False, "tf32": True}  # what was asked stays known


def test_bf16_alone_on_cpu_is_silent(tmp_path, caplog):
    args = _arguments(tmp_path, bf16=True)
    assert _cpu_warnings(caplog, args) == []
    assert args.bf16 is True and args.mixed_precision == "bf16"


def test_fp16_on_cpu_runs_as_float32_with_one_line_saying_why(tmp_path, caplog):
    """accelerate 1.15 enables fp16 mixed precision only off CPU: left on, it would train float32 silently."""
    args = _arguments(tmp_path, fp16=True)
    lines = _cpu_warnings(caplog, args)
    assert len(lines) == 1
    assert lines[0].startswith("precision: fp16 (from the recipe) runs as float32: accelerate runs fp16 mixed ")
    assert "bf16 runs on CPU" in lines[0]
    assert (args.bf16, args.fp16, args.mixed_precision) == (False, False, "no")


def test_accelerate_really_has_no_fp16_on_cpu_but_has_bf16():
    """What the fp16 line claims, checked against accelerate itself (its CPU state, no process group)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    try:
        AcceleratorState._reset_state(reset_partial_state=True)  # whatever an earlier test left
        half = Accelerator(cpu=True, mixed_precision="fp16")
        assert half.native_amp is False and half.scaler is None  # nothing would run in fp16
        AcceleratorState._reset_state(reset_partial_state=True)
        bf16 = Accelerator(cpu=True, mixed_precision="bf16")
        assert bf16.native_amp is True
        with bf16.autocast():
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()


def test_cpu_launch_in_float32_is_silent(tmp_path, caplog):
    args = _arguments(tmp_path)
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        precision.apply_at_launch(args)
    assert not [record for record in caplog.records if record.name == precision.__name__]
    assert args.mixed_precision == "no"


def _cuda_args(**values) -> SimpleNamespace:
    defaults = {"device": torch.device("cuda", 0), "bf16": False, "fp16": False, "tf32": None, "mixed_precision": "no"}
    return SimpleNamespace(**{**defaults, **values})


def _warnings(caplog, args) -> list[str]:
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        precision.apply_at_launch(args)
    return [record.getMessage() for record in caplog.records if record.name == precision.__name__]


def test_a_plain_float32_cuda_run_suggests_bf16(caplog, monkeypatch):
    monkeypatch.setattr(precision, "is_torch_bf16_gpu_available", lambda: True)
    lines = _warnings(caplog, _cuda_args())
    assert len(lines) == 1 and "float32 without mixed precision" in lines[0] and "bf16: true" in lines[0]


def test_cuda_with_bf16_from_the_recipe_or_from_accelerate_keeps_it_silently(caplog, monkeypatch):
    monkeypatch.setattr(precision, "is_torch_bf16_gpu_available", lambda: True)
    recipe = _cuda_args(bf16=True, mixed_precision="bf16", requested_precision={"bf16": True})
    accelerate = _cuda_args(mixed_precision="bf16")  # ACCELERATE_MIXED_PRECISION, read by TrainingArguments
    assert _warnings(caplog, recipe) == [] and _warnings(caplog, accelerate) == []
    assert recipe.bf16 is True and recipe.mixed_precision == accelerate.mixed_precision == "bf16"


def test_bf16_on_a_gpu_without_bf16_runs_float32_with_one_line(caplog, monkeypatch):
    monkeypatch.setattr(precision, "is_torch_bf16_gpu_available", lambda: False)
    args = _cuda_args(bf16=True, mixed_precision="bf16", requested_precision={"bf16": True})
    lines = _warnings(caplog, args)
    assert len(lines) == 1 and "bf16 (from the recipe) runs as float32: this GPU has no bf16" in lines[0]
    assert args.bf16 is False and args.mixed_precision == "no"


def test_tf32_is_applied_where_the_gpu_has_it(caplog, monkeypatch):
    applied = []
    monkeypatch.setattr(precision, "is_torch_tf32_available", lambda: True)
    monkeypatch.setattr(precision, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(precision, "enable_tf32", applied.append)
    precision.apply_at_launch(_cuda_args(tf32=True, bf16=True, mixed_precision="bf16"))
    precision.apply_at_launch(_cuda_args(tf32=False, bf16=True, mixed_precision="bf16"))
    assert applied == [True, False]


def test_the_trainer_applies_precision_before_accelerate_is_built(tmp_path, caplog):
    """A bf16 + tf32 recipe on this CPU machine: the trainer's accelerator runs bf16 (CPU autocast), tf32 is
    off in one line."""
    from modeling_dflash2 import DFlash2DraftModel
    from tests.support.tiny_target import tiny_draft_config_for, tiny_target
    from trainer.training.trainer import DFlash2Trainer

    target = tiny_target()
    args = _arguments(tmp_path, bf16=True, tf32=True, num_anchors=4)
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        trainer = DFlash2Trainer(model=DFlash2DraftModel(tiny_draft_config_for(target)), args=args, target=target)
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.native_amp is True
    assert trainer.args.bf16 is True and trainer.args.tf32 is None
    assert [record.name for record in caplog.records].count(precision.__name__) == 1

"""Issue 31, "fail before the work": a recipe the planner says cannot fit this machine's memory stops
with the planner's verdict before the target, the draft or any data is built (trainer.plan.fit_check);
`dflash2 prepare` accepts `init_from` without `draft_config`, as `train` does."""

from __future__ import annotations

import logging
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from modeling_dflash2 import DFlash2DraftModel
from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.commands import prepare, train
from trainer.commands.runner import run
from trainer.models.target import FrozenTarget
from trainer.plan import fit_check
from trainer.plan.facts import GIB, launched_accelerate_config
from trainer.plan.memory import plan_run
from trainer.training.arguments import parse_arguments

ABSURD_ANCHORS = 1_000_000_000


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny target, draft config, chat data and recipe, plus a saved DFlash2 draft checkpoint."""
    root = tmp_path_factory.mktemp("gate")
    write_tiny_run(root)
    DFlash2DraftModel(tiny_draft_config_for(tiny_target())).save_pretrained(root / "checkpoint")
    return root


def recipe(base: Path, where: Path, **changes) -> str:
    """The base recipe with `changes` (None removes a key), its outputs under `where`."""
    values = yaml.safe_load((base / "recipe.yaml").read_text())
    values.update(output_dir=str(where / "output"), cache_dir=str(where / "cache"), **changes)
    path = where / "recipe.yaml"
    path.write_text(yaml.safe_dump({key: value for key, value in values.items() if value is not None}))
    return str(path)


@pytest.fixture
def nothing_is_built(monkeypatch):
    """Loading the target (the first thing training builds) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the memory check refused the run")

    monkeypatch.setattr(FrozenTarget, "load", classmethod(refuse))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


def test_the_check_does_not_grow_with_num_anchors(base, tmp_path):
    """Checking 10^9 (or 10^15) anchors is the planner's arithmetic on Python ints: no memory or time
    in proportion to what it refuses."""
    for anchors in (ABSURD_ANCHORS, 10**15):
        model_args, data_args, training_args = parse_arguments([recipe(base, tmp_path), "--num_anchors", str(anchors)])
        tracemalloc.start()
        started = time.perf_counter()
        with pytest.raises(fit_check.RecipeDoesNotFit, match="largest part: activations"):
            fit_check.check_run_fits(model_args, data_args, training_args)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 64 << 20 and elapsed < 10


def test_absurd_num_anchors_stops_training_before_anything_is_built(base, tmp_path, capsys, nothing_is_built):
    with pytest.raises(SystemExit) as stopped:
        run(train.main, [recipe(base, tmp_path, num_anchors=ABSURD_ANCHORS)])
    assert stopped.value.code == 2
    line = one_error_line(capsys)
    assert line.startswith("error: this run does not fit in this machine's memory (")
    assert "of CPU memory available) by the planner's estimate: " in line and "does NOT fit on 1 x " in line
    assert "largest part: activations" in line
    assert "largest per_device_train_batch_size that fits: 0" in line and fit_check.SKIP_VARIABLE in line
    assert not list((tmp_path / "output").glob("checkpoint-*"))


def test_the_refusal_is_the_planners_own_verdict(base, tmp_path, monkeypatch):
    """Below the machine's memory the run is refused exactly when `dflash2 plan` says it does not fit."""
    model_args, data_args, training_args = parse_arguments([recipe(base, tmp_path)])
    fitting = fit_check.check_run_fits(model_args, data_args, training_args)
    assert fitting is not None and fitting.fits  # the tiny recipe is sized, and fits here
    monkeypatch.setattr(fit_check, "available_memory", lambda: fitting.per_rank_bytes - 1)
    with pytest.raises(fit_check.RecipeDoesNotFit, match="does NOT fit") as refused:
        fit_check.check_run_fits(model_args, data_args, training_args)
    plan = plan_run(model_args, data_args, training_args, 1, fitting.per_rank_bytes - 1, device="cpu")
    assert plan.verdict() in str(refused.value)
    monkeypatch.setenv(fit_check.SKIP_VARIABLE, "1")
    assert fit_check.check_run_fits(model_args, data_args, training_args) is None


def test_ranks_on_one_machine_share_its_memory(base, tmp_path, monkeypatch):
    # a fixed amount: the machine's available memory moves between two reads when other jobs run
    monkeypatch.setattr(fit_check, "available_memory", lambda: 16 << 30)
    model_args, data_args, training_args = parse_arguments([recipe(base, tmp_path)])
    alone = fit_check.check_run_fits(model_args, data_args, training_args)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shared = fit_check.check_run_fits(model_args, data_args, training_args)
    assert alone.gpu_memory_bytes == 16 << 30 and shared.gpu_memory_bytes == 4 << 30


def test_a_run_the_planner_cannot_size_is_said_and_goes_ahead(base, tmp_path, monkeypatch, caplog):
    def unsized(*args, **kwargs):
        raise FileNotFoundError("a GGUF target is planned from its cached conversion, which does not exist yet")

    monkeypatch.setattr(fit_check, "plan_run", unsized)
    model_args, data_args, training_args = parse_arguments([recipe(base, tmp_path)])
    with caplog.at_level(logging.INFO, logger=fit_check.__name__):
        assert fit_check.check_run_fits(model_args, data_args, training_args) is None
    assert "memory check skipped: the planner could not size this run (a GGUF target" in caplog.text


def test_an_accelerate_fsdp_launch_is_planned_sharded():
    """`accelerate launch` passes FSDP in the environment, not in TrainingArguments: the check plans
    the sharding the run has, not a whole draft per rank."""
    environ = {"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_OFFLOAD_PARAMS": "true"}
    assert launched_accelerate_config(environ) == {
        "distributed_type": "FSDP",
        "fsdp_config": {"fsdp_reshard_after_forward": "false", "fsdp_offload_params": "true"},
    }
    assert launched_accelerate_config({"ACCELERATE_MIXED_PRECISION": "bf16"}) == {}


def test_prepare_refuses_a_target_larger_than_this_machine(base, tmp_path, capsys, monkeypatch, nothing_is_built):
    monkeypatch.setattr(fit_check, "available_memory", lambda: 4096)
    with pytest.raises(SystemExit) as stopped:
        run(prepare.main, [recipe(base, tmp_path, offline=True)])
    assert stopped.value.code == 2
    line = one_error_line(capsys)
    assert line.startswith("error: the target does not fit in this machine's memory (4.0 KiB of CPU memory available)")
    assert "(target_weights), more than 4.0 KiB" in line


def test_prepare_accepts_init_from_without_draft_config(base, tmp_path, capsys):
    """README: draft_config is optional with a DFlash2 init_from; `train` accepted it, `prepare` crashed."""
    argv = [recipe(base, tmp_path, draft_config=None, init_from=str(base / "checkpoint"), offline=True)]
    with pytest.raises(SystemExit) as finished:
        run(prepare.main, argv)
    assert finished.value.code == 0, capsys.readouterr().err
    assert "prepared 20 training and 4 evaluation samples" in capsys.readouterr().out


def test_the_memory_of_each_device(monkeypatch):
    """A CUDA rank plans for its device's total memory (what `--gpu-memory-gb` means); a device the
    planner has no model of is not sized (the run then goes ahead with a logged line)."""
    import torch

    properties = type("Properties", (), {"name": "NVIDIA H200", "total_memory": 141 * GIB})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    assert fit_check.device_memory(torch.device("cuda", 0)) == (141 * GIB, "NVIDIA H200 with 141.0 GiB")
    monkeypatch.setattr(fit_check, "available_memory", lambda: 8 * GIB)
    assert fit_check.device_memory(torch.device("cpu"))[0] == 8 * GIB
    assert fit_check.device_memory(torch.device("meta")) == (None, "a meta device")

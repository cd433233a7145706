"""trainer.training.checkpointing: staged checkpoints appear whole or not at all, drafts and resume points."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.training.checkpointing import Checkpointing, resume_path
from trainer.training.checkpoints import STAGING_PREFIX, IncompleteCheckpointError, checkpoint_problems, write_manifest


def fake_trainer(run_dir: Path, step: int = 2) -> SimpleNamespace:
    """What Checkpointing reads of a trainer, on one rank."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(
        args=SimpleNamespace(
            output_dir=str(run_dir), should_save=True, save_total_limit=None, device="cpu", world_size=1
        ),
        state=SimpleNamespace(global_step=step, best_model_checkpoint=None),
        accelerator=SimpleNamespace(wait_for_everyone=lambda: None),
        model=torch.nn.Linear(2, 2),
    )


def hf_writes(checkpointing: Checkpointing, seen: list[Path], fail: bool = False):
    """Stands in for HF's _save_checkpoint: writes checkpoint-N under what `_get_output_dir` returns."""

    def save() -> None:
        assert checkpointing.staging is not None
        folder = checkpointing.staging / f"checkpoint-{checkpointing.trainer.state.global_step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"w" * 64)
        seen.append(folder)
        if fail:
            raise OSError("killed while writing optimizer.pt")
        (folder / "optimizer.pt").write_bytes(b"o" * 64)
        (folder / "trainer_state.json").write_text('{"global_step": 2}')

    return save


def test_a_checkpoint_is_written_in_a_staging_folder_and_appears_whole(tmp_path):
    run_dir = tmp_path / "run"
    checkpointing = Checkpointing(fake_trainer(run_dir))
    seen: list[Path] = []
    checkpointing.save_checkpoint(run_dir, hf_writes(checkpointing, seen))
    assert seen[0].parent.parent == run_dir and seen[0].parent.name.startswith(STAGING_PREFIX)
    final = run_dir / "checkpoint-2"
    assert sorted(path.name for path in run_dir.iterdir()) == ["checkpoint-2"]  # no staging folder left
    assert checkpoint_problems(final) == []  # published with its manifest
    assert checkpointing.staging is None and checkpointing.last_checkpoint == final


def test_a_save_that_fails_leaves_neither_a_checkpoint_nor_its_staging_folder(tmp_path):
    run_dir = tmp_path / "run"
    checkpointing = Checkpointing(fake_trainer(run_dir))
    seen: list[Path] = []
    with pytest.raises(OSError, match=r"killed while writing optimizer\.pt"):
        checkpointing.save_checkpoint(run_dir, hf_writes(checkpointing, seen, fail=True))
    assert seen and list(run_dir.iterdir()) == []
    assert checkpointing.staging is None and checkpointing.last_checkpoint is None


def test_non_finite_weights_are_refused_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    trainer = fake_trainer(run_dir)
    with torch.no_grad():
        trainer.model.weight[0, 0] = float("nan")
    checkpointing = Checkpointing(trainer)
    seen: list[Path] = []
    with pytest.raises(FloatingPointError) as refused:
        checkpointing.save_checkpoint(run_dir, hf_writes(checkpointing, seen))
    assert str(refused.value) == "non-finite weights at step 2: no checkpoint saved; there is no good checkpoint yet"
    assert seen == [] and list(run_dir.iterdir()) == []


def test_a_draft_save_inside_a_staged_checkpoint_is_written_in_place_and_others_are_checked(tmp_path, monkeypatch):
    trainer = fake_trainer(tmp_path / "run")
    checkpointing = Checkpointing(trainer)
    written: list[Path] = []
    monkeypatch.setattr(checkpointing, "write_draft", written.append)
    checkpointing.staging = tmp_path / "run" / f"{STAGING_PREFIX}2"
    with torch.no_grad():
        trainer.model.weight[0, 0] = float("inf")  # checked by save_checkpoint, before staging
    checkpointing.save_draft(tmp_path / "anywhere")
    assert written == [tmp_path / "anywhere"]
    checkpointing.staging = None
    with pytest.raises(FloatingPointError, match=r"^non-finite weights after step 2: the draft was not saved to "):
        checkpointing.save_draft(tmp_path / "run")
    assert written == [tmp_path / "anywhere"]


def complete_checkpoint(directory: Path, step: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"w" * 8)
    (directory / "optimizer.pt").write_bytes(b"o" * 8)
    (directory / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    write_manifest(directory, step)
    return directory


def test_resume_path_reads_true_and_false_and_checks_a_named_checkpoint(tmp_path, caplog):
    assert resume_path(tmp_path, None, needs_optimizer=True) is None
    assert resume_path(tmp_path, "False", needs_optimizer=True) is None
    with caplog.at_level(logging.WARNING, logger="trainer.training.checkpointing"):
        assert resume_path(tmp_path, "true", needs_optimizer=True) is None  # nothing to resume: a fresh start
    assert "No complete checkpoint in" in caplog.text
    complete_checkpoint(tmp_path / "checkpoint-2", 2)
    newest = complete_checkpoint(tmp_path / "checkpoint-4", 4)
    assert resume_path(tmp_path, True, needs_optimizer=True) == str(newest)
    (newest / "optimizer.pt").write_bytes(b"")
    assert resume_path(tmp_path, "TRUE", needs_optimizer=True) == str(tmp_path / "checkpoint-2")
    with pytest.raises(IncompleteCheckpointError):
        resume_path(tmp_path, str(newest), needs_optimizer=True)

"""trainer.training.checkpoints: completeness, choosing a resume point, recovery, rotation, vetted pickles."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.training.checkpoints import (
    MANIFEST,
    IncompleteCheckpointError,
    check_resumable,
    checkpoint_problems,
    clean_leftovers,
    list_checkpoints,
    newest_complete_checkpoint,
    publish_staged,
    rotate,
    staging_parent,
    unsafe_pickles,
    write_manifest,
)


def fake_checkpoint(directory: Path, step: int, manifest: bool = True) -> Path:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"w" * (100 + step))
    (directory / "optimizer.pt").write_bytes(b"o" * 300)
    (directory / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    if manifest:
        write_manifest(directory, step)
    return directory


def test_the_manifest_names_a_missing_or_truncated_file(tmp_path):
    checkpoint = fake_checkpoint(tmp_path / "checkpoint-2", 2)
    assert checkpoint_problems(checkpoint) == []
    os.truncate(checkpoint / "optimizer.pt", 150)
    (checkpoint / "trainer_state.json").unlink()
    assert checkpoint_problems(checkpoint) == [
        "optimizer.pt has 150 bytes, the manifest says 300",
        "trainer_state.json is missing",
    ]
    bare = fake_checkpoint(tmp_path / "checkpoint-3", 3, manifest=False)
    assert checkpoint_problems(bare) == [
        f"no {MANIFEST} (an interrupted save, or written before dflash2-hub recorded completion)"
    ]


def test_resume_true_takes_the_newest_complete_checkpoint_and_names_the_skipped(tmp_path, caplog):
    for step in (2, 4):
        fake_checkpoint(tmp_path / f"checkpoint-{step}", step)
    fake_checkpoint(tmp_path / "checkpoint-10", 10, manifest=False)  # numeric, not lexical, order
    broken = fake_checkpoint(tmp_path / "checkpoint-6", 6)
    (broken / "model.safetensors").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="trainer.training.checkpoints"):
        assert newest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert f"Skipping incomplete checkpoint {tmp_path / 'checkpoint-10'}: no {MANIFEST}" in caplog.text
    assert "checkpoint-6: model.safetensors has 0 bytes, the manifest says 106" in caplog.text
    assert newest_complete_checkpoint(tmp_path / "missing") is None


def test_an_explicit_checkpoint_is_checked_before_use(tmp_path, caplog):
    complete = fake_checkpoint(tmp_path / "checkpoint-2", 2)
    check_resumable(complete)
    (complete / "optimizer.pt").unlink()
    with pytest.raises(
        IncompleteCheckpointError, match=r"checkpoint-2 cannot be resumed from: optimizer.pt is missing"
    ):
        check_resumable(complete)
    legacy = fake_checkpoint(tmp_path / "checkpoint-3", 3, manifest=False)
    with caplog.at_level(logging.WARNING, logger="trainer.training.checkpoints"):
        check_resumable(legacy)  # written before manifests: accepted when named, with a warning
    assert "resuming without a completeness check" in caplog.text
    (legacy / "trainer_state.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"trainer_state\.json is missing"):
        check_resumable(legacy)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        check_resumable(tmp_path / "checkpoint-9")


def test_leftovers_are_recovered_when_complete_and_removed_otherwise(tmp_path):
    fake_checkpoint(staging_parent(tmp_path, 4) / "checkpoint-4", 4)  # killed just before its rename
    fake_checkpoint(staging_parent(tmp_path, 6) / "checkpoint-6", 6, manifest=False)  # killed mid-write
    (tmp_path / ".deleting-checkpoint-2-0123abcd").mkdir()  # killed mid-rotation
    (tmp_path / ".saving-x1y2z3").mkdir()  # killed while replacing the run's own draft files
    (tmp_path / ".trainer_state.json.123.tmp").write_text("{")  # killed mid-write
    clean_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert checkpoint_problems(tmp_path / "checkpoint-4") == []


def test_publishing_a_staged_checkpoint_replaces_an_older_copy_of_the_same_step(tmp_path):
    fake_checkpoint(tmp_path / "checkpoint-4", 4, manifest=False)
    staged = staging_parent(tmp_path, 4) / "checkpoint-4"
    fake_checkpoint(staged, 4, manifest=False)
    (staged / "scheduler.pt").write_bytes(b"s")
    publish_staged(staged, tmp_path / "checkpoint-4", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert (tmp_path / "checkpoint-4" / "scheduler.pt").exists()
    assert checkpoint_problems(tmp_path / "checkpoint-4") == []


def test_rotation_keeps_the_newest_and_the_protected_and_hides_victims_first(tmp_path, monkeypatch):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path / f"checkpoint-{step}", step)
    deleted_names = []
    real_rmtree = __import__("shutil").rmtree

    def rmtree(path, *args, **kwargs):
        deleted_names.append(Path(path).name)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr("trainer.training.checkpoints.shutil.rmtree", rmtree)
    victims = rotate(tmp_path, keep=2, protected=[tmp_path / "checkpoint-2"])
    assert [p.name for p in victims] == ["checkpoint-4", "checkpoint-6"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-8"]
    assert all(name.startswith(".deleting-checkpoint-") for name in deleted_names)  # never deleted in place
    assert rotate(tmp_path, keep=1) == [tmp_path / "checkpoint-2"]  # the newest always stays
    assert rotate(tmp_path, keep=None) == []


class Payload:
    """Unpickling this runs `touch`: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_dcp_index_is_refused_without_running_it_and_a_real_one_passes(tmp_path):
    real = tmp_path / "real" / "pytorch_model_fsdp_0"
    dcp.save({"weight": torch.ones(3, 2), "step": torch.tensor(4)}, checkpoint_id=str(real))
    assert unsafe_pickles(tmp_path / "real") == []
    crafted = tmp_path / "crafted" / "optimizer_0"
    crafted.mkdir(parents=True)
    marker = tmp_path / "ran"
    (crafted / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    problems = unsafe_pickles(tmp_path / "crafted")
    assert problems == ["optimizer_0/.metadata is not a plain checkpoint index (refers to posix.system)"]
    assert not marker.exists()
    write_manifest(tmp_path / "crafted", 2)
    assert checkpoint_problems(tmp_path / "crafted") == problems  # resume refuses it before torch loads it

"""How `DFlash2Trainer` saves: staged checkpoints, draft-only saves, the run's state and the resume point.

A checkpoint (draft, optimizer, scheduler, RNG, trainer state) is written by HF's `_save_checkpoint`
into a staging folder (`Checkpointing.staging`, which the trainer's `_get_output_dir` returns while
it is set), then renamed to `checkpoint-N` with a completion manifest: a kill at any instant leaves
either the whole checkpoint or none of it under its final name. Non-finite weights are never saved
(`trainer.training.finite`); a full disk is one line naming what was kept. The file formats and
their checks live in `trainer.training.checkpoints`.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import Trainer

from trainer.fileio import replace_files_atomically, reporting_disk_full, write_file_atomically
from trainer.publishing.export import RECIPE_FILE, remove_secrets
from trainer.training.checkpoints import (
    check_resumable,
    newest_complete_checkpoint,
    publish_staged,
    rotate,
    staging_parent,
)
from trainer.training.finite import weights_are_finite
from trainer.training.output_dir import check_fresh_start, output_path
from trainer.training.resume_check import IDENTITY_KEY, check_unchanged, run_identity

if TYPE_CHECKING:
    from trainer.training.trainer import DFlash2Trainer

logger = logging.getLogger(__name__)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft's whole state dict on CPU, gathered from its FSDP2 shards: a collective, so every
    rank must call it (the saving rank then writes it; the others drop their copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # a model's state dict holds tensors (torch types it with the optimizer's values too)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)


def resume_path(output_dir: Path, resume_from_checkpoint: str | bool | None, needs_optimizer: bool) -> str | None:
    """The checkpoint to resume from: `True` is the newest *complete* one in `output_dir` (None, a
    fresh start, when there is none); a named one is checked to be complete first."""
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
        resume_from_checkpoint = resume_from_checkpoint.lower() == "true"
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint is True:
        newest = newest_complete_checkpoint(output_dir)
        if newest is None:
            check_fresh_start(output_dir)
            logger.warning("No complete checkpoint in %s: training starts at step 0.", output_dir)
            return None
        logger.info("Resuming from %s", newest)
        return str(newest)
    check_resumable(Path(resume_from_checkpoint), needs_optimizer=needs_optimizer)
    return str(resume_from_checkpoint)


class Checkpointing:
    """The saves of one trainer; `staging` is set only while HF writes a checkpoint into it."""

    def __init__(self, trainer: DFlash2Trainer) -> None:
        self.trainer = trainer
        self.staging: Path | None = None
        self.last_checkpoint: Path | None = None
        self.learning_rate_changed = False  # by this train()'s resume (resume_allow_changes)
        self._identity: dict[str, Any] | None = None

    def resume_point(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """A checkpoint path to resume from (complete, and recorded with the same run: checked before
        any weights load, `trainer.training.resume_check`), or None for a fresh start."""
        args = self.trainer.args
        self.learning_rate_changed = False
        resume = resume_path(output_path(args), resume_from_checkpoint, needs_optimizer=not args.save_only_model)
        if resume is not None:
            allowed = check_unchanged(Path(resume), self.recipe_record(), args.resume_allow_changes)
            self.learning_rate_changed = "learning_rate" in allowed
        return resume

    def _weights_are_finite(self) -> bool:
        args = self.trainer.args
        return weights_are_finite(self.trainer.model.parameters(), args.device, args.world_size)

    def last_good(self) -> str:
        """What a user still has when a save is refused or fails: the newest complete checkpoint."""
        good = self.last_checkpoint or newest_complete_checkpoint(output_path(self.trainer.args))
        return f"the last good checkpoint is {good}" if good else "there is no good checkpoint yet"

    def nothing_saved(self) -> str:
        return f"no checkpoint saved; {self.last_good()}"

    def save_checkpoint(self, run_dir: Path, hf_save_checkpoint: Callable[[], None]) -> None:
        """`hf_save_checkpoint` (HF's `_save_checkpoint`) staged, published as `run_dir/checkpoint-N`, then
        rotation. Non-finite weights are never saved (nor do they rotate a good checkpoint away); a full
        disk is one line naming the checkpoint, the step and the one kept, with the staging folder
        removed (so the disk does not fill further) and rotation not run."""
        trainer, args = self.trainer, self.trainer.args
        step = trainer.state.global_step
        if not self._weights_are_finite():
            raise FloatingPointError(f"non-finite weights at step {step}: {self.nothing_saved()}")
        parent = staging_parent(run_dir, step)
        final = run_dir / f"checkpoint-{step}"
        kept = f"{self.last_good()} (kept; nothing was rotated away)"
        try:  # a full disk is recognised (it may probe the disk) before the staged files are removed
            with reporting_disk_full(f"the checkpoint of step {step}", final, kept=kept):
                self._save_staged(hf_save_checkpoint, parent, final, step)
        except BaseException:
            if args.should_save:
                shutil.rmtree(parent, ignore_errors=True)
            raise
        if args.should_save:  # the checkpoint just saved is kept even when older than the newest one
            rotate(run_dir, args.save_total_limit, protected=[trainer.state.best_model_checkpoint, final])
        trainer.accelerator.wait_for_everyone()
        self.last_checkpoint = final

    def _save_staged(self, hf_save_checkpoint: Callable[[], None], parent: Path, final: Path, step: int) -> None:
        """HF's `_save_checkpoint` into `parent`, then published as `final` by the saving rank."""
        trainer, should_save = self.trainer, self.trainer.args.should_save
        if should_save:
            shutil.rmtree(parent, ignore_errors=True)
        trainer.accelerator.wait_for_everyone()
        self.staging = parent
        try:
            hf_save_checkpoint()
        finally:
            self.staging = None
        trainer.accelerator.wait_for_everyone()
        if should_save:
            staged = parent / final.name
            if trainer.state.best_model_checkpoint == str(staged):
                trainer.state.best_model_checkpoint = str(final)
                trainer.state.save_to_json(str(staged / "trainer_state.json"))
            publish_staged(staged, final, step)

    def save_draft(self, output_dir: Path) -> None:
        """The publishable draft and the recipe into `output_dir`. Inside a staged checkpoint it is
        written in place (the weights were checked there); any other folder (the run's own, holding
        its checkpoints) gets each file replaced by one rename, so a kill never leaves a half-written
        draft behind; non-finite weights are refused and a full disk leaves the previous files in
        place, in one line either way."""
        trainer = self.trainer
        if self.staging is not None:
            self.write_draft(output_dir)
        elif not self._weights_are_finite():
            raise FloatingPointError(
                f"non-finite weights after step {trainer.state.global_step}: the draft was not saved to "
                f"{output_dir}; {self.last_good()}"
            )
        elif not trainer.args.should_save:
            self.write_draft(output_dir)
        else:
            kept = f"the files there are the previous ones; {self.last_good()}"
            with reporting_disk_full(f"the draft of step {trainer.state.global_step} to", output_dir, kept=kept):
                replace_files_atomically(output_dir, self.write_draft)
        trainer.accelerator.wait_for_everyone()

    def write_draft(self, directory: Path) -> None:
        """The draft files (rank 0 writes; under FSDP every rank joins the full-state-dict gather)."""
        trainer = self.trainer
        if trainer.is_fsdp_enabled:
            state_dict = full_state_dict(trainer.model)
            if trainer.args.should_save:
                trainer.accelerator.unwrap_model(trainer.model).save_pretrained(directory, state_dict=state_dict)
                torch.save(trainer.args, directory / "training_args.bin")
        else:  # HF's own draft save (config, weights, training_args.bin), not the staging-aware override
            Trainer.save_model(trainer, str(directory), _internal_call=True)
        if trainer.args.should_save:
            (directory / RECIPE_FILE).write_text(json.dumps(self.recipe_record(), indent=2, default=str) + "\n")

    def save_state(self) -> None:
        """The run's trainer_state.json, replaced in one rename (HF writes it in place)."""
        trainer = self.trainer
        if trainer.is_world_process_zero():
            path = output_path(trainer.args) / "trainer_state.json"
            with reporting_disk_full("the trainer state", path, kept="the previous trainer_state.json is kept"):
                write_file_atomically(path, lambda temporary: trainer.state.save_to_json(str(temporary)))

    def recipe_record(self) -> dict[str, Any]:
        """The whole recipe as JSON (what export and provenance read; never a pickle), secrets removed."""
        trainer = self.trainer
        return remove_secrets(
            {
                "format": "dflash2-hub recipe",
                **trainer.recipe,
                "training_arguments": json.loads(trainer.args.to_json_string()),
                IDENTITY_KEY: self.run_identity(),
            }
        )

    def run_identity(self) -> dict[str, Any]:
        """Draft config, target and dataset fingerprints and world size (computed once per run)."""
        if self._identity is None:
            trainer = self.trainer
            config = trainer.accelerator.unwrap_model(trainer.model).config
            self._identity = run_identity(config, trainer.target, trainer.train_dataset, trainer.args.world_size)
        return self._identity

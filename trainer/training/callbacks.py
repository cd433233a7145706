"""The HF `TrainerCallback`s every `DFlash2Trainer` registers, in one place.

- `PreemptionCallback` (`trainer.training.preemption`): SIGTERM/SIGINT save a checkpoint and stop.
- `ResumedLearningRateCallback`: a learning rate changed on resume (`resume_allow_changes`) takes
  effect once the optimizer's and scheduler's states are loaded.
- `PushExportOnSaveCallback`: with `push_to_hub` and `hub_strategy: every_save`, each save is
  exported and published (`trainer.training.exports`); HF's own raw-checkpoint push is switched off
  in the trainer (`_push_from_checkpoint`, listed in `trainer.training.hf_hooks`).
- `SpeculativeEvalCallback` (`trainer.evaluation.report`): with `spec_eval_prompts`, each evaluation
  also decodes a few held-out prompts for real.

`expected_callbacks` says which a trainer must hold; tests check it against the registered ones.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from trainer.data.chat import end_of_turn_ids
from trainer.evaluation.report import SpeculativeEvalCallback, prompt_ids
from trainer.training.checkpointing import Checkpointing
from trainer.training.exports import export_and_publish
from trainer.training.preemption import PreemptionCallback
from trainer.training.resume_check import apply_learning_rate

if TYPE_CHECKING:
    from trainer.training.trainer import DFlash2Trainer

logger = logging.getLogger(__name__)


class PushExportOnSaveCallback(TrainerCallback):
    """At every save, export the model being trained and publish it (one commit per save)."""

    def __init__(self, trainer: DFlash2Trainer) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            with tempfile.TemporaryDirectory() as scratch:
                export_and_publish(self.trainer, Path(scratch) / "export", f"Checkpoint at step {state.global_step}")
        return control


class ResumedLearningRateCallback(TrainerCallback):
    """On a resume that changed learning_rate, the new rate replaces the one the loaded optimizer and
    scheduler states carry: HF loads them before `on_train_begin`, and hands both to it."""

    def __init__(self, checkpointing: Checkpointing) -> None:
        self.checkpointing = checkpointing

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if self.checkpointing.learning_rate_changed:
            apply_learning_rate(optimizer, lr_scheduler, args.learning_rate)
            logger.warning("learning_rate %s takes effect at step %d", args.learning_rate, state.global_step + 1)
        return control


def pushes_every_save(trainer: DFlash2Trainer) -> bool:
    return bool(trainer.args.push_to_hub and trainer.args.hub_strategy == "every_save")


def runs_spec_eval(trainer: DFlash2Trainer) -> bool:
    return trainer.args.spec_eval_prompts > 0 and trainer.eval_dataset is not None


def expected_callbacks(trainer: DFlash2Trainer) -> list[type[TrainerCallback]]:
    """The callback classes this trainer's arguments ask for (registered by `register_callbacks`)."""
    wanted: list[type[TrainerCallback]] = [PreemptionCallback, ResumedLearningRateCallback]
    if pushes_every_save(trainer):
        wanted.append(PushExportOnSaveCallback)
    if runs_spec_eval(trainer):
        wanted.append(SpeculativeEvalCallback)
    return wanted


def register_callbacks(trainer: DFlash2Trainer) -> PreemptionCallback:
    """Add this run's callbacks to `trainer`; returns the preemption callback (train() installs it)."""
    preemption = PreemptionCallback(trainer.args.process_index)
    trainer.add_callback(preemption)
    trainer.add_callback(ResumedLearningRateCallback(trainer.checkpointing))
    if pushes_every_save(trainer):
        trainer.add_callback(PushExportOnSaveCallback(trainer))
    if runs_spec_eval(trainer):
        rows: Any = trainer.eval_dataset  # build_datasets' held-out rows: a sample dict per index
        count = min(trainer.args.spec_eval_prompts, len(rows))
        prompts = [prompt_ids(rows[i]) for i in range(count)]
        tokenizer = trainer.target.tokenizer
        stops = sorted(end_of_turn_ids(tokenizer)) if tokenizer is not None else None
        trainer.add_callback(SpeculativeEvalCallback(trainer, prompts, trainer.args.spec_eval_max_new_tokens, stops))
    return preemption

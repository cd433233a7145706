"""`DFlash2Trainer`: HF `Trainer` with the DFlash2 objective, exact pooling and draft-only saves.

Exact gradient accumulation. The loss of an optimizer step is `sum(numerators) / sum(denominators)`
over every micro-batch of the step on every rank. The denominator depends only on the sampled
anchors and the loss mask (`loss_denominator`), so `get_batch_samples` draws the anchors of all
micro-batches of the step up front, sums their denominators, all-reduces that sum, and
`compute_loss` returns `numerator * world_size / global_denominator`: summed over micro-batches by
backward and averaged over ranks by DDP/FSDP, that is exactly the pooled loss's gradient. Hence
`loss_is_scaled_for_ga = True` and no `labels` key.

Metrics are additive (numerator, denominator) pairs kept per mode and reduced across processes in
`log()`, so `tau_walk` in training and `eval_tau_walk` in evaluation are pooled exactly too.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from modeling_dflash2 import DFlash2DraftModel, DFlashDraftModel
from trainer.arguments import DFlashTrainingArguments
from trainer.blocks import AnchorDraw, build_blocks, sample_anchors
from trainer.chat import end_of_turn_ids
from trainer.checkpoints import (
    STAGING_PREFIX,
    check_resumable,
    clean_leftovers,
    newest_complete_checkpoint,
    publish_staged,
    rotate,
    staging_parent,
)
from trainer.compile import compile_decoder_layers
from trainer.evaluation import SpeculativeEvalCallback, prompt_ids
from trainer.export import RECIPE_FILE, TargetDimensions, export_draft, remove_secrets
from trainer.fileio import replace_files_atomically, write_file_atomically
from trainer.hub import PushExportOnSaveCallback, publish
from trainer.metrics import MetricTerms, add_terms, flatten_terms, ratios
from trainer.objective import (
    ObjectiveResult,
    configure_selector_training,
    draft_objective,
    loss_denominator,
    selector_alpha_at,
)
from trainer.preemption import PreemptionCallback
from trainer.target import FrozenTarget, check_target_sharding

logger = logging.getLogger(__name__)

ANCHOR_KEYS = ("anchors", "anchor_keep", "loss_denominator")


class DFlash2Trainer(Trainer):
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model: DFlashDraftModel,
        args: DFlashTrainingArguments,
        target: FrozenTarget,
        target_hub_id: str | None = None,
        recipe: dict[str, Any] | None = None,
        target_sharding: str = "none",
        **kwargs: Any,
    ):
        if not isinstance(args, DFlashTrainingArguments):
            raise TypeError("DFlash2Trainer needs DFlashTrainingArguments (objective settings live there).")
        self.objective = args.objective_config()
        configure_selector_training(model, self.objective)
        target.check_draft(model.dflash, model.config)
        if args.torch_compile:
            compile_decoder_layers(model, args.torch_compile_backend, args.torch_compile_mode)
        super().__init__(model=model, args=args, **kwargs)
        # The Hub token lives in memory only: training_args.bin and every other file stay token-free.
        self._hub_token, self.args.hub_token = self.args.hub_token, None
        self.target = target
        self.target_hub_id = target_hub_id
        self.recipe = recipe or {}
        # Sharded here, after the datasets were built with the whole target (rank 0 alone may run it
        # there, under main_process_first), so every later forward runs on every rank alike.
        check_target_sharding(target_sharding, self.args.spec_eval_prompts)
        if target_sharding == "fsdp" and not self.accelerator.even_batches:
            raise ValueError(
                "target_sharding: fsdp needs accelerator_config.even_batches: true (every rank must run the "
                "sharded target the same number of times)"
            )
        self.target.place(self.args.device, target_sharding)
        self._staging_parent: Path | None = None
        self.last_checkpoint: Path | None = None
        self.preemption = PreemptionCallback(self.args.process_index)
        self.add_callback(self.preemption)
        self._metric_sums: dict[str, MetricTerms] = {"train": {}, "eval": {}}
        self._selector_alpha: float | None = None
        if self.args.push_to_hub and self.args.hub_strategy == "every_save":
            self.add_callback(PushExportOnSaveCallback(self))
        if self.args.spec_eval_prompts > 0 and self.eval_dataset is not None:
            count = min(self.args.spec_eval_prompts, len(self.eval_dataset))
            prompts = [prompt_ids(self.eval_dataset[i]) for i in range(count)]
            stops = sorted(end_of_turn_ids(target.tokenizer)) if target.tokenizer is not None else None
            self.add_callback(SpeculativeEvalCallback(self, prompts, self.args.spec_eval_max_new_tokens, stops))

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The draft's layers are compiled in place (`trainer.compile`): accelerate must not compile
        the whole model again."""
        arguments = super()._build_accelerator_args(**kwargs)
        if self.args.torch_compile and "dynamo_plugin" in arguments:
            from accelerate.utils import TorchDynamoPlugin

            arguments["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return arguments

    # -- data: anchors and the global denominator of each optimizer step ------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if 0 < self.state.max_steps <= self.state.global_step:
            # Resumed from a checkpoint at max_steps: HF would run one step past it (it checks the
            # limit only after a step), so the resumed run would differ from the uninterrupted one.
            self.control.should_training_stop = True
            return [], None
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples:
            return batch_samples, None
        draft = self.accelerator.unwrap_model(self.model)
        draw = AnchorDraw(seed=self.args.seed, step=self.state.global_step, rank=self.args.process_index)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for micro_index, batch in enumerate(batch_samples):
            loss_mask = batch["loss_mask"]
            rows = loss_mask.shape[0]
            row_ids = micro_index * self.args.per_device_train_batch_size + torch.arange(rows, device=loss_mask.device)
            anchors, keep = sample_anchors(loss_mask, self.objective.num_anchors, draw, row_ids)
            blocks = build_blocks(
                batch["input_ids"], loss_mask, anchors, keep, draft.dflash.block_size, draft.dflash.mask_token_id
            )
            batch["anchors"], batch["anchor_keep"] = anchors, keep
            total = total + loss_denominator(blocks.weights, self.objective).to(device)
        total = self.accelerator.reduce(total, reduction="sum")
        for batch in batch_samples:
            batch["loss_denominator"] = total
        return batch_samples, None

    # -- loss -----------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        draft = self.accelerator.unwrap_model(model)
        result = self._objective(model, draft, inputs)
        mode = "train" if model.training else "eval"
        add_terms(self._metric_sums[mode], {k: (n.detach(), d.detach()) for k, (n, d) in result.terms.items()})
        if model.training and "loss_denominator" in inputs:
            denominator = inputs["loss_denominator"]
            loss = result.numerator * self.accelerator.num_processes / denominator.clamp(min=1e-12)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite DFlash2 loss at step {self.state.global_step}: {loss.item()}")
        else:
            loss = result.loss
        return (loss, None) if return_outputs else loss

    def _objective(self, model, draft: DFlashDraftModel, inputs: dict[str, Any]) -> ObjectiveResult:
        input_ids, loss_mask = inputs["input_ids"], inputs["loss_mask"]
        target_hidden, target_final = inputs.get("target_hidden"), inputs.get("target_final_hidden")
        distills = self.objective.distills
        if target_hidden is None:
            attention_mask = inputs.get("attention_mask")
            captured = self.target.capture(input_ids, attention_mask, draft.target_layer_ids, final_hidden=distills)
            target_hidden, target_final = captured if distills else (captured, None)
        elif distills and target_final is None:
            raise ValueError(
                "kd_weight > 0: the offline features hold no target final hidden states; "
                "build the datasets with final_hidden=True (train.py and prepare.py do for a distilling recipe)"
            )
        dtype = next(draft.parameters()).dtype
        if "anchors" in inputs:
            anchors = (inputs["anchors"], inputs["anchor_keep"])
        else:  # evaluation: deterministic anchors, by default at every valid position
            count = self.args.eval_num_anchors or loss_mask.shape[1]
            anchors = sample_anchors(loss_mask, count, draw=None)
        alpha = self.objective.selector_alpha
        if model.training:
            alpha = selector_alpha_at(self.state.global_step, self.state.max_steps, self.objective)
            self._selector_alpha = alpha
        return draft_objective(
            draft,
            input_ids,
            loss_mask,
            target_hidden.to(dtype),
            self.target.embedding_weight,
            self.target.lm_head,
            self.objective,
            draw=None,
            alpha=alpha,
            anchors=anchors,
            forward_module=model,
            target_final_hidden=target_final.to(dtype) if distills else None,
        )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- resuming -------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """HF `train`, plus: leftovers of interrupted saves are cleaned up first, `True` resumes from
        the newest *complete* checkpoint (or starts fresh when there is none), a named checkpoint
        is checked before use, and SIGTERM/SIGINT save a checkpoint and stop (`self.preemption`)."""
        if self.args.should_save:
            clean_leftovers(Path(self.args.output_dir))
        self.accelerator.wait_for_everyone()
        resume = self.resolve_resume(resume_from_checkpoint)
        self.preemption.install()
        try:
            return super().train(resume_from_checkpoint=resume, trial=trial, **kwargs)
        finally:
            self.preemption.uninstall()

    def resolve_resume(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """A checkpoint path to resume from, or None for a fresh start."""
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
            resume_from_checkpoint = resume_from_checkpoint.lower() == "true"
        if not resume_from_checkpoint:
            return None
        if resume_from_checkpoint is True:
            newest = newest_complete_checkpoint(Path(self.args.output_dir))
            if newest is None:
                logger.warning("No complete checkpoint in %s: training starts at step 0.", self.args.output_dir)
                return None
            logger.info("Resuming from %s", newest)
            return str(newest)
        check_resumable(Path(resume_from_checkpoint), needs_optimizer=not self.args.save_only_model)
        return str(resume_from_checkpoint)

    # -- saving ---------------------------------------------------------------------------------

    def _get_output_dir(self, trial) -> str:
        """While a checkpoint is being saved, HF's `_save_checkpoint` writes under the staging folder."""
        return str(self._staging_parent) if self._staging_parent is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """HF's checkpoint (draft, optimizer, scheduler, RNG, trainer state) written by every rank
        into a staging folder, then renamed to `checkpoint-N` with a completion manifest: a kill at
        any instant leaves either the whole checkpoint or none of it under its final name."""
        run_dir = Path(super()._get_output_dir(trial))
        step = self.state.global_step
        parent = staging_parent(run_dir, step)
        if self.args.should_save:
            shutil.rmtree(parent, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staging_parent = parent
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_parent = None
        self.accelerator.wait_for_everyone()
        final = run_dir / f"checkpoint-{step}"
        if self.args.should_save:
            staged = parent / final.name
            if self.state.best_model_checkpoint == str(staged):
                self.state.best_model_checkpoint = str(final)
                self.state.save_to_json(str(staged / "trainer_state.json"))
            publish_staged(staged, final, step)
            rotate(run_dir, self.args.save_total_limit, protected=[self.state.best_model_checkpoint])
        self.accelerator.wait_for_everyone()
        self.last_checkpoint = final

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every save writes the publishable draft (config.json, model.safetensors, the two modeling
        files, a correct auto_map) and the recipe as JSON. A checkpoint being staged is written in
        place; any other folder (the run's own, holding its checkpoints) gets each file replaced by
        one rename, so a kill never leaves a half-written draft behind."""
        output_dir = Path(output_dir or self.args.output_dir)
        if output_dir.parent.name.startswith(STAGING_PREFIX) or not self.args.should_save:
            self._write_draft(output_dir)
        else:
            replace_files_atomically(output_dir, self._write_draft)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _write_draft(self, directory: Path) -> None:
        """The draft files (rank 0 writes; under FSDP every rank joins the full-state-dict gather)."""
        if self.is_fsdp_enabled:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state_dict = get_model_state_dict(self.model, options=options)
            if self.args.should_save:
                self.accelerator.unwrap_model(self.model).save_pretrained(directory, state_dict=state_dict)
                torch.save(self.args, directory / "training_args.bin")
        else:
            super().save_model(str(directory), _internal_call=True)
        if self.args.should_save:
            (directory / RECIPE_FILE).write_text(json.dumps(self.recipe_record(), indent=2, default=str) + "\n")

    def save_state(self) -> None:
        """The run's trainer_state.json, replaced in one rename (HF writes it in place)."""
        if self.is_world_process_zero():
            path = Path(self.args.output_dir) / "trainer_state.json"
            write_file_atomically(path, lambda temporary: self.state.save_to_json(str(temporary)))

    def recipe_record(self) -> dict[str, Any]:
        """The whole recipe as JSON (what export and provenance read; never a pickle), secrets removed."""
        return remove_secrets(
            {
                "format": "dflash2-hub recipe",
                **self.recipe,
                "training_arguments": json.loads(self.args.to_json_string()),
            }
        )

    # -- publishing: exports only, never raw checkpoints -----------------------------------------

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer would upload the raw checkpoint here; pushes go through `push_to_hub` instead."""

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs):
        """Export the current draft (contract-validated) and publish it as one commit."""
        with tempfile.TemporaryDirectory() as scratch:
            return self.export_and_publish(Path(scratch) / "export", commit_message or "End of training")

    def draft_for_export(self):
        """A plain DFlash2DraftModel with the trained weights (gathered under FSDP, LoRA merged)."""
        if self.is_fsdp_enabled:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            plain = DFlash2DraftModel(self.accelerator.unwrap_model(self.model).config)
            plain.load_state_dict(state)
            return plain
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "merge_and_unload"):
            return copy.deepcopy(model).merge_and_unload()
        return model

    def export_and_publish(self, folder: Path, commit_message: str):
        draft = self.draft_for_export()
        if not self.is_world_process_zero():
            return None
        target = TargetDimensions(
            name=self.target_hub_id or self.target.source_name,
            hidden_size=self.target.hidden_size,
            vocab_size=self.target.vocab_rows,
            num_layers=self.target.num_layers,
        )
        evaluations = [log for log in self.state.log_history if "eval_loss" in log]
        record = {
            **self.recipe_record(),
            "global_step": self.state.global_step,
            "evaluation": evaluations[-1] if evaluations else None,
        }
        export_draft(draft, folder, target=target, record=record, expected_block_size=draft.dflash.block_size)
        repo_id = self.args.hub_model_id or Path(self.args.output_dir).name
        return publish(
            folder, repo_id, private=self.args.hub_private_repo, token=self._hub_token, commit_message=commit_message
        )

    # -- logging --------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the pooled metrics: `name` in training logs, `eval_name` next to `eval_loss`."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        sums = self._metric_sums[mode]
        if sums:
            names, pairs = flatten_terms(sums)
            pairs = self.accelerator.reduce(pairs.to(self.args.device), reduction="sum")
            prefix = "eval_" if mode == "eval" else ""
            logs.update({f"{prefix}{name}": value for name, value in ratios(names, pairs).items()})
            sums.clear()
        if mode == "train" and self._selector_alpha is not None and draft_has_selector(self.model):
            logs["selector_alpha"] = self._selector_alpha
        super().log(logs, start_time)


def draft_has_selector(model) -> bool:
    return getattr(model, "candidate_selector", None) is not None

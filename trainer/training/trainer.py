"""`DFlash2Trainer`: HF `Trainer` with the DFlash2 objective, exact pooling and draft-only saves.

Exact gradient accumulation. The loss of an optimizer step is `sum(numerators) / sum(denominators)`
over every micro-batch of the step on every rank. The denominator depends only on the sampled
anchors and the loss mask (`loss_denominator`), so `get_batch_samples` draws the anchors of all
micro-batches of the step up front, sums their denominators, all-reduces that sum, and
`compute_loss` returns `numerator * world_size / global_denominator`: summed over micro-batches by
backward and averaged over ranks by DDP/FSDP, that is exactly the pooled loss's gradient. Hence
`loss_is_scaled_for_ga = True` and no `labels` key.

Metrics are additive (numerator, denominator) pairs kept per mode and reduced across processes in
`log()`, so `tau_walk` in training and `eval_tau_walk` in evaluation are pooled exactly too. Every
sum is float32 as the objective returns it, whatever the precision (FSDP2's output cast is dropped:
`precision.leave_draft_outputs_uncast`), and float64 over a logging interval or an evaluation.

No non-finite step is ever saved. Before each optimizer step the gradient norm HF computes anyway
(global across ranks) and the step's losses are checked, with one scalar all-reduce when there
are several ranks, so every rank stops (or skips, `skip_nonfinite_steps`) at the same step; the
weights are checked once more before every checkpoint and the final save. Resume compares the
checkpoint's recorded recipe with the new run first (`trainer.training.resume_check`).

The private HF `Trainer` internals this class overrides or calls are listed, with what each is relied
on for, in `trainer.training.hf_hooks` (checked when a trainer is built); precision (`bf16`, `fp16`,
`tf32`) is applied here, at launch, by `trainer.training.precision`.
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
from transformers.trainer_pt_utils import LengthGroupedSampler

from modeling_dflash2 import DFlash2DraftModel, DFlashDraftModel
from trainer.data.chat import end_of_turn_ids
from trainer.data.dataset import THINKING_GROUPS
from trainer.data.packing import sample_lengths
from trainer.evaluation.report import SpeculativeEvalCallback, prompt_ids
from trainer.fileio import replace_files_atomically, reporting_disk_full, write_file_atomically
from trainer.models.compile import compile_decoder_layers
from trainer.models.target import FrozenTarget, check_target_sharding
from trainer.objective.blocks import AnchorDraw, build_blocks, sample_anchors
from trainer.objective.config import selector_alpha_at
from trainer.objective.loss import (
    ObjectiveResult,
    RowGroups,
    configure_selector_training,
    draft_objective,
    loss_denominator,
)
from trainer.objective.metrics import MetricTerms, accumulation_dtype, add_terms, flatten_terms, ratios
from trainer.publishing.contract import TargetDimensions
from trainer.publishing.export import RECIPE_FILE, export_draft, remove_secrets
from trainer.publishing.hub import PushExportOnSaveCallback, publish
from trainer.training import cpu_fsdp
from trainer.training.arguments import DFlashTrainingArguments
from trainer.training.checkpoints import (
    STAGING_PREFIX,
    check_resumable,
    clean_leftovers,
    newest_complete_checkpoint,
    publish_staged,
    rotate,
    staging_parent,
)
from trainer.training.hf_hooks import check_hooks
from trainer.training.output_dir import check_fresh_start
from trainer.training.precision import apply_at_launch, leave_draft_outputs_uncast
from trainer.training.preemption import PreemptionCallback
from trainer.training.resume_check import IDENTITY_KEY, apply_learning_rate, check_unchanged, run_identity

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
        check_hooks()  # the private Trainer internals relied on (trainer.training.hf_hooks)
        self.objective = args.objective_config()
        configure_selector_training(model, self.objective)
        target.check_draft(model.dflash, model.config)
        if args.torch_compile:
            compile_decoder_layers(model, args.torch_compile_backend, args.torch_compile_mode)
        apply_at_launch(args)  # before accelerate reads args.mixed_precision
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
        self._metric_sums: dict[str, MetricTerms] = {"train": {}, "eval": {}}  # float64 (accumulation_dtype)
        leave_draft_outputs_uncast(getattr(self.accelerator.state, "fsdp_plugin", None))  # before the draft is wrapped
        self._selector_alpha: float | None = None
        self._step_loss_finite: torch.Tensor | None = None  # of the micro-batches of the step in progress
        self.skipped_steps: list[int] = []
        self._identity: dict[str, Any] | None = None
        self._learning_rate_changed = False
        if self.args.push_to_hub and self.args.hub_strategy == "every_save":
            self.add_callback(PushExportOnSaveCallback(self))
        if self.args.spec_eval_prompts > 0 and self.eval_dataset is not None:
            count = min(self.args.spec_eval_prompts, len(self.eval_dataset))
            prompts = [prompt_ids(self.eval_dataset[i]) for i in range(count)]
            stops = sorted(end_of_turn_ids(target.tokenizer)) if target.tokenizer is not None else None
            self.add_callback(SpeculativeEvalCallback(self, prompts, self.args.spec_eval_max_new_tokens, stops))

    def create_accelerator_and_postprocess(self) -> None:
        """HF's accelerator, with FSDP2 forced on CPU ranks when `DFLASH2_FSDP2_ON_CPU` asks
        (`trainer.training.cpu_fsdp`): the first accelerator sets up accelerate's CPU state, the
        states are switched to FSDP2 consistently, and the Trainer's accelerator is built on them, so
        HF's FSDP post-processing and every later save and resume see FSDP as on GPUs. Otherwise a
        CPU run that asks for FSDP says in one line that accelerate trains it without sharding."""
        if cpu_fsdp.should_force(self.args):
            super().create_accelerator_and_postprocess()
            cpu_fsdp.force_fsdp2(self.accelerator.state, cpu_fsdp.fsdp_plugin_for(self.args))
        elif (warning := cpu_fsdp.fallback_warning(self.args)) and self.args.process_index == 0:
            logger.warning("%s", warning)
        super().create_accelerator_and_postprocess()

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The draft's layers are compiled in place (`trainer.models.compile`): accelerate must not compile
        the whole model again."""
        arguments = super()._build_accelerator_args(**kwargs)
        if self.args.torch_compile and "dynamo_plugin" in arguments:
            from accelerate.utils import TorchDynamoPlugin

            arguments["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return arguments

    # -- data: anchors and the global denominator of each optimizer step ------------------------

    def _get_train_sampler(self, train_dataset=None):
        """HF's sampler; `group_by_length` gets the samples' lengths from their Arrow column (HF would
        read every sample to measure it, an offline one with its features)."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy != "group_by_length" or dataset is None:
            return super()._get_train_sampler(train_dataset)
        batch = self.args.train_batch_size * self.args.gradient_accumulation_steps
        return LengthGroupedSampler(batch, lengths=sample_lengths(dataset))

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
            loss_mask, position_ids = batch["loss_mask"], batch.get("position_ids")
            rows = loss_mask.shape[0]
            row_ids = micro_index * self.args.per_device_train_batch_size + torch.arange(rows, device=loss_mask.device)
            anchors, keep = sample_anchors(loss_mask, self.objective.num_anchors, draw, row_ids, position_ids)
            settings = draft.dflash
            blocks = build_blocks(
                batch["input_ids"], loss_mask, anchors, keep, settings.block_size, settings.mask_token_id, position_ids
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
        wide = accumulation_dtype(self.args.device)  # counts over a logging interval can pass 2^24
        add_terms(
            self._metric_sums[mode],
            {k: (n.detach().to(wide), d.detach().to(wide)) for k, (n, d) in result.terms.items()},
        )
        if model.training and "loss_denominator" in inputs:
            denominator = inputs["loss_denominator"]
            loss = result.numerator * self.accelerator.num_processes / denominator.clamp(min=1e-12)
            finite = torch.isfinite(loss.detach())  # checked (one sync) before the optimizer step
            self._step_loss_finite = finite if self._step_loss_finite is None else self._step_loss_finite & finite
        else:
            loss = result.loss
        return (loss, None) if return_outputs else loss

    def _objective(self, model, draft: DFlashDraftModel, inputs: dict[str, Any]) -> ObjectiveResult:
        input_ids, loss_mask, position_ids = inputs["input_ids"], inputs["loss_mask"], inputs.get("position_ids")
        target_hidden, target_final = inputs.get("target_hidden"), inputs.get("target_final_hidden")
        distills = self.objective.distills
        if target_hidden is None:
            if position_ids is not None:
                self.target.check_packing(draft.target_layer_ids)  # once: refuses a target that mixes documents
            attention_mask = inputs.get("attention_mask")
            captured = self.target.capture(
                input_ids, attention_mask, draft.target_layer_ids, final_hidden=distills, position_ids=position_ids
            )
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
            anchors = sample_anchors(loss_mask, count, draw=None, position_ids=position_ids)
        row_groups = None
        if not model.training and "thinking" in inputs:  # per-mode metrics of a thinking mix (issue 34)
            row_groups = RowGroups(inputs["thinking"], THINKING_GROUPS)
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
            position_ids=position_ids,
            row_groups=row_groups,
        )

    # -- non-finite steps: never stepped into a checkpoint ----------------------------------------

    def _get_grad_norm(self, model, grad_norm=None):
        """HF's pre-step gradient norm, checked with the step's losses before the optimizer steps."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._check_step_is_finite(model, grad_norm)
        return grad_norm

    def _check_step_is_finite(self, model, grad_norm) -> None:
        """Stop (FloatingPointError) or skip (`skip_nonfinite_steps`) a step whose loss or gradient
        norm is not finite; every rank decides alike (the norm is global, the loss flags are
        all-reduced), and a skipped step drops its gradients so the optimizer leaves the weights and
        its own state untouched."""
        loss_finite, self._step_loss_finite = self._step_loss_finite, None
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        norm = torch.as_tensor(0.0 if norm is None else norm, dtype=torch.float32).to(self.args.device)
        bad_loss = torch.zeros((), device=self.args.device) if loss_finite is None else (~loss_finite).float()
        flags = torch.stack([bad_loss.to(self.args.device), (~torch.isfinite(norm)).float()])
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        loss_is_bad, norm_is_bad = (bool(flag) for flag in flags.tolist())
        if not (loss_is_bad or norm_is_bad):
            return
        step = self.state.global_step + 1
        what = "loss" if loss_is_bad else f"gradient norm ({norm.item():g})"
        limit = self.args.skip_nonfinite_steps
        if len(self.skipped_steps) < limit:
            self.skipped_steps.append(step)
            for parameter in model.parameters():
                parameter.grad = None  # torch optimizers skip parameters without a gradient: no update at all
            logger.warning(
                "non-finite %s at step %d: step skipped, weights and optimizer state unchanged (%d of at most %d, "
                "skip_nonfinite_steps)",
                what,
                step,
                len(self.skipped_steps),
                limit,
            )
            return
        skipped = f" after skipping {limit} step(s) (skip_nonfinite_steps: {limit})" if limit else ""
        raise FloatingPointError(f"non-finite {what} at step {step}{skipped}: {self._nothing_saved()}")

    def _last_good(self) -> str:
        """What a user still has when a save is refused or fails: the newest complete checkpoint."""
        good = self.last_checkpoint or newest_complete_checkpoint(Path(self.args.output_dir))
        return f"the last good checkpoint is {good}" if good else "there is no good checkpoint yet"

    def _nothing_saved(self) -> str:
        return f"no checkpoint saved; {self._last_good()}"

    def _weights_are_finite(self) -> bool:
        """One pass over this rank's parameters (its shards under FSDP) and one all-reduce."""
        flags = []
        for parameter in self.model.parameters():
            local = parameter.detach()
            local = local.to_local() if hasattr(local, "to_local") else local
            if local.is_floating_point() and local.numel():
                flags.append(torch.isfinite(local).all())
        bad = torch.zeros((), device=self.args.device)
        if flags:
            bad = (~torch.stack(flags).all()).float().to(self.args.device)
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return not bool(bad.item())

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- resuming -------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """HF `train`, plus: leftovers of interrupted saves are cleaned up first, `True` resumes from
        the newest *complete* checkpoint (or starts fresh when there is none), a named checkpoint
        is checked before use and against the new run (`trainer.training.resume_check`, before any weights
        load), and SIGTERM/SIGINT save a checkpoint and stop (`self.preemption`)."""
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
        """A checkpoint path to resume from (complete, and recorded with the same run), or None for a fresh start."""
        resume = self._resume_path(resume_from_checkpoint)
        if resume is not None:
            allowed = check_unchanged(Path(resume), self.recipe_record(), self.args.resume_allow_changes)
            self._learning_rate_changed = "learning_rate" in allowed
        return resume

    def _resume_path(self, resume_from_checkpoint: str | bool | None) -> str | None:
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
            resume_from_checkpoint = resume_from_checkpoint.lower() == "true"
        if not resume_from_checkpoint:
            return None
        if resume_from_checkpoint is True:
            newest = newest_complete_checkpoint(Path(self.args.output_dir))
            if newest is None:
                check_fresh_start(Path(self.args.output_dir))
                logger.warning("No complete checkpoint in %s: training starts at step 0.", self.args.output_dir)
                return None
            logger.info("Resuming from %s", newest)
            return str(newest)
        check_resumable(Path(resume_from_checkpoint), needs_optimizer=not self.args.save_only_model)
        return str(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """HF's load, then an allowed learning-rate change takes effect (the loaded states carry the old one)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self._learning_rate_changed:
            apply_learning_rate(self.optimizer, self.lr_scheduler, self.args.learning_rate)
            logger.warning(
                "learning_rate %s takes effect at step %d", self.args.learning_rate, self.state.global_step + 1
            )

    # -- saving ---------------------------------------------------------------------------------

    def _get_output_dir(self, trial) -> str:
        """While a checkpoint is being saved, HF's `_save_checkpoint` writes under the staging folder."""
        return str(self._staging_parent) if self._staging_parent is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """HF's checkpoint (draft, optimizer, scheduler, RNG, trainer state) written by every rank
        into a staging folder, then renamed to `checkpoint-N` with a completion manifest: a kill at
        any instant leaves either the whole checkpoint or none of it under its final name.

        Non-finite weights are never saved (nor do they rotate a good checkpoint away); a full disk
        is one line naming the checkpoint, the step and the one kept, with the staging folder
        removed (so the disk does not fill further) and rotation not run."""
        run_dir = Path(super()._get_output_dir(trial))
        step = self.state.global_step
        if not self._weights_are_finite():
            raise FloatingPointError(f"non-finite weights at step {step}: {self._nothing_saved()}")
        parent = staging_parent(run_dir, step)
        final = run_dir / f"checkpoint-{step}"
        kept = f"{self._last_good()} (kept; nothing was rotated away)"
        try:  # a full disk is recognised (it may probe the disk) before the staged files are removed
            with reporting_disk_full(f"the checkpoint of step {step}", final, kept=kept):
                self._save_checkpoint_staged(model, trial, run_dir, parent, final, step)
        except BaseException:
            if self.args.should_save:
                shutil.rmtree(parent, ignore_errors=True)
            raise
        if self.args.should_save:  # the checkpoint just saved is kept even when older than the newest one
            rotate(run_dir, self.args.save_total_limit, protected=[self.state.best_model_checkpoint, final])
        self.accelerator.wait_for_everyone()
        self.last_checkpoint = final

    def _save_checkpoint_staged(self, model, trial, run_dir: Path, parent: Path, final: Path, step: int) -> None:
        """HF's `_save_checkpoint` into `parent`, then published as `final` by the saving rank."""
        if self.args.should_save:
            shutil.rmtree(parent, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staging_parent = parent
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_parent = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            staged = parent / final.name
            if self.state.best_model_checkpoint == str(staged):
                self.state.best_model_checkpoint = str(final)
                self.state.save_to_json(str(staged / "trainer_state.json"))
            publish_staged(staged, final, step)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every save writes the publishable draft (config.json, model.safetensors, the two modeling
        files, a correct auto_map) and the recipe as JSON. A checkpoint being staged is written in
        place; any other folder (the run's own, holding its checkpoints) gets each file replaced by
        one rename, so a kill never leaves a half-written draft behind; non-finite weights are
        refused and a full disk leaves the previous files in place, in one line either way."""
        output_dir = Path(output_dir or self.args.output_dir)
        if output_dir.parent.name.startswith(STAGING_PREFIX):  # inside _save_checkpoint: checked there
            self._write_draft(output_dir)
        elif not self._weights_are_finite():
            raise FloatingPointError(
                f"non-finite weights after step {self.state.global_step}: the draft was not saved to {output_dir}; "
                f"{self._last_good()}"
            )
        elif not self.args.should_save:
            self._write_draft(output_dir)
        else:
            kept = f"the files there are the previous ones; {self._last_good()}"
            what = f"the draft of step {self.state.global_step} to"
            with reporting_disk_full(what, output_dir, kept=kept):
                replace_files_atomically(output_dir, self._write_draft)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _write_draft(self, directory: Path) -> None:
        """The draft files (rank 0 writes; under FSDP every rank joins the full-state-dict gather)."""
        if self.is_fsdp_enabled:
            state_dict = self._full_state_dict()
            if self.args.should_save:
                self.accelerator.unwrap_model(self.model).save_pretrained(directory, state_dict=state_dict)
                torch.save(self.args, directory / "training_args.bin")
        else:
            super().save_model(str(directory), _internal_call=True)
        if self.args.should_save:
            (directory / RECIPE_FILE).write_text(json.dumps(self.recipe_record(), indent=2, default=str) + "\n")

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The draft's whole state dict on CPU, gathered from its FSDP2 shards: a collective, so every
        rank must call it (the saving rank then writes it; the others drop their copy)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_state(self) -> None:
        """The run's trainer_state.json, replaced in one rename (HF writes it in place)."""
        if self.is_world_process_zero():
            path = Path(self.args.output_dir) / "trainer_state.json"
            with reporting_disk_full("the trainer state", path, kept="the previous trainer_state.json is kept"):
                write_file_atomically(path, lambda temporary: self.state.save_to_json(str(temporary)))

    def recipe_record(self) -> dict[str, Any]:
        """The whole recipe as JSON (what export and provenance read; never a pickle), secrets removed."""
        return remove_secrets(
            {
                "format": "dflash2-hub recipe",
                **self.recipe,
                "training_arguments": json.loads(self.args.to_json_string()),
                IDENTITY_KEY: self.run_identity(),
            }
        )

    def run_identity(self) -> dict[str, Any]:
        """Draft config, target and dataset fingerprints and world size (computed once per run)."""
        if self._identity is None:
            config = self.accelerator.unwrap_model(self.model).config
            self._identity = run_identity(config, self.target, self.train_dataset, self.args.world_size)
        return self._identity

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
            plain = DFlash2DraftModel(self.accelerator.unwrap_model(self.model).config)
            plain.load_state_dict(self._full_state_dict())
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

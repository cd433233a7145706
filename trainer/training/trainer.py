"""`DFlash2Trainer`: HF `Trainer` with the DFlash2 objective, exact pooling and draft-only saves.

It keeps the loss (`compute_loss`, exact over micro-batches and ranks: `trainer.training.pooling`,
hence `loss_is_scaled_for_ga = True` and no `labels` key) and what HF documents for overriding. The
rest lives beside it with its own tests: saves and resume in `checkpointing`, non-finite checks in
`finite`, exports in `exports`, callbacks in `callbacks`; the private HF internals still overridden
are listed, with why, in `hf_hooks` (checked when a trainer is built). The draft/target, sharding and
packing checks run once, before the datasets are built, in `trainer.training.run.train_run`.
"""

from __future__ import annotations

import logging
import tempfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import TrainOutput

from modeling_dflash2 import DFlashDraftModel
from trainer.data.dataset import THINKING_GROUPS
from trainer.data.packing import sample_lengths
from trainer.models.compile import compile_decoder_layers
from trainer.models.target import FrozenTarget
from trainer.objective.blocks import AnchorDraw
from trainer.objective.config import ObjectiveConfig, selector_alpha_at
from trainer.objective.loss import ObjectiveResult, RowGroups, configure_selector_training, draft_objective
from trainer.training import cpu_fsdp
from trainer.training.arguments import DFlashTrainingArguments
from trainer.training.callbacks import register_callbacks
from trainer.training.checkpointing import Checkpointing
from trainer.training.checkpoints import clean_leftovers
from trainer.training.exports import export_and_publish
from trainer.training.finite import NonFiniteSteps
from trainer.training.hf_hooks import check_hooks
from trainer.training.objective_inputs import batch_anchors, target_features
from trainer.training.output_dir import output_path
from trainer.training.pooling import PooledMetrics, draw_step_anchors
from trainer.training.precision import apply_at_launch, leave_draft_outputs_uncast

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)


class DFlash2Trainer(Trainer):
    loss_is_scaled_for_ga = True
    # narrower than HF's declarations: __init__ refuses other arguments and always gets a model
    args: DFlashTrainingArguments
    model: nn.Module

    def __init__(
        self,
        model: DFlashDraftModel | PeftModel,
        args: DFlashTrainingArguments,
        target: FrozenTarget,
        target_hub_id: str | None = None,
        recipe: dict[str, Any] | None = None,
        target_sharding: str = "none",
        **kwargs: Any,
    ):
        """`target` must already suit `model` (`FrozenTarget.check_draft`) and `target_sharding`
        (`check_target_sharding`): `train_run` checks both before it builds the datasets."""
        if not isinstance(args, DFlashTrainingArguments):
            raise TypeError("DFlash2Trainer needs DFlashTrainingArguments (objective settings live there).")
        check_hooks()  # the private Trainer internals relied on (trainer.training.hf_hooks)
        self.objective: ObjectiveConfig = args.objective_config()
        configure_selector_training(model, self.objective)
        if args.torch_compile:
            compile_decoder_layers(model, args.torch_compile_backend, args.torch_compile_mode)
        apply_at_launch(args)  # before accelerate reads args.mixed_precision
        super().__init__(model=model, args=args, **kwargs)
        # The Hub token lives in memory only: training_args.bin and every other file stay token-free.
        self.hub_token, self.args.hub_token = self.args.hub_token, None
        self.target = target
        self.target_hub_id = target_hub_id
        self.recipe = recipe or {}
        # Sharded here, after the datasets were built with the whole target (rank 0 alone may run it
        # there, under main_process_first), so every later forward runs on every rank alike.
        if target_sharding == "fsdp" and not self.accelerator.even_batches:
            raise ValueError(
                "target_sharding: fsdp needs accelerator_config.even_batches: true (every rank must run the "
                "sharded target the same number of times)"
            )
        self.target.place(self.args.device, target_sharding)
        self.checkpointing = Checkpointing(self)
        self.nonfinite = NonFiniteSteps(self.args.skip_nonfinite_steps, self.args.device, self.args.world_size)
        self.metrics = PooledMetrics(self.args.device)  # exact over micro-batches and ranks (trainer.training.pooling)
        leave_draft_outputs_uncast(getattr(self.accelerator.state, "fsdp_plugin", None))  # before the draft is wrapped
        self._selector_alpha: float | None = None
        self.preemption = register_callbacks(self)

    @property
    def last_checkpoint(self) -> Path | None:
        """The checkpoint this run saved last (what an interrupted run names)."""
        return self.checkpointing.last_checkpoint

    def create_accelerator_and_postprocess(self) -> None:
        """HF's accelerator, built on FSDP2 states on CPU ranks when `DFLASH2_FSDP2_ON_CPU` asks, so every
        save and resume sees FSDP as on GPUs; else a CPU run asking for FSDP is told it is not sharded
        (`trainer.training.cpu_fsdp`)."""
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
        draw = AnchorDraw(seed=self.args.seed, step=self.state.global_step, rank=self.args.process_index)
        settings = self.accelerator.unwrap_model(self.model).dflash
        rows = self.args.per_device_train_batch_size
        reduce = partial(self.accelerator.reduce, reduction="sum")
        draw_step_anchors(batch_samples, settings, self.objective, draw, rows, device, reduce)
        return batch_samples, None

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        draft = self.accelerator.unwrap_model(model)
        result = self._objective(model, draft, inputs)
        self.metrics.add("train" if model.training else "eval", result.terms)
        if model.training and "loss_denominator" in inputs:
            denominator = inputs["loss_denominator"]
            loss = result.numerator * self.accelerator.num_processes / denominator.clamp(min=1e-12)
            self.nonfinite.note_loss(loss)  # checked (one sync) before the optimizer step
        else:
            loss = result.loss
        return (loss, None) if return_outputs else loss

    def _objective(self, model, draft: DFlashDraftModel, inputs: dict[str, Any]) -> ObjectiveResult:
        distills = self.objective.distills
        target_hidden, target_final = target_features(self.target, inputs, draft.target_layer_ids, distills)
        dtype = next(draft.parameters()).dtype
        thinking = not model.training and "thinking" in inputs  # per-mode metrics of a thinking mix (issue 34)
        row_groups = RowGroups(inputs["thinking"], THINKING_GROUPS) if thinking else None
        alpha = self.objective.selector_alpha
        if model.training:
            alpha = selector_alpha_at(self.state.global_step, self.state.max_steps, self.objective)
            self._selector_alpha = alpha
        return draft_objective(
            draft,
            inputs["input_ids"],
            inputs["loss_mask"],
            target_hidden.to(dtype),
            self.target.embedding_weight,
            self.target.lm_head,
            self.objective,
            draw=None,
            alpha=alpha,
            anchors=batch_anchors(inputs, self.args.eval_num_anchors),
            forward_module=model,
            target_final_hidden=target_final.to(dtype) if distills and target_final is not None else None,
            position_ids=inputs.get("position_ids"),
            row_groups=row_groups,
        )

    def _get_grad_norm(self, model, grad_norm=None):
        """HF's pre-step gradient norm, checked with the step's losses before the optimizer steps."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        step = self.state.global_step + 1
        self.nonfinite.check(model.parameters(), grad_norm, step, self.checkpointing.nothing_saved)
        return grad_norm

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """HF `train`, plus: leftovers of interrupted saves are cleaned up first, `True` resumes from
        the newest *complete* checkpoint (or starts fresh when there is none), a named checkpoint
        is checked before use and against the new run (`trainer.training.resume_check`, before any weights
        load), and SIGTERM/SIGINT save a checkpoint and stop (`self.preemption`)."""
        if self.args.should_save:
            clean_leftovers(output_path(self.args))
        self.accelerator.wait_for_everyone()
        resume = self.checkpointing.resume_point(resume_from_checkpoint)
        self.preemption.install()
        try:
            result = super().train(
                resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        except BaseException:
            self.preemption.after_training(failed=True, world_size=self.args.world_size)
            raise
        self.preemption.after_training(failed=False, world_size=self.args.world_size)
        return result

    def _get_output_dir(self, trial) -> str:
        """While a checkpoint is being saved, HF's `_save_checkpoint` writes under the staging folder."""
        staging = self.checkpointing.staging
        return str(staging) if staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """HF's checkpoint, staged then renamed to `checkpoint-N` (`Checkpointing.save_checkpoint`)."""
        run_dir = Path(super()._get_output_dir(trial))
        self.checkpointing.save_checkpoint(run_dir, partial(super()._save_checkpoint, model, trial))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The publishable draft and the recipe as JSON (`Checkpointing.save_draft`), then a push
        when asked (HF's own saves from inside a checkpoint or a push pass `_internal_call`)."""
        self.checkpointing.save_draft(Path(output_dir) if output_dir else output_path(self.args))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def save_state(self) -> None:
        """The run's trainer_state.json, replaced in one rename (HF writes it in place)."""
        self.checkpointing.save_state()

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer would upload the raw checkpoint here; pushes go through `push_to_hub` instead."""

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Export the current draft (contract-validated) and publish it as one commit, with the run's
        own Hub settings (`hub_token`, `hub_private_repo`): HF's per-call arguments are not read."""
        with tempfile.TemporaryDirectory() as scratch:
            return export_and_publish(self, Path(scratch) / "export", commit_message or "End of training")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the pooled metrics: `name` in training logs, `eval_name` next to `eval_loss`."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        pooled = self.metrics.pop(mode, partial(self.accelerator.reduce, reduction="sum"))
        prefix = "eval_" if mode == "eval" else ""
        logs.update({f"{prefix}{name}": value for name, value in pooled.items()})
        has_selector = getattr(self.model, "candidate_selector", None) is not None
        if mode == "train" and self._selector_alpha is not None and has_selector:
            logs["selector_alpha"] = self._selector_alpha
        super().log(logs, start_time)

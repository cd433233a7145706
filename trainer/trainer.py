"""`DFlash2Trainer`: HF `Trainer` with the DFlash2 objective, exact pooling and draft-only saves.

Exact gradient accumulation. The loss of an optimizer step is `sum(numerators) / sum(denominators)`
over every micro-batch of the step on every rank. The denominator depends only on the sampled
anchors and the loss mask (`loss_denominator`), so `get_batch_samples` draws the anchors of all
micro-batches of the step up front, sums their denominators, all-reduces that sum, and
`compute_loss` returns `numerator * world_size / global_denominator`: summed over micro-batches by
backward and averaged over ranks by DDP/FSDP, that is exactly the pooled loss's gradient. Hence
`loss_is_scaled_for_ga = True` and no `labels` key (hf-integration.md §3).

Metrics are additive (numerator, denominator) pairs kept per mode and reduced across processes in
`log()`, so `tau_walk` in training and `eval_tau_walk` in evaluation are pooled exactly too.
"""

from __future__ import annotations

import copy
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from modeling_dflash2 import DFlash2DraftModel, DFlashDraftModel
from trainer.arguments import DFlashTrainingArguments
from trainer.blocks import AnchorDraw, build_blocks, sample_anchors
from trainer.data import end_of_turn_ids
from trainer.evaluation import SpeculativeEvalCallback, prompt_ids
from trainer.export import TargetDimensions, export_draft
from trainer.hub import PushExportOnSaveCallback, publish
from trainer.metrics import MetricTerms, add_terms
from trainer.objective import (
    ObjectiveResult,
    configure_selector_training,
    draft_objective,
    loss_denominator,
    selector_alpha_at,
)
from trainer.target import FrozenTarget

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
        **kwargs: Any,
    ):
        if not isinstance(args, DFlashTrainingArguments):
            raise TypeError("DFlash2Trainer needs DFlashTrainingArguments (objective settings live there).")
        self.objective = args.objective_config()
        configure_selector_training(model, self.objective)
        target.check_draft(model.dflash, model.config)
        super().__init__(model=model, args=args, **kwargs)
        # The Hub token lives in memory only: training_args.bin and every other file stay token-free.
        self._hub_token, self.args.hub_token = self.args.hub_token, None
        self.target = target
        self.target_hub_id = target_hub_id
        self.target.model.to(self.args.device)
        self._metric_sums: dict[str, MetricTerms] = {"train": {}, "eval": {}}
        self._selector_alpha: float | None = None
        if self.args.push_to_hub and self.args.hub_strategy == "every_save":
            self.add_callback(PushExportOnSaveCallback(self))
        if self.args.spec_eval_prompts > 0 and self.eval_dataset is not None:
            count = min(self.args.spec_eval_prompts, len(self.eval_dataset))
            prompts = [prompt_ids(self.eval_dataset[i]) for i in range(count)]
            stops = sorted(end_of_turn_ids(target.tokenizer)) if target.tokenizer is not None else None
            self.add_callback(SpeculativeEvalCallback(self, prompts, self.args.spec_eval_max_new_tokens, stops))

    # -- data: anchors and the global denominator of each optimizer step ------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
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
        target_hidden = inputs.get("target_hidden")
        if target_hidden is None:
            target_hidden = self.target.capture(input_ids, inputs.get("attention_mask"), draft.target_layer_ids)
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
        )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- saving ---------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every save writes the publishable draft: config.json, model.safetensors, the two modeling
        files and a correct auto_map. Under FSDP the full state dict is gathered by every rank
        (fresh CPU copies) and written by rank 0, whatever `fsdp_state_dict_type` the resume files use."""
        if not self.is_fsdp_enabled:
            super().save_model(output_dir, _internal_call)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        output_dir = output_dir or self.args.output_dir
        state_dict = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.args.should_save:
            self.accelerator.unwrap_model(self.model).save_pretrained(output_dir, state_dict=state_dict)
            torch.save(self.args, f"{output_dir}/training_args.bin")
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

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
            "training_arguments": json.loads(self.args.to_json_string()),
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
            names = sorted(sums)
            stacked = torch.stack([torch.stack([sums[name][0], sums[name][1]]).float() for name in names])
            stacked = self.accelerator.reduce(stacked.to(self.args.device), reduction="sum")
            prefix = "eval_" if mode == "eval" else ""
            for name, (numerator, denominator) in zip(names, stacked.tolist(), strict=True):
                if denominator > 0:
                    logs[f"{prefix}{name}"] = numerator / denominator
            sums.clear()
        if mode == "train" and self._selector_alpha is not None and draft_has_selector(self.model):
            logs["selector_alpha"] = self._selector_alpha
        super().log(logs, start_time)


def draft_has_selector(model) -> bool:
    return getattr(model, "candidate_selector", None) is not None

"""Exact pooling over the micro-batches of a step and over ranks: the step's anchors and metrics.

The loss of an optimizer step is `sum(numerators) / sum(denominators)` over every micro-batch of the
step on every rank. The denominator depends only on the sampled anchors and the loss mask
(`loss_denominator`), so `draw_step_anchors` draws the anchors of all micro-batches of the step up
front and sums their denominators; `DFlash2Trainer` all-reduces that sum and its `compute_loss`
returns `numerator * world_size / global_denominator`: summed over micro-batches by backward and
averaged over ranks by DDP/FSDP, that is exactly the pooled loss's gradient.

Metrics are additive (numerator, denominator) pairs kept per mode (`PooledMetrics`) and reduced
across processes when logged, so `tau_walk` in training and `eval_tau_walk` in evaluation are pooled
exactly too. Every sum is float32 as the objective returns it, whatever the precision (FSDP2's
output cast is dropped: `precision.leave_draft_outputs_uncast`), and float64 over a logging
interval or an evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.objective.blocks import AnchorDraw, build_blocks, sample_anchors
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import loss_denominator
from trainer.objective.metrics import MetricTerms, accumulation_dtype, add_terms, flatten_terms, ratios


def draw_step_anchors(
    batch_samples: list[dict[str, Any]],
    settings: Any,
    objective: ObjectiveConfig,
    draw: AnchorDraw,
    rows_per_batch: int,
    device: torch.device | str,
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Set `anchors`, `anchor_keep` and `loss_denominator` (the step's, summed on `device` over its
    micro-batches and over ranks by `reduce`) in every micro-batch of one optimizer step. Row ids count on across
    micro-batches, so the draw does not depend on how the step is split."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for micro_index, batch in enumerate(batch_samples):
        loss_mask, position_ids = batch["loss_mask"], batch.get("position_ids")
        rows = loss_mask.shape[0]
        row_ids = micro_index * rows_per_batch + torch.arange(rows, device=loss_mask.device)
        anchors, keep = sample_anchors(loss_mask, objective.num_anchors, draw, row_ids, position_ids)
        blocks = build_blocks(
            batch["input_ids"], loss_mask, anchors, keep, settings.block_size, settings.mask_token_id, position_ids
        )
        batch["anchors"], batch["anchor_keep"] = anchors, keep
        total = total + loss_denominator(blocks.weights, objective).to(device)
    total = reduce(total)
    for batch in batch_samples:
        batch["loss_denominator"] = total


class PooledMetrics:
    """Metric sums per mode ("train", "eval") since the last log, in float64 where the device has it."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self.wide = accumulation_dtype(torch.device(device))  # counts over a logging interval can pass 2^24
        self.sums: dict[str, MetricTerms] = {"train": {}, "eval": {}}

    def add(self, mode: str, terms: MetricTerms) -> None:
        wide = {name: (n.detach().to(self.wide), d.detach().to(self.wide)) for name, (n, d) in terms.items()}
        add_terms(self.sums[mode], wide)

    def pop(self, mode: str, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The pooled ratios of `mode` (each pair summed over ranks by `reduce`), the sums then cleared."""
        sums = self.sums[mode]
        if not sums:
            return {}
        names, pairs = flatten_terms(sums)
        pooled = ratios(names, reduce(pairs.to(self.device)))
        sums.clear()
        return pooled

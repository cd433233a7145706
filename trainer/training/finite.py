"""Non-finite steps and weights: what keeps a NaN or an infinity out of every save.

Before each optimizer step the step's losses and the gradient norm HF computes anyway (global across
ranks) are checked with one scalar all-reduce, so every rank stops (or skips, `skip_nonfinite_steps`)
at the same step. The weights are checked once more before every checkpoint and the final save
(`trainer.training.checkpointing`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def any_rank(flags: torch.Tensor, world_size: int) -> torch.Tensor:
    """`flags` (0/1) with each entry set when it is set on any rank: every rank then decides alike."""
    if world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return flags


def weights_are_finite(parameters: Iterable[torch.Tensor], device: torch.device | str, world_size: int) -> bool:
    """One pass over this rank's parameters (its shards under FSDP) and one all-reduce."""
    flags = []
    for parameter in parameters:
        local = parameter.detach()
        local = local.to_local() if hasattr(local, "to_local") else local
        if local.is_floating_point() and local.numel():
            flags.append(torch.isfinite(local).all())
    bad = torch.zeros((), device=device)
    if flags:
        bad = (~torch.stack(flags).all()).float().to(device)
    return not bool(any_rank(bad, world_size).item())


class NonFiniteSteps:
    """The finiteness of the step in progress: its micro-batches' losses are noted as they are
    computed, and the whole step is judged once, before the optimizer steps."""

    def __init__(self, skip_limit: int, device: torch.device | str, world_size: int) -> None:
        self.skip_limit = skip_limit
        self.device = device
        self.world_size = world_size
        self.loss_finite: torch.Tensor | None = None  # of the micro-batches of the step in progress
        self.skipped_steps: list[int] = []

    def note_loss(self, loss: torch.Tensor) -> None:
        """Remember whether a micro-batch's loss is finite (no sync here: checked once per step)."""
        finite = torch.isfinite(loss.detach())
        self.loss_finite = finite if self.loss_finite is None else self.loss_finite & finite

    def check(self, parameters: Iterable[torch.Tensor], grad_norm: Any, step: int, nothing_saved: Callable[[], str]):
        """Stop (FloatingPointError) or skip (`skip_nonfinite_steps`) step `step` when its loss or
        gradient norm is not finite; every rank decides alike (the norm is global, the loss flags are
        all-reduced), and a skipped step drops its gradients so the optimizer leaves the weights and
        its own state untouched."""
        loss_finite, self.loss_finite = self.loss_finite, None
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        norm = torch.as_tensor(0.0 if norm is None else norm, dtype=torch.float32).to(self.device)
        bad_loss = torch.zeros((), device=self.device) if loss_finite is None else (~loss_finite).float()
        flags = any_rank(torch.stack([bad_loss.to(self.device), (~torch.isfinite(norm)).float()]), self.world_size)
        loss_is_bad, norm_is_bad = (bool(flag) for flag in flags.tolist())
        if not (loss_is_bad or norm_is_bad):
            return
        what = "loss" if loss_is_bad else f"gradient norm ({norm.item():g})"
        limit = self.skip_limit
        if len(self.skipped_steps) < limit:
            self.skipped_steps.append(step)
            for parameter in parameters:
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
        raise FloatingPointError(f"non-finite {what} at step {step}{skipped}: {nothing_saved()}")

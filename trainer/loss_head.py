"""The LM head and the unary cross-entropy of one chunk, fused into one autograd Function.

The target's head W is frozen, so the only gradient the head needs is the one with respect to the
draft's hidden states, `grad_h = (pw * (softmax(u) - onehot) * du/dz) @ W`, and everything in it is
known during the forward pass once the position weights pw are. Forming it there means the
[rows, V] logits are never kept for backward and never recomputed: two GEMMs per chunk (logits and
grad_h) instead of three under activation checkpointing, and a peak memory of one chunk's logits
however many anchors there are. The same pass yields the metrics' top-K candidates and argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class HeadOutputs:
    """numerator = sum(pw * nll) (differentiable); the rest is detached: per-row nll, position
    weights, argmax, and the strict top-K (values, ids) of the transformed logits (None if K=0)."""

    numerator: torch.Tensor
    nll: torch.Tensor
    position_weights: torch.Tensor
    argmax: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None


class _FusedUnaryCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, position_weights_fn, multiplier, softcap, top_k):
        rows = torch.arange(labels.numel(), device=labels.device)
        with torch.no_grad():
            logits = F.linear(hidden, weight.to(hidden.dtype)).float()
            unary = logits * multiplier if multiplier != 1.0 else logits
            squashed = None
            if softcap is not None:
                squashed = torch.tanh(unary / softcap)
                unary = squashed * softcap
            log_normalizer = torch.logsumexp(unary, dim=-1)
            nll = log_normalizer - unary[rows, labels]
            weights = position_weights_fn(nll).to(nll.dtype)
            top = torch.topk(unary, top_k, dim=-1, sorted=True) if top_k else None
            argmax = top.indices[:, 0] if top is not None else unary.argmax(dim=-1)
            # d(sum pw * nll)/du = pw * (softmax(u) - onehot), built in place over the logits buffer
            gradient = unary.sub_(log_normalizer[:, None]).exp_()
            gradient[rows, labels] -= 1.0
            gradient.mul_(weights[:, None])
            if squashed is not None:
                gradient.mul_(1.0 - squashed.square_())
            if multiplier != 1.0:
                gradient.mul_(multiplier)
            grad_hidden = (gradient.to(hidden.dtype) @ weight.to(hidden.dtype)).to(hidden.dtype)
            numerator = (nll * weights).sum()
        ctx.save_for_backward(grad_hidden)
        outputs = (nll, weights, argmax) + ((top.values, top.indices) if top is not None else ())
        ctx.mark_non_differentiable(*outputs)
        return (numerator, *outputs)

    @staticmethod
    def backward(ctx, grad_numerator, *unused):
        (grad_hidden,) = ctx.saved_tensors
        return grad_numerator * grad_hidden, None, None, None, None, None, None


def fused_unary_cross_entropy(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    position_weights_fn: Callable[[torch.Tensor], torch.Tensor],
    multiplier: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
) -> HeadOutputs:
    """hidden [R, H], head_weight [V, H] (frozen), labels [R]; `position_weights_fn(nll) -> pw [R]`
    receives the detached per-row NLL (so D-PACE can weight by it)."""
    outputs = _FusedUnaryCrossEntropy.apply(
        hidden, head_weight.detach(), labels, position_weights_fn, multiplier, softcap, top_k
    )
    numerator, nll, weights, argmax = outputs[:4]
    top = (outputs[4], outputs[5]) if top_k else None
    return HeadOutputs(numerator=numerator, nll=nll, position_weights=weights, argmax=argmax, top=top)

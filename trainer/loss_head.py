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
    weights, argmax, the strict top-K (values, ids) of the transformed logits (None if K=0) and
    the gold token's transformed logit."""

    numerator: torch.Tensor
    nll: torch.Tensor
    position_weights: torch.Tensor
    argmax: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None
    gold: torch.Tensor | None = None  # the gold token's transformed logit per row


class _FusedUnaryCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, position_weights_fn, multiplier, softcap, top_k):
        with torch.no_grad():
            # Under autocast both GEMMs run in the autocast dtype and a 16-bit head is used as it is;
            # otherwise the head is cast to the hidden states' dtype (a [V, H] copy only if they differ).
            if not torch.is_autocast_enabled(hidden.device.type) and weight.dtype != hidden.dtype:
                weight = weight.to(hidden.dtype)
            logits = F.linear(hidden, weight)
            unary = logits if logits.dtype == torch.float32 else logits.float()
            if multiplier != 1.0:
                unary = unary * multiplier
            squashed = None
            if softcap is not None:
                squashed = torch.tanh(unary / softcap)
                unary = squashed * softcap
            columns = labels[:, None]
            gold = unary.gather(1, columns)[:, 0]
            top = torch.topk(unary, top_k, dim=-1, sorted=True) if top_k else None
            argmax = top.indices[:, 0] if top is not None else unary.argmax(dim=-1)
            # log-sum-exp by hand, reusing exp(u - max) as the softmax numerator of the gradient
            peak = top.values[:, :1] if top is not None else unary.amax(dim=-1, keepdim=True)
            exponentials = unary.sub_(peak).exp_()
            total = exponentials.sum(dim=-1, keepdim=True)
            log_normalizer = total.log()[:, 0] + peak[:, 0]
            nll = log_normalizer - gold
            weights = position_weights_fn(nll).to(nll.dtype)
            # d(sum pw * nll)/du = pw * (softmax(u) - onehot), built in place over the logits buffer
            gradient = exponentials.mul_(weights[:, None] / total)
            gradient.scatter_add_(1, columns, -weights[:, None])
            if squashed is not None:
                gradient.mul_(1.0 - squashed.square_())
            if multiplier != 1.0:
                gradient.mul_(multiplier)
            grad_hidden = (gradient.to(hidden.dtype) @ weight).to(hidden.dtype)
            numerator = (nll * weights).sum()
        ctx.save_for_backward(grad_hidden)
        ctx.set_materialize_grads(False)  # the detached outputs get no gradient: no zero tensors for them
        outputs = (nll, weights, argmax, gold) + ((top.values, top.indices) if top is not None else ())
        ctx.mark_non_differentiable(*outputs)
        return (numerator, *outputs)

    @staticmethod
    def backward(ctx, grad_numerator, *unused):
        (grad_hidden,) = ctx.saved_tensors
        grad = None if grad_numerator is None else grad_numerator * grad_hidden
        return grad, None, None, None, None, None, None


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
    numerator, nll, weights, argmax, gold = outputs[:5]
    top = (outputs[5], outputs[6]) if top_k else None
    return HeadOutputs(numerator=numerator, nll=nll, position_weights=weights, argmax=argmax, top=top, gold=gold)


class _CandidateUnary(torch.autograd.Function):
    """The candidates' transformed unary logits [..., K] as a function of the hidden states [..., H].

    Their values are the top-K the LM-head pass already computed (exactly the numbers the server's
    selector sees), so the forward does no work; the backward needs sum_k g_k du_k/dz_k W[id_k] per
    row, which one `embedding_bag` (weighted sum of K head rows) forms without the [rows, K, H]
    gather a dot-product formulation would keep or recompute."""

    @staticmethod
    def forward(ctx, hidden, values, weight, ids, multiplier, softcap):
        ctx.save_for_backward(values, weight, ids)
        ctx.multiplier, ctx.softcap, ctx.hidden_shape, ctx.hidden_dtype = (
            multiplier,
            softcap,
            hidden.shape,
            hidden.dtype,
        )
        return values.clone()

    @staticmethod
    def backward(ctx, grad_values):
        values, weight, ids = ctx.saved_tensors
        slope = grad_values * ctx.multiplier if ctx.multiplier != 1.0 else grad_values
        if ctx.softcap is not None:  # u = cap tanh(m z / cap): du/dz = m (1 - (u / cap)^2)
            slope = slope * (1.0 - (values / ctx.softcap).square())
        top_k = ids.shape[-1]
        grad_hidden = F.embedding_bag(
            ids.reshape(-1, top_k), weight, mode="sum", per_sample_weights=slope.reshape(-1, top_k).to(weight.dtype)
        )
        return grad_hidden.view(ctx.hidden_shape).to(ctx.hidden_dtype), None, None, None, None, None


def candidate_unary(
    hidden: torch.Tensor,
    values: torch.Tensor,
    head_weight: torch.Tensor,
    ids: torch.Tensor,
    multiplier: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """hidden [..., H]; `values` [..., K] the transformed logits of token `ids` [..., K] (computed by
    the LM-head pass); returns them differentiable with respect to `hidden`."""
    return _CandidateUnary.apply(hidden, values.detach(), head_weight.detach(), ids, multiplier, softcap)

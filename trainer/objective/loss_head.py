"""The LM head and the unary cross-entropy of one chunk, fused into one autograd Function.

The target's head W is frozen, so the only gradient the head needs is the one with respect to the
draft's hidden states, `grad_h = (pw * (softmax(u) - onehot) * du/dz) @ W`, and everything in it is
known during the forward pass once the position weights pw are. Forming it there means the
[rows, V] logits are never kept for backward and never recomputed: two GEMMs per chunk (logits and
grad_h) instead of three under activation checkpointing, and a peak memory of one chunk's logits
however many anchors there are. The same pass yields the metrics' top-K candidates and argmax.

Distillation (docs/objective.md §6) rides in the same pass: the teacher's logits for the chunk's rows
come from the target's final hidden states through the same head, so its [rows, V] distribution
exists for one chunk at a time and its gradient `T (q - p)` joins the cross-entropy's before the one
GEMM back to the hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class HeadOutputs:
    """numerator = sum(pw * loss) (differentiable), loss = (1 - kd_weight) * nll + kd_weight * kd; the
    rest is detached: per-row nll, position weights, argmax, the strict top-K (values, ids) of the
    transformed logits (None if K=0), the gold token's transformed logit and, with a teacher, the
    per-row distillation term (None without one)."""

    numerator: torch.Tensor
    nll: torch.Tensor
    position_weights: torch.Tensor
    argmax: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None
    gold: torch.Tensor  # the gold token's transformed logit per row
    kd: torch.Tensor | None = None  # T^2 * KL(teacher || draft) per row, both at temperature T


@dataclass(frozen=True)
class Distillation:
    """The teacher side of the distillation term: the target's final (post-norm) hidden states for
    the same rows, read by the same head, its mixing weight and its temperature."""

    teacher_hidden: torch.Tensor
    weight: float
    temperature: float


SIXTEEN_BIT = (torch.bfloat16, torch.float16)
# devices whose 16-bit GEMMs head_matmul forms in float32 (see there); a GPU's are native
EMULATED_16_BIT_GEMMS = ("cpu",)
# head rows turned into float32 at a time there: a copy of at most this many rows of W, never all of it
HEAD_ROWS_PER_SLICE = 8192


def head_matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """`left @ right`, one operand the head W [V, H] or its transpose, as a GPU forms it in the
    operands' dtype (the autocast dtype under autocast).

    A CPU without native 16-bit GEMMs emulates them: [256, 151936] @ [151936, 64] takes 15 s in
    bf16 and 0.3 s in float32 with the casts on this project's CI machine, which made the head three
    quarters of a CPU rehearsal of a bf16 recipe. There the 16-bit operands are multiplied in float32
    and the product rounded once to 16 bits, what a GPU's 16-bit GEMM computes (float32
    accumulation, one rounding of the output) up to the order of the additions, a slice of the
    vocabulary at a time so that W is never copied whole.
    """
    device = left.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else left.dtype
    if device not in EMULATED_16_BIT_GEMMS or dtype not in SIXTEEN_BIT:
        return left @ right
    left, right = left.to(dtype), right.to(dtype)
    with torch.autocast(device, enabled=False):
        if right.shape[0] >= right.shape[1]:  # [R, V] @ [V, H]: partial sums over vocabulary slices
            product = torch.zeros(left.shape[0], right.shape[1], dtype=torch.float32, device=left.device)
            for start in range(0, right.shape[0], HEAD_ROWS_PER_SLICE):
                rows = slice(start, start + HEAD_ROWS_PER_SLICE)
                product.addmm_(left[:, rows].float(), right[rows].float())
        else:  # [R, H] @ [H, V]: the logits of a vocabulary slice at a time
            wide = left.float()
            slices = range(0, right.shape[1], HEAD_ROWS_PER_SLICE)
            product = torch.cat([wide @ right[:, start : start + HEAD_ROWS_PER_SLICE].float() for start in slices], 1)
        return product.to(dtype)


def served_logits(
    hidden: torch.Tensor, weight: torch.Tensor, multiplier: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`softcap(m * hidden @ W.T)` [R, V] in float32 or wider, and tanh(.) when capped, for the
    gradient): the unary logits exactly as the server forms them."""
    logits = head_matmul(hidden, weight.t())
    unary = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    if multiplier != 1.0:
        unary = unary * multiplier
    squashed = None
    if softcap is not None:
        squashed = torch.tanh(unary / softcap)
        unary = squashed * softcap
    return unary, squashed


def _distillation(
    unary: torch.Tensor, weight: torch.Tensor, distillation: Distillation, multiplier: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row T^2 KL(p || q), and T * (q - p) = its gradient with respect to the draft's unary
    logits) with p = softmax(teacher / T), q = softmax(unary / T): three [R, V] buffers (log p,
    log q, p) beside the chunk's logits, all freed with the chunk."""
    temperature = distillation.temperature
    teacher, _ = served_logits(distillation.teacher_hidden.to(weight.dtype), weight, multiplier, softcap)
    log_p = teacher.div_(temperature)
    log_p.sub_(log_p.logsumexp(dim=-1, keepdim=True))
    log_q = unary / temperature
    log_q.sub_(log_q.logsumexp(dim=-1, keepdim=True))
    p = log_p.exp()
    # KL = sum p (log p - log q) as two row-wise dot products (no third [R, V] buffer), in fp32 even
    # under autocast, which would run einsum in 16 bits
    with torch.autocast(unary.device.type, enabled=False):
        kl = torch.einsum("rv,rv->r", p, log_p) - torch.einsum("rv,rv->r", p, log_q)
    del log_p, teacher
    gradient = log_q.exp_().sub_(p).mul_(temperature)
    return kl * temperature**2, gradient


class _FusedUnaryCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, position_weights_fn, multiplier, softcap, top_k, distillation):
        with torch.no_grad():
            # Under autocast both GEMMs run in the autocast dtype and a 16-bit head is used as it is;
            # otherwise the head is cast to the hidden states' dtype (a [V, H] copy only if they differ).
            if not torch.is_autocast_enabled(hidden.device.type) and weight.dtype != hidden.dtype:
                weight = weight.to(hidden.dtype)
            unary, squashed = served_logits(hidden, weight, multiplier, softcap)
            columns = labels[:, None]
            gold = unary.gather(1, columns)[:, 0]
            top = torch.topk(unary, top_k, dim=-1, sorted=True) if top_k else None
            argmax = top.indices[:, 0] if top is not None else unary.argmax(dim=-1)
            kd = kd_gradient = None
            if distillation is not None:  # before the logits buffer is reused below
                kd, kd_gradient = _distillation(unary, weight, distillation, multiplier, softcap)
            ce_share = 1.0 - distillation.weight if distillation is not None else 1.0
            # log-sum-exp by hand, reusing exp(u - max) as the softmax numerator of the gradient
            peak = top.values[:, :1] if top is not None else unary.amax(dim=-1, keepdim=True)
            exponentials = unary.sub_(peak).exp_()
            total = exponentials.sum(dim=-1, keepdim=True)
            log_normalizer = total.log()[:, 0] + peak[:, 0]
            nll = log_normalizer - gold
            weights = position_weights_fn(nll).to(nll.dtype)
            row_loss = nll if kd is None else ce_share * nll + distillation.weight * kd
            # d(sum pw * loss)/du = pw * ((1 - w) (softmax(u) - onehot) + w T (q - p)), built in place
            # over the logits buffer
            ce_weights = weights * ce_share
            gradient = exponentials.mul_(ce_weights[:, None] / total)
            gradient.scatter_add_(1, columns, -ce_weights[:, None])
            if kd_gradient is not None:
                gradient.add_(kd_gradient.mul_((weights * distillation.weight)[:, None]))
                del kd_gradient
            if squashed is not None:
                gradient.mul_(1.0 - squashed.square_())
            if multiplier != 1.0:
                gradient.mul_(multiplier)
            grad_hidden = head_matmul(gradient.to(hidden.dtype), weight).to(hidden.dtype)
            numerator = (row_loss * weights).sum()
        ctx.save_for_backward(grad_hidden)
        ctx.set_materialize_grads(False)  # the detached outputs get no gradient: no zero tensors for them
        outputs = (nll, weights, argmax, gold) + ((kd,) if kd is not None else ())
        outputs += (top.values, top.indices) if top is not None else ()
        ctx.mark_non_differentiable(*outputs)
        return (numerator, *outputs)

    @staticmethod
    def backward(ctx, grad_numerator, *unused):
        (grad_hidden,) = ctx.saved_tensors
        grad = None if grad_numerator is None else grad_numerator * grad_hidden
        return grad, None, None, None, None, None, None, None


def fused_unary_cross_entropy(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    position_weights_fn: Callable[[torch.Tensor], torch.Tensor],
    multiplier: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
    distillation: Distillation | None = None,
) -> HeadOutputs:
    """hidden [R, H], head_weight [V, H] (frozen), labels [R]; `position_weights_fn(nll) -> pw [R]`
    receives the detached per-row NLL (so D-PACE can weight by it). With `distillation` (teacher
    hidden states [R, H]) each row's loss mixes the NLL with the distillation term."""
    outputs = _FusedUnaryCrossEntropy.apply(
        hidden, head_weight.detach(), labels, position_weights_fn, multiplier, softcap, top_k, distillation
    )
    numerator, nll, weights, argmax, gold = outputs[:5]
    rest = list(outputs[5:])
    kd = rest.pop(0) if distillation is not None else None
    top = (rest[0], rest[1]) if top_k else None
    return HeadOutputs(numerator=numerator, nll=nll, position_weights=weights, argmax=argmax, top=top, gold=gold, kd=kd)


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

"""The DFlash / DFlash2 training objective (objective.md §6-8).

Base loss: cross-entropy on the served unary logits `softcap(m * z)` with position weights
(gamma decay `exp(-(k-1)/gamma)`, or D-PACE), in numerator and denominator. DFlash2 adds the
selector's teacher-forced cross-entropy over the strict unary top-K, weighted like the base loss
and added over the base denominator with `alpha_eff`:

    loss = (sum l_base * w_pos + alpha_eff * sum l_selector * w_sel) / normaliser

with w_pos the position weight (decay or D-PACE), w_sel = w_pos on slots whose gold is a candidate,
and the normaliser sum w * decay (CE) or sum w (D-PACE): see `loss_denominator`.

The LM head runs in chunks of blocks, fused with the cross-entropy (`trainer.loss_head`: the
gradient is formed in the forward pass, so no chunk's logits outlive it), and the selector term
runs under activation checkpointing, so peak memory does not grow with N * B * V. Everything is
returned as additive (numerator, denominator) pairs that pool exactly across chunks,
micro-batches and ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from modeling_dflash2 import DFlashDraftModel, unary_transform
from trainer.blocks import AnchorDraw, BlockBatch, build_blocks, sample_anchors
from trainer.loss_head import fused_unary_cross_entropy
from trainer.masks import attention_masks
from trainer.metrics import MetricTerms, add_terms, selector_terms, unary_terms

LOSS_TYPES = ("ce", "dpace")
DPACE_WEIGHTINGS = ("full", "prefix", "suffix")
SELECTOR_GOLD_MODES = ("skip", "insert")


def default_gamma(block_size: int) -> float | None:
    """gamma 7 for B = 16 and 4 for B = 8 (the published recipes); no decay otherwise."""
    return {16: 7.0, 8: 4.0}.get(block_size)


@dataclass
class ObjectiveConfig:
    """Knobs of the objective. Defaults follow objective.md where it names one.

    gamma: decay constant; None picks `default_gamma(block_size)`, 0 disables decay.
    loss_type: "ce" (gamma-decayed CE) or "dpace" (dynamic position-aware CE, weight `dpace_weighting`:
        "full" = W_k, "prefix" = P_k, "suffix" = W_k / P_k).
    chunk_blocks: blocks per LM-head chunk.
    selector_alpha / selector_warmup_ratio / selector_ramp_ratio: the selector weight schedule.
    selector_gold: "skip" (gold outside the strict top-K gets weight 0, as serving never injects
        gold) or "insert" (gold replaces the weakest candidate, training only).
    selector_stop_gradient: the selector term does not reach the backbone.
    """

    num_anchors: int = 512
    loss_type: str = "ce"
    gamma: float | None = None
    dpace_alpha: float = 0.5
    dpace_weighting: str = "full"
    chunk_blocks: int = 16
    selector_alpha: float = 1.0
    selector_warmup_ratio: float = 0.0
    selector_ramp_ratio: float = 0.0
    selector_gold: str = "skip"
    selector_stop_gradient: bool = False

    def __post_init__(self) -> None:
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1 (got {self.num_anchors}).")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES} (got {self.loss_type!r}).")
        if self.dpace_weighting not in DPACE_WEIGHTINGS:
            raise ValueError(f"dpace_weighting must be one of {DPACE_WEIGHTINGS} (got {self.dpace_weighting!r}).")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in [0, 1] (got {self.dpace_alpha}).")
        if self.gamma is not None and not math.isfinite(self.gamma):
            raise ValueError(f"gamma must be finite (got {self.gamma}).")
        if self.chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1 (got {self.chunk_blocks}).")
        if not math.isfinite(self.selector_alpha) or self.selector_alpha < 0:
            raise ValueError(f"selector_alpha must be finite and >= 0 (got {self.selector_alpha}).")
        for name in ("selector_warmup_ratio", "selector_ramp_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1] (got {value}).")
        if self.selector_gold not in SELECTOR_GOLD_MODES:
            raise ValueError(f"selector_gold must be one of {SELECTOR_GOLD_MODES} (got {self.selector_gold!r}).")

    def resolved_gamma(self, block_size: int) -> float | None:
        gamma = default_gamma(block_size) if self.gamma is None else self.gamma
        return gamma if gamma is not None and gamma > 0 else None

    @property
    def selector_enabled(self) -> bool:
        """Configured alpha == 0 freezes the selector and skips its term."""
        return self.selector_alpha > 0


def selector_alpha_at(step: int | None, total_steps: int | None, config: ObjectiveConfig) -> float:
    """alpha_eff: 0 during warmup, a linear ramp, then alpha; alpha itself with no step context.

    warm = floor(T * warmup), ramp = floor(T * ramp); alpha * clamp((step - warm + 1) / ramp, 0, 1).
    """
    alpha = config.selector_alpha
    if step is None or total_steps is None:
        return alpha
    warm = math.floor(total_steps * config.selector_warmup_ratio)
    ramp = math.floor(total_steps * config.selector_ramp_ratio)
    if step < warm:
        return 0.0
    if ramp <= 0:
        return alpha
    return alpha * min(max((step - warm + 1) / ramp, 0.0), 1.0)


def decay_weights(block_size: int, gamma: float | None, device: torch.device | None = None) -> torch.Tensor:
    """[B] position weights exp(-(k - 1) / gamma) for k >= 1 (slot 0 is never scored)."""
    slots = torch.arange(block_size, device=device, dtype=torch.float32)
    if gamma is None:
        return torch.ones(block_size, device=device)
    return torch.exp(-(slots - 1).clamp(min=0) / gamma)


def dpace_weights(nll: torch.Tensor, weights: torch.Tensor, alpha: float, weighting: str = "full") -> torch.Tensor:
    """D-PACE position weights for [blocks, B] per-slot NLL (detached) and binary weights.

    s_k = (1 - alpha) exp(-l_k) + alpha (1 where w_k = 0); P_k = prod_{i<=k} s_i;
    W_k = sum_{j>=k} P_j w_j. "full" -> W_k, "prefix" -> P_k, "suffix" -> W_k / P_k.
    """
    nll = nll.detach()
    step = torch.where(weights > 0, (1 - alpha) * torch.exp(-nll) + alpha, torch.ones_like(nll))
    prefix = torch.cumprod(step, dim=-1)
    suffix = torch.flip(torch.cumsum(torch.flip(prefix * weights, [-1]), dim=-1), [-1])
    if weighting == "prefix":
        return prefix
    if weighting == "suffix":
        return suffix / prefix
    return suffix


@dataclass
class ObjectiveResult:
    """loss = numerator / denominator for this batch; pool numerator and denominator (not loss)
    across micro-batches and ranks. `terms` holds additive metric pairs; `alpha` is alpha_eff."""

    loss: torch.Tensor
    numerator: torch.Tensor
    denominator: torch.Tensor
    terms: MetricTerms = field(default_factory=dict)
    alpha: float = 0.0

    def as_dict(self) -> dict:
        """A plain nested dict (a pytree DDP/FSDP2 can see through) of the same values."""
        return dict(self.__dict__)


class _ChunkObjective:
    """Losses and metrics of one chunk of blocks [c, B]; slot 0 (the anchor) is never scored, so the
    LM head runs on slots 1..B-1 only."""

    def __init__(self, draft: DFlashDraftModel, head_weight: torch.Tensor, config: ObjectiveConfig, decay, selector):
        self.draft, self.head_weight, self.config, self.decay = draft, head_weight, config, decay
        self.selector = selector  # the DFlash2 candidate selector, or None (DFlash v1 / alpha = 0)

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
        chunk, block = labels.shape
        proposal_hidden, gold, proposal_weights = hidden[:, 1:], labels[:, 1:], weights[:, 1:]

        def position_weights(nll: torch.Tensor) -> torch.Tensor:
            if self.config.loss_type == "dpace":
                full = torch.cat([nll.new_zeros(chunk, 1), nll.view(chunk, block - 1)], dim=1)
                dpace = dpace_weights(full, weights, self.config.dpace_alpha, self.config.dpace_weighting)
                return (weights * dpace)[:, 1:].reshape(-1)
            return (proposal_weights * self.decay[1:]).reshape(-1)

        settings = self.draft.dflash
        head = fused_unary_cross_entropy(
            proposal_hidden.reshape(-1, proposal_hidden.shape[-1]),
            self.head_weight,
            gold.reshape(-1),
            position_weights,
            settings.output_multiplier,
            settings.final_logit_softcapping,
            self.selector.top_k if self.selector is not None else 0,
        )
        shape = (chunk, block - 1)
        nll, predicted = head.nll.view(shape), head.argmax.view(shape)
        selector_numerator, selector_parts = hidden.new_zeros((), dtype=torch.float32), None
        if self.selector is not None:
            top = (head.top[0].view(*shape, -1), head.top[1].view(*shape, -1))
            selector_numerator, selector_parts = self._selector_loss(
                proposal_hidden, labels, head.position_weights.view(shape), top
            )
        with torch.no_grad():
            terms = self._metrics(hidden.detach(), labels, weights, nll, predicted, selector_parts)
        return head.numerator, selector_numerator, terms

    def _candidate_unary(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Transformed logits of the ids [..., K] from K rows of the head, not from the [rows, V] logits."""
        logits = torch.einsum("...h,...kh->...k", hidden, self.head_weight[ids].to(hidden.dtype))
        settings = self.draft.dflash
        return unary_transform(logits, settings.output_multiplier, settings.final_logit_softcapping)

    def _selector_loss(self, proposal_hidden, labels, position_weight, top):
        gold, predecessors = labels[:, 1:], labels[:, :-1]  # slot 1's predecessor is the anchor
        candidate_ids = top[1]
        covered = (candidate_ids == gold[..., None]).any(dim=-1)
        if self.config.selector_gold == "insert":  # gold replaces the weakest candidate
            weakest = torch.zeros_like(candidate_ids, dtype=torch.bool)
            weakest[..., -1] = True
            candidate_ids = torch.where(weakest & ~covered[..., None], gold[..., None], candidate_ids)
            selector_weight = position_weight
        else:
            selector_weight = position_weight * covered
        gold_index = (candidate_ids == gold[..., None]).float().argmax(dim=-1, keepdim=True)

        def numerator(hidden):
            if self.config.selector_stop_gradient:
                hidden = hidden.detach()
            candidate_unary = self._candidate_unary(hidden, candidate_ids)
            scores = self.selector.score_candidates(hidden, candidate_ids, candidate_unary, predecessors).scores
            cross_entropy = torch.logsumexp(scores, dim=-1) - scores.gather(-1, gold_index)[..., 0]
            return (cross_entropy * selector_weight).sum(), scores.detach()

        if torch.is_grad_enabled():  # [rows, K, r] gathers are recomputed rather than kept for backward
            total, scores = checkpoint(numerator, proposal_hidden, use_reentrant=False)
        else:
            total, scores = numerator(proposal_hidden)
        return total, (scores, gold_index[..., 0], covered, top)

    def _metrics(self, hidden, labels, weights, nll, predicted, selector_parts) -> MetricTerms:
        full_prediction = torch.cat([labels[:, :1], predicted], dim=1)  # slot 0 is never scored
        terms = unary_terms(full_prediction, labels, weights)
        terms["loss_base_unweighted"] = ((nll * weights[:, 1:]).sum(), weights.sum())
        if selector_parts is not None:
            scores, gold_index, covered, top = selector_parts
            walk = self.selector.walk(hidden[:, 1:], None, labels[:, 0], candidates=top)
            terms.update(
                selector_terms(
                    covered=covered,
                    selector_correct=scores.argmax(dim=-1) == gold_index,
                    unary_correct=predicted == labels[:, 1:],
                    walk_correct=walk.tokens == labels[:, 1:],
                    weights=weights[:, 1:],
                )
            )
        return terms


def loss_denominator(weights: torch.Tensor, config: ObjectiveConfig) -> torch.Tensor:
    """The loss normaliser, a function of the block weights [..., B] alone, so a trainer can pool it
    over micro-batches and ranks before any forward pass: sum w * decay for CE, and the number of
    supervised slots sum w for D-PACE (whose own weights depend on the model)."""
    if config.loss_type == "dpace":
        return weights.sum().float()
    block_size = weights.shape[-1]
    decay = decay_weights(block_size, config.resolved_gamma(block_size), weights.device)
    return (weights * decay).sum().float()


def head_weight(output_head: nn.Module | torch.Tensor) -> torch.Tensor:
    """The target LM head as its (detached) weight matrix [V, H]; a module must be frozen and bias-free."""
    if isinstance(output_head, torch.Tensor):
        return output_head.detach()
    if any(parameter.requires_grad for parameter in output_head.parameters()):
        raise ValueError("The target LM head must be frozen (requires_grad=False): it is served from the target.")
    weight = getattr(output_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or getattr(output_head, "bias", None) is not None:
        raise ValueError(f"The target LM head must be a bias-free linear layer; got {type(output_head).__name__}.")
    return weight.detach()


def configure_selector_training(draft: DFlashDraftModel, config: ObjectiveConfig) -> None:
    """Configured alpha == 0: freeze the selector so it stays out of the optimizer."""
    selector = getattr(draft, "candidate_selector", None)
    if selector is not None:
        selector.requires_grad_(config.selector_enabled)


def dflash_loss(
    draft: DFlashDraftModel,
    hidden: torch.Tensor,
    blocks: BlockBatch,
    output_head: nn.Module | torch.Tensor,
    config: ObjectiveConfig,
    alpha: float | None = None,
) -> ObjectiveResult:
    """Objective for draft outputs `hidden` [b, N*B, H] of the packed `blocks`.

    `alpha` is alpha_eff (see `selector_alpha_at`); None means the configured alpha. With DFlash2
    and alpha > 0 configured, the selector term is always computed and multiplied by alpha_eff, so
    every selector parameter stays in the graph (zero gradients during warmup).
    """
    block_size = blocks.block_size
    weight = head_weight(output_head)
    alpha_eff = config.selector_alpha if alpha is None else alpha
    with_selector = bool(draft.dflash.is_dflash2 and config.selector_enabled)
    labels = blocks.labels.reshape(-1, block_size)
    weights = blocks.weights.reshape(-1, block_size)
    flat_hidden = hidden.reshape(-1, block_size, hidden.shape[-1])
    # Blocks with nothing to score (dummy slots, fully unsupervised) cost no LM-head work; if no
    # block is active one zero-weight block still runs so the graph (and every parameter) is kept.
    active = weights.sum(dim=-1) > 0
    if not active.any():
        active[0] = True
    index = active.nonzero()[:, 0]
    flat_hidden, labels, weights = flat_hidden[index], labels[index], weights[index]

    decay = decay_weights(block_size, config.resolved_gamma(block_size), hidden.device)
    numerator = hidden.new_zeros((), dtype=torch.float32)
    selector_numerator = hidden.new_zeros((), dtype=torch.float32)
    terms: MetricTerms = {}
    chunk_objective = _ChunkObjective(draft, weight, config, decay, draft.candidate_selector if with_selector else None)
    for start in range(0, index.numel(), config.chunk_blocks):
        chunk = slice(start, start + config.chunk_blocks)
        base, selector, chunk_terms = chunk_objective(flat_hidden[chunk], labels[chunk], weights[chunk])
        numerator = numerator + base
        selector_numerator = selector_numerator + selector
        add_terms(terms, chunk_terms)
    denominator = loss_denominator(blocks.weights, config)

    total = numerator + alpha_eff * selector_numerator
    loss = torch.where(denominator > 0, total / denominator.clamp(min=1e-12), total * 0.0)
    terms["loss"] = (total.detach(), denominator.detach())
    terms["loss_base"] = (numerator.detach(), denominator.detach())
    if with_selector:
        terms["loss_selector"] = (selector_numerator.detach(), denominator.detach())
    return ObjectiveResult(loss=loss, numerator=total, denominator=denominator, terms=terms, alpha=alpha_eff)


def embed_draft_ids(embedding_weight: torch.Tensor, draft_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Noise embedding from the frozen target embedding (never a gradient path)."""
    with torch.no_grad():
        return F.embedding(draft_ids, embedding_weight) * scale


def draft_objective(
    draft: DFlashDraftModel,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    target_hidden: torch.Tensor,
    embedding_weight: torch.Tensor,
    output_head: nn.Module | torch.Tensor,
    config: ObjectiveConfig,
    draw: AnchorDraw | None,
    alpha: float | None = None,
    row_ids: torch.Tensor | None = None,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    forward_module: nn.Module | None = None,
) -> ObjectiveResult:
    """One batch end to end: anchors -> blocks -> masks -> draft forward -> objective.

    input_ids, loss_mask [b, S]; target_hidden [b, S, n*H]. Anchors come from `anchors`
    ((anchors, keep), e.g. drawn ahead by a trainer) or are drawn here with `draw`; `draw=None`
    takes every valid position in order (evaluation). `forward_module` is the (possibly DDP/FSDP
    wrapped) module to call; the objective runs inside its forward.
    """
    settings = draft.dflash
    if anchors is None:
        anchors = sample_anchors(loss_mask, config.num_anchors, draw, row_ids)
    blocks = build_blocks(input_ids, loss_mask, *anchors, settings.block_size, settings.mask_token_id)
    backend = draft.config._attn_implementation or "sdpa"
    masks = attention_masks(blocks, settings, "flex_attention" if backend == "flex_attention" else "sdpa")
    noise = embed_draft_ids(embedding_weight, blocks.draft_ids, settings.input_embedding_scale)
    outputs = (forward_module or draft)(
        position_ids=blocks.model_position_ids(),
        noise_embedding=noise.to(target_hidden.dtype),
        target_hidden=target_hidden,
        attention_mask=masks,
        output_transform=lambda hidden: dflash_loss(draft, hidden, blocks, output_head, config, alpha).as_dict(),
    )
    return ObjectiveResult(**outputs)

"""The DFlash / DFlash2 training objective (docs/objective.md).

Base loss: cross-entropy on the served unary logits `softcap(m * z)` with position weights
(gamma decay `exp(-(k-1)/gamma)`, or D-PACE), in numerator and denominator; with distillation each
slot's loss is `(1 - w) CE + w T^2 KL(target || draft)`, the target's distribution read from its
final hidden states at the position before the slot. DFlash2 adds the
selector's teacher-forced cross-entropy over the strict unary top-K, weighted like the base loss
and added over the base denominator with `alpha_eff`:

    loss = (sum l_base * w_pos + alpha_eff * sum l_selector * w_sel) / normaliser

with w_pos the position weight (decay or D-PACE), w_sel = w_pos on slots whose gold is a candidate,
and the normaliser sum w * decay (CE) or sum w (D-PACE): see `loss_denominator`.

The LM head runs in chunks of blocks, fused with the cross-entropy (`trainer.objective.loss_head`: the
gradient is formed in the forward pass, so no chunk's logits outlive it), and the selector term
runs under activation checkpointing, so peak memory does not grow with N * B * V. Everything is
returned as additive (numerator, denominator) pairs that pool exactly across chunks,
micro-batches and ranks: every sum is float32, whatever precision the draft ran in (bf16 autocast or
an FSDP2 bf16 policy make the per-token terms bf16-derived, never their sums), and `draft_objective`
refuses a sum that comes back narrower (`metrics.check_pooled`), e.g. cast by a wrapper's output policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from modeling_dflash2 import DFlash2CandidateSelector, DFlashDraftModel, join_lattices
from trainer.objective.blocks import AnchorDraw, BlockBatch, build_blocks, sample_anchors
from trainer.objective.config import ObjectiveConfig, selector_chunk_blocks
from trainer.objective.loss_head import Distillation, HeadOutputs, candidate_unary, fused_unary_cross_entropy
from trainer.objective.masks import attention_masks
from trainer.objective.metrics import MetricTerms, check_pooled, pooled_sums, selector_terms, unary_terms

OBJECTIVE_LABEL = "dflash2::objective"  # profiler label: LM head, losses and metrics inside the draft forward


def decay_weights(block_size: int, gamma: float | None, device: torch.device | None = None) -> torch.Tensor:
    """[B] float32 position weights exp(-(k - 1) / gamma) for k >= 1 (slot 0 is never scored)."""
    if gamma is None:
        return torch.ones(block_size, dtype=torch.float32, device=device)
    values = [math.exp(-max(slot - 1, 0) / gamma) for slot in range(block_size)]
    return torch.tensor(values, dtype=torch.float32, device=device)


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

    def check_pooled(self) -> None:
        """Every sum that is pooled (numerator, denominator, each metric pair) is float32 or wider."""
        check_pooled({"numerator": self.numerator, "denominator": self.denominator, **pooled_sums(self.terms)})


@dataclass(frozen=True)
class RowGroups:
    """Each row's group [b] (an index into `names`; -1: in no group), for per-group metrics."""

    groups: torch.Tensor
    names: tuple[str, ...]


@dataclass
class _HeadPass:
    """The LM-head pass over all active blocks [n, B]: the base numerator (differentiable) and, per
    proposal slot [n, B-1], the detached NLL, position weights, unary argmax and strict top-K."""

    numerator: torch.Tensor
    nll: torch.Tensor
    position_weights: torch.Tensor
    argmax: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None
    gold: torch.Tensor
    kd: torch.Tensor | None = None


def teacher_rows(blocks: BlockBatch, index: torch.Tensor) -> torch.Tensor:
    """[n, B-1] row numbers into the flattened [b * S, H] target states: slot k of the block at
    anchor a is taught by the target's distribution at position a + k - 1 (the one that predicts
    token a + k); positions past the end are clamped and carry weight 0 anyway."""
    row = torch.div(index, blocks.num_blocks, rounding_mode="floor")
    anchors = blocks.anchors.reshape(-1)[index]
    offsets = torch.arange(blocks.block_size - 1, device=anchors.device)
    positions = (anchors[:, None] + offsets).clamp(max=blocks.context_length - 1)
    return row[:, None] * blocks.context_length + positions


def _head_pass(
    proposal_hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    head_weight: torch.Tensor,
    settings,
    config: ObjectiveConfig,
    decay: torch.Tensor,
    top_k: int,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> _HeadPass:
    """Fused LM head + unary CE in chunks of `config.chunk_blocks` blocks over the proposal slots
    1..B-1 (`proposal_hidden` [n, B-1, H]; slot 0, the anchor, is never scored). Only the chunk's
    scalar numerator and its small per-slot outputs leave the loop. `teacher` is (the target's final
    hidden states [b * S, H], `teacher_rows` [n, B-1]): each chunk gathers only its own rows."""
    blocks, block = labels.shape
    numerator = proposal_hidden.new_zeros((), dtype=torch.float32)
    pieces: list[HeadOutputs] = []
    for start in range(0, blocks, config.chunk_blocks):
        chunk = slice(start, start + config.chunk_blocks)
        chunk_weights = weights[chunk]
        rows = chunk_weights.shape[0]

        def position_weights(nll: torch.Tensor, chunk_weights=chunk_weights, rows=rows) -> torch.Tensor:
            if config.loss_type == "dpace":
                full = torch.cat([nll.new_zeros(rows, 1), nll.view(rows, block - 1)], dim=1)
                dpace = dpace_weights(full, chunk_weights, config.dpace_alpha, config.dpace_weighting)
                return (chunk_weights * dpace)[:, 1:].reshape(-1)
            return (chunk_weights[:, 1:] * decay[1:]).reshape(-1)

        distillation = None
        if teacher is not None:
            states, rows_of = teacher
            distillation = Distillation(
                states[rows_of[chunk].reshape(-1)], config.resolved_kd_weight, config.kd_temperature
            )
        head = fused_unary_cross_entropy(
            proposal_hidden[chunk].flatten(0, 1),
            head_weight,
            labels[chunk, 1:].reshape(-1),
            position_weights,
            settings.output_multiplier,
            settings.final_logit_softcapping,
            top_k,
            distillation,
        )
        numerator = numerator + head.numerator
        pieces.append(head)

    def joined(values: list[torch.Tensor]) -> torch.Tensor:
        return (values[0] if len(values) == 1 else torch.cat(values)).view(blocks, block - 1, *values[0].shape[1:])

    tops = [piece.top for piece in pieces if piece.top is not None]  # each piece's when top_k > 0
    kds = [piece.kd for piece in pieces if piece.kd is not None]  # each piece's when distilling
    top = (joined([values for values, _ in tops]), joined([ids for _, ids in tops])) if top_k else None
    return _HeadPass(
        numerator=numerator,
        nll=joined([piece.nll for piece in pieces]),
        position_weights=joined([piece.position_weights for piece in pieces]),
        argmax=joined([piece.argmax for piece in pieces]),
        top=top,
        gold=joined([piece.gold for piece in pieces]),
        kd=joined(kds) if teacher is not None else None,
    )


def candidate_selector(draft: DFlashDraftModel) -> DFlash2CandidateSelector:
    """The draft's candidate selector; only a DFlash2 draft has one (`draft.dflash.is_dflash2`)."""
    selector = getattr(draft, "candidate_selector", None)
    if not isinstance(selector, DFlash2CandidateSelector):
        raise ValueError(f"{type(draft).__name__} has no candidate selector: the selector term needs a DFlash2 draft")
    return selector


@dataclass
class _SelectorPass:
    """The selector term's numerator (differentiable), and detached: teacher-forced scores
    [n, B-1, K], the gold's candidate index [n, B-1], whether the gold is a candidate, and the
    serving walk's tokens [n, B-1] (greedy, from the anchor, as the server proposes them)."""

    numerator: torch.Tensor
    scores: torch.Tensor
    gold_index: torch.Tensor
    covered: torch.Tensor
    walk_tokens: torch.Tensor


class _SelectorTerm:
    """Teacher-forced selector cross-entropy over the strict unary top-K, in memory-sized chunks.

    The candidates' unary logits are the LM-head pass's top-K values (`candidate_unary`: no head rows
    are gathered). With several chunks each runs under activation checkpointing: its [rows, K, r]
    codebook rows are recomputed in backward rather than kept, so they never add up across chunks. A
    single chunk keeps them: the selector's backward runs first and frees them before anything else
    is allocated, so recomputing would cost a second forward and save no memory."""

    def __init__(self, draft: DFlashDraftModel, head_weight: torch.Tensor, config: ObjectiveConfig):
        self.draft, self.head_weight, self.config = draft, head_weight, config
        self.selector = candidate_selector(draft)

    def __call__(self, proposal_hidden: torch.Tensor, labels: torch.Tensor, head: _HeadPass) -> _SelectorPass:
        if head.top is None:
            raise ValueError("the selector term needs the LM-head pass's top-K candidates (top_k > 0)")
        top = head.top
        candidate_values, candidate_ids = top
        gold = labels[:, 1:]
        covered = (candidate_ids == gold[..., None]).any(dim=-1)
        if self.config.selector_gold == "insert":  # gold replaces the weakest candidate (training only)
            weakest = torch.arange(candidate_ids.shape[-1], device=gold.device) == candidate_ids.shape[-1] - 1
            replace = ~covered[..., None] & weakest
            candidate_ids = torch.where(replace, gold[..., None], candidate_ids)
            candidate_values = torch.where(replace, head.gold[..., None], candidate_values)
            selector_weight = head.position_weights
        else:
            selector_weight = head.position_weights * covered
        gold_index = (candidate_ids == gold[..., None]).float().argmax(dim=-1)
        rank = self.selector.hidden_projection.out_features
        step = selector_chunk_blocks(self.config.chunk_blocks, self.head_weight.shape[0], rank, self.selector.top_k)
        numerator = proposal_hidden.new_zeros((), dtype=torch.float32)
        scores, lattices = [], []
        for start in range(0, labels.shape[0], step):
            chunk = slice(start, start + step)
            arguments = tuple(
                tensor[chunk]
                for tensor in (proposal_hidden, candidate_ids, candidate_values, labels, gold_index, selector_weight)
            )
            if torch.is_grad_enabled() and step < labels.shape[0]:
                total, chunk_scores = checkpoint(self._numerator, *arguments, use_reentrant=False)
            else:
                total, chunk_scores = self._numerator(*arguments)
            numerator = numerator + total
            scores.append(chunk_scores)
            with torch.no_grad():
                lattices.append(
                    self.selector.lattice(
                        proposal_hidden[chunk].detach(),
                        None,
                        labels[chunk, 0],
                        candidates=(top[0][chunk], top[1][chunk]),
                    )
                )
        with torch.no_grad():
            walk = self.selector.walk_lattice(join_lattices(lattices) if len(lattices) > 1 else lattices[0])
        return _SelectorPass(
            numerator=numerator,
            scores=torch.cat(scores) if len(scores) > 1 else scores[0],
            gold_index=gold_index,
            covered=covered,
            walk_tokens=walk.tokens,
        )

    def _numerator(self, hidden, candidate_ids, candidate_values, labels, gold_index, selector_weight):
        if self.config.selector_stop_gradient:
            hidden = hidden.detach()
        settings = self.draft.dflash
        unary = candidate_unary(
            hidden,
            candidate_values,
            self.head_weight,
            candidate_ids,
            settings.output_multiplier,
            settings.final_logit_softcapping,
        )
        predecessors = labels[:, :-1]  # slot 1's predecessor is the anchor
        scores = self.selector.score_candidates(hidden, candidate_ids, unary, predecessors).scores
        cross_entropy = torch.logsumexp(scores, dim=-1) - scores.gather(-1, gold_index[..., None])[..., 0]
        # per-slot terms in the draft's precision (bf16 under autocast), their weighted sum in float32
        return (cross_entropy.float() * selector_weight).sum(), scores.detach()


def _metrics(labels: torch.Tensor, weights: torch.Tensor, head: _HeadPass, selector: _SelectorPass | None):
    """All metric terms of the step at once (no per-chunk work), from detached per-slot outputs."""
    full_prediction = torch.cat([labels[:, :1], head.argmax], dim=1)  # slot 0 is never scored
    terms = unary_terms(full_prediction, labels, weights)
    terms["loss_base_unweighted"] = ((head.nll * weights[:, 1:]).sum(), weights.sum())
    if head.kd is not None:  # the distillation term per supervised slot, without position weights
        terms["kd_divergence"] = ((head.kd * weights[:, 1:]).sum(), weights.sum())
    if selector is not None:
        terms.update(
            selector_terms(
                covered=selector.covered,
                selector_correct=selector.scores.argmax(dim=-1) == selector.gold_index,
                unary_correct=head.argmax == labels[:, 1:],
                walk_correct=selector.walk_tokens == labels[:, 1:],
                weights=weights[:, 1:],
            )
        )
    return terms


def group_terms(
    labels: torch.Tensor,
    weights: torch.Tensor,
    head: _HeadPass,
    selector: _SelectorPass | None,
    block_groups: torch.Tensor,
    group_names: tuple[str, ...],
) -> MetricTerms:
    """The metric terms again for each group of rows alone (`{name}_{term}`), by zeroing the
    weights of the other groups' blocks: no extra forward, and every name is there on every rank
    (zero pairs for a group a batch lacks) so the pooled all-reduce keeps one shape."""
    terms: MetricTerms = {}
    for group, name in enumerate(group_names):
        only = weights * (block_groups == group).unsqueeze(-1).to(weights.dtype)
        terms.update({f"{name}_{term}": pair for term, pair in _metrics(labels, only, head, selector).items()})
    return terms


def loss_denominator(weights: torch.Tensor, config: ObjectiveConfig, decay: torch.Tensor | None = None) -> torch.Tensor:
    """The loss normaliser, a function of the block weights [..., B] alone, so a trainer can pool it
    over micro-batches and ranks before any forward pass: sum w * decay for CE, and the number of
    supervised slots sum w for D-PACE (whose own weights depend on the model)."""
    weights = weights.float()  # summed in float32, not in the weights' own dtype
    if config.loss_type == "dpace":
        return weights.sum()
    if decay is None:
        block_size = weights.shape[-1]
        decay = decay_weights(block_size, config.resolved_gamma(block_size), weights.device)
    return (weights * decay).sum()


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


def configure_selector_training(draft: nn.Module, config: ObjectiveConfig) -> None:
    """Configured alpha == 0: freeze the selector so it stays out of the optimizer (`draft`: a draft,
    or a PEFT wrapper of one, which forwards the attribute)."""
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
    target_final_hidden: torch.Tensor | None = None,
    row_groups: RowGroups | None = None,
) -> ObjectiveResult:
    """Objective for draft outputs `hidden` [b, N*B, H] of the packed `blocks`.

    `target_final_hidden` [b, S, H] (the target's final, post-norm hidden states: what its LM head
    reads) is required when the objective distills (`config.distills`). `row_groups` adds each
    group's metric terms beside the batch's (`group_terms`; e.g. thinking on and off).

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
    # Blocks with nothing to score (dummy slots, fully unsupervised) cost no LM-head work; if no
    # block is active one zero-weight block still runs so the graph (and every parameter) is kept.
    active = weights.sum(dim=-1) > 0
    if not active.any():
        active[0] = True
    index = active.nonzero()[:, 0]
    # one gather of the proposal slots 1..B-1 of the active blocks, contiguous [n, B-1, H]
    proposal_hidden = hidden.reshape(-1, block_size, hidden.shape[-1])[index, 1:]
    labels, weights = labels[index], weights[index]

    decay = decay_weights(block_size, config.resolved_gamma(block_size), hidden.device)
    top_k = candidate_selector(draft).top_k if with_selector else 0
    teacher = None
    if config.distills:
        if target_final_hidden is None:
            raise ValueError("kd_weight > 0 needs the target's final hidden states (target_final_hidden).")
        teacher = (target_final_hidden.reshape(-1, target_final_hidden.shape[-1]), teacher_rows(blocks, index))
    head = _head_pass(proposal_hidden, labels, weights, weight, draft.dflash, config, decay, top_k, teacher)
    numerator = head.numerator
    selector = _SelectorTerm(draft, weight, config)(proposal_hidden, labels, head) if with_selector else None
    selector_numerator = selector.numerator if selector is not None else hidden.new_zeros((), dtype=torch.float32)
    with torch.no_grad():
        terms = _metrics(labels, weights, head, selector)
        if row_groups is not None:
            rows = torch.arange(blocks.weights.shape[0], device=index.device)
            block_groups = row_groups.groups.to(index.device)[rows.repeat_interleave(blocks.num_blocks)[index]]
            terms.update(group_terms(labels, weights, head, selector, block_groups, row_groups.names))
    denominator = loss_denominator(blocks.weights, config, decay)

    total = numerator + alpha_eff * selector_numerator
    # nothing supervised: every weight is 0, so is `total`, and the loss is 0 (not 0 / 0)
    loss = total / denominator.clamp(min=1e-12)
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
    target_final_hidden: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    row_groups: RowGroups | None = None,
) -> ObjectiveResult:
    """One batch end to end: anchors -> blocks -> masks -> draft forward -> objective.

    input_ids, loss_mask [b, S]; target_hidden [b, S, n*H]; target_final_hidden [b, S, H] (only
    for distillation); position_ids [b, S] for packed rows (each document's own, from 0), None
    for rows of one document. Anchors come from `anchors`
    ((anchors, keep), e.g. drawn ahead by a trainer) or are drawn here with `draw`; `draw=None`
    takes every valid position in order (evaluation). `forward_module` is the (possibly DDP/FSDP
    wrapped) module to call; the objective runs inside its forward, and what comes back is checked
    to still be float32 (`ObjectiveResult.check_pooled`): an output cast would make pooling inexact.
    `row_groups` adds per-group metric terms (`dflash_loss`).
    """
    settings = draft.dflash
    if anchors is None:
        anchors = sample_anchors(loss_mask, config.num_anchors, draw, row_ids, position_ids)
    blocks = build_blocks(input_ids, loss_mask, *anchors, settings.block_size, settings.mask_token_id, position_ids)
    backend = draft.config._attn_implementation or "sdpa"
    masks = attention_masks(blocks, settings, "flex_attention" if backend == "flex_attention" else "sdpa")
    noise = embed_draft_ids(embedding_weight, blocks.draft_ids, settings.input_embedding_scale)

    def objective(hidden: torch.Tensor) -> dict:
        with record_function(OBJECTIVE_LABEL):
            result = dflash_loss(draft, hidden, blocks, output_head, config, alpha, target_final_hidden, row_groups)
            return result.as_dict()

    outputs = (forward_module or draft)(
        position_ids=blocks.model_position_ids(),
        noise_embedding=noise.to(target_hidden.dtype),
        target_hidden=target_hidden,
        attention_mask=masks,
        output_transform=objective,
    )
    result = ObjectiveResult(**outputs)
    result.check_pooled()
    return result

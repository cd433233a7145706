"""A straightforward implementation of the same training step, written for the benchmark.

- the convolution runs block by block in a Python loop;
- the selector scores each scored position in a Python loop;
- the LM head produces the full, unchunked logits of every draft position, without checkpointing;
- distillation forms the target's logits at every context position, then picks each slot's row.

It computes the same loss as `trainer.objective.loss` (the benchmark checks it), just the obvious way.
"""

from __future__ import annotations

import contextlib

import torch

import modeling_dflash2.modeling_dflash2 as modeling
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import decay_weights, embed_draft_ids
from trainer.objective.masks import attention_masks

_fast_conv = modeling.grouped_dynamic_causal_conv


def conv_block_by_block(hidden, base_kernel, dynamic_kernel, block_size):
    outputs = [
        _fast_conv(
            hidden[:, start : start + block_size],
            base_kernel,
            dynamic_kernel[:, start : start + block_size],
            block_size,
        )
        for start in range(0, hidden.shape[1], block_size)
    ]
    return torch.cat(outputs, dim=1)


@contextlib.contextmanager
def naive_convolution():
    modeling.grouped_dynamic_causal_conv = conv_block_by_block
    try:
        yield
    finally:
        modeling.grouped_dynamic_causal_conv = _fast_conv


def naive_distillation(draft, logits, blocks, head, target_final_hidden, temperature: float) -> torch.Tensor:
    """[rows, N * B] T^2 KL(target || draft) per draft position, from the target's full logits: slot
    k of the block at anchor a is taught by the target's distribution at position a + k - 1."""
    teacher = draft.compute_logits(target_final_hidden, head)  # [rows, S, V], every position
    offsets = torch.arange(blocks.block_size, device=logits.device) - 1
    positions = (blocks.anchors[:, :, None] + offsets).clamp(0, blocks.context_length - 1).reshape(len(logits), -1)
    teacher = teacher.gather(1, positions[..., None].expand(-1, -1, teacher.shape[-1]))
    log_p = torch.log_softmax(teacher / temperature, -1)
    log_q = torch.log_softmax(logits / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1) * temperature**2


def naive_loss(
    draft, hidden, blocks, head, config: ObjectiveConfig, alpha: float, target_final_hidden=None
) -> torch.Tensor:
    settings = draft.dflash
    block = settings.block_size
    rows = hidden.shape[0]
    logits = draft.compute_logits(hidden, head)  # [rows, N * B, V], all at once
    labels = blocks.labels.reshape(rows, -1)
    weights = blocks.weights.reshape(rows, -1)
    decay = decay_weights(block, config.resolved_gamma(block), hidden.device).repeat(blocks.num_blocks)
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, labels[..., None])[..., 0]
    if config.distills:
        kd = naive_distillation(draft, logits, blocks, head, target_final_hidden, config.kd_temperature)
        nll = (1 - config.resolved_kd_weight) * nll + config.resolved_kd_weight * kd
    numerator = (nll * weights * decay).sum()
    denominator = (weights * decay).sum()
    selector = draft.candidate_selector
    projected = selector.hidden_projection(hidden)
    selector_numerator = hidden.new_zeros(())
    for row, position in (weights > 0).nonzero().tolist():
        values, ids = torch.topk(logits[row, position], selector.top_k)
        gold = labels[row, position]
        hit = (ids == gold).nonzero()
        if hit.numel() == 0:
            continue
        predecessor = labels[row, position - 1]
        conditioned = selector.predecessor_codebook[predecessor] * projected[row, position]
        scores = values + selector.successor_codebook[ids] @ conditioned
        cross_entropy = torch.logsumexp(scores, 0) - scores[hit[0, 0]]
        selector_numerator = selector_numerator + cross_entropy * weights[row, position] * decay[position]
    return (numerator + alpha * selector_numerator) / denominator


def naive_step(draft, batch, config: ObjectiveConfig, alpha: float = 1.0) -> torch.Tensor:
    """Forward + backward of the naive step; returns the loss."""
    settings = draft.dflash
    blocks = batch.blocks
    with naive_convolution():
        hidden = draft(
            position_ids=blocks.model_position_ids(),
            noise_embedding=embed_draft_ids(batch.embedding, blocks.draft_ids, settings.input_embedding_scale),
            target_hidden=batch.target_hidden,
            attention_mask=attention_masks(blocks, settings),
        )
    loss = naive_loss(draft, hidden, blocks, batch.head, config, alpha)
    loss.backward()
    return loss.detach()

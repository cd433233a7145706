"""Explicit FLOP count of one training step (matrix products only; 2 FLOPs per multiply-add).

Model FLOPs count the useful work of forward and backward: trainable layers cost 3x their forward
(input and weight gradients); the frozen LM head 2x (forward, and the gradient with respect to the
hidden states only); `fc` 2x (its input, the target's features, needs no gradient). Attention is
counted over visible (query, key) pairs only, the LM head over scored slots 1..B-1 of blocks that
carry a scored slot; distillation adds the teacher's logits through the same head, forward only
(1x). A DFlash v1 draft has no convolutions and no selector. Hardware FLOPs add what the
implementation recomputes: the selector term's forward under activation checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.setups import StepSetup, SyntheticBatch
from trainer.objective.masks import attention_masks


@dataclass
class StepFlops:
    linear_forward: int  # the draft's layers: projections, SwiGLU, convolutions
    attention_forward: int  # scores and values over visible pairs
    fc_forward: int
    lm_head_forward: int
    selector_forward: int
    teacher_forward: int = 0  # distillation: the target's logits for the same rows

    @property
    def model(self) -> int:
        trainable = self.linear_forward + self.attention_forward + self.selector_forward
        return 3 * trainable + 2 * (self.fc_forward + self.lm_head_forward) + self.teacher_forward

    @property
    def hardware(self) -> int:
        return self.model + self.selector_forward


def step_flops(setup: StepSetup, batch: SyntheticBatch, distills: bool = False) -> StepFlops:
    config = setup.config
    settings = config.dflash_settings
    hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.head_dim or hidden // heads
    rows, length = batch.input_ids.shape
    queries = rows * batch.blocks.draft_ids.shape[1]
    keys = rows * length + queries
    taps = len(settings.target_layer_ids)
    fc = 2 * rows * length * taps * hidden * hidden
    flops = attention = 0
    masks = attention_masks(batch.blocks, settings)
    for index in range(config.num_hidden_layers):
        visible = int(masks[settings.layer_types[index]].sum())
        flops += 2 * queries * hidden * heads * head_dim  # q
        flops += 2 * 2 * keys * hidden * kv_heads * head_dim  # k, v over context and block
        flops += 2 * queries * heads * head_dim * hidden  # o
        attention += 2 * 2 * heads * head_dim * visible  # scores and values over visible pairs
        flops += 3 * 2 * queries * hidden * inner  # SwiGLU
        if settings.is_dflash2:
            groups = hidden // settings.conv_group_size
            kernel = settings.conv_kernel_size
            flops += 2 * (2 * queries * hidden * 2 * kernel * groups + 2 * kernel * 2 * queries * hidden)  # two convs
    weights = batch.blocks.weights.reshape(-1, settings.block_size)
    active_blocks = int((weights.sum(-1) > 0).sum())
    proposal_rows = active_blocks * (settings.block_size - 1)  # slot 0, the anchor, is never scored
    lm_head = 2 * proposal_rows * hidden * vocab
    selector = 0
    if settings.is_dflash2:
        rank, top_k = settings.selector_rank, settings.selector_top_k
        selector = 2 * proposal_rows * (hidden * rank + top_k * hidden + 2 * top_k * rank)
    return StepFlops(
        linear_forward=flops,
        attention_forward=attention,
        fc_forward=fc,
        lm_head_forward=lm_head,
        selector_forward=selector,
        teacher_forward=lm_head if distills else 0,
    )

"""Attention visibility of packed draft blocks, from one element-wise rule (docs/objective.md §4).

Keys are `[context (S); draft (N*B)]`. Query slot q belongs to block n = q // B at offset o = q % B:
- context key j is visible iff s_n <= j < a_n (strictly before the anchor: the anchor's own target
  hidden state does not exist yet at serving time; from s_n, where the anchor's document starts in
  a packed row, 0 otherwise), and, on sliding layers, a_n + o - j < W;
- draft key j is visible iff it is in the same block; causal layers add p <= o, sliding layers
  |o - p| < W (one-sided when causal);
- a dummy block's row sees only its own slot, so dense kernels never meet an all-masked row.

`block_visible` is written with tensor ops only, so the same function builds the dense boolean
mask (sdpa/eager) by broadcasting and serves as flex_attention's `mask_mod` (CUDA).
"""

from __future__ import annotations

from typing import Any

import torch

from modeling_dflash2 import DFlashSettings
from trainer.objective.blocks import BlockBatch


def block_visible(
    batch_idx: torch.Tensor,
    q_idx: torch.Tensor,
    kv_idx: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    starts: torch.Tensor | None,
    context_length: int,
    block_size: int,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    block = q_idx // block_size
    offset = q_idx % block_size
    anchor = anchors[batch_idx, block]
    kept = keep[batch_idx, block]
    draft_idx = kv_idx - context_length
    is_context = kv_idx < context_length
    context_visible = is_context & (kv_idx < anchor)
    if starts is not None:
        context_visible = context_visible & (kv_idx >= starts[batch_idx, block])
    same_block = ~is_context & (draft_idx // block_size == block)
    key_offset = draft_idx % block_size
    if causal:
        same_block = same_block & (key_offset <= offset)
    if sliding_window is not None:
        context_visible = context_visible & (anchor + offset - kv_idx < sliding_window)
        same_block = same_block & (offset - key_offset < sliding_window)
        if not causal:
            same_block = same_block & (key_offset - offset < sliding_window)
    own_slot = draft_idx == q_idx
    return torch.where(kept, context_visible | same_block, own_slot)


def layer_visibility(settings: DFlashSettings) -> dict[str, tuple[bool, int | None]]:
    """(causal, sliding window) for each layer type the draft uses (docs/contract.md)."""
    rules = {}
    for index, layer_type in enumerate(settings.layer_types):
        rules[layer_type] = (settings.layer_is_causal(index), settings.layer_sliding_window(index))
    return rules


def dense_block_mask(blocks: BlockBatch, causal: bool, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask [b, 1, N*B, S + N*B] (True = visible) for sdpa and eager attention."""
    device = blocks.anchors.device
    batch = blocks.anchors.shape[0]
    queries = blocks.draft_ids.shape[1]
    keys = blocks.context_length + queries
    visible = block_visible(
        torch.arange(batch, device=device)[:, None, None],
        torch.arange(queries, device=device)[None, :, None],
        torch.arange(keys, device=device)[None, None, :],
        blocks.anchors,
        blocks.keep,
        blocks.starts,
        blocks.context_length,
        blocks.block_size,
        causal,
        sliding_window,
    )
    return visible[:, None]


def flex_attention_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return True


def flex_block_mask(blocks: BlockBatch, causal: bool, sliding_window: int | None) -> Any:
    """The same rule as a flex_attention BlockMask (block-sparse over other and dummy blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchors, keep, starts = blocks.anchors, blocks.keep, blocks.starts
    context_length, block_size = blocks.context_length, blocks.block_size

    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        return block_visible(
            batch_idx, q_idx, kv_idx, anchors, keep, starts, context_length, block_size, causal, sliding_window
        )

    queries = blocks.draft_ids.shape[1]
    return create_block_mask(
        mask_mod,
        B=anchors.shape[0],
        H=None,
        Q_LEN=queries,
        KV_LEN=context_length + queries,
        device=anchors.device,
    )


def attention_masks(blocks: BlockBatch, settings: DFlashSettings, backend: str = "sdpa") -> dict[str, Any]:
    """`{layer_type: mask}` for the layer types in use; one build per distinct (causal, window)."""
    build = flex_block_mask if backend == "flex_attention" else dense_block_mask
    if backend == "flex_attention" and not flex_attention_available():
        raise ValueError("attn_implementation='flex_attention' needs torch.nn.attention.flex_attention.")
    built: dict[tuple[bool, int | None], Any] = {}
    masks = {}
    for layer_type, rule in layer_visibility(settings).items():
        if rule not in built:
            built[rule] = build(blocks, *rule)
        masks[layer_type] = built[rule]
    return masks

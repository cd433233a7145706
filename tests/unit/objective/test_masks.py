"""Attention visibility: dense == flex rule == an element-wise reference; truth tables."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.drafts import tiny_config, tiny_draft
from trainer.objective.blocks import AnchorDraw, BlockBatch, build_blocks, sample_anchors
from trainer.objective.masks import (
    attention_masks,
    block_visible,
    dense_block_mask,
    flex_attention_available,
    flex_block_mask,
)


def reference_visible(batch, query, key, anchors, keep, context, block, causal, window) -> bool:
    """The visibility rule of docs/objective.md §4 read literally, one (query, key) pair at a time."""
    n, offset = divmod(query, block)
    anchor = int(anchors[batch][n])
    if not keep[batch][n]:
        return key == context + query  # a dummy row sees only itself
    if key < context:
        visible = key < anchor
        if window is not None:
            visible = visible and (anchor + offset) - key < window
        return visible
    other_block, key_offset = divmod(key - context, block)
    if other_block != n:
        return False
    if causal and key_offset > offset:
        return False
    if window is not None:
        distance = offset - key_offset if causal else abs(offset - key_offset)
        if distance >= window:
            return False
    return True


def reference_mask(blocks: BlockBatch, causal: bool, window: int | None) -> torch.Tensor:
    batch, queries = blocks.draft_ids.shape
    keys = blocks.context_length + queries
    mask = torch.zeros(batch, 1, queries, keys, dtype=torch.bool)
    for b, q, k in itertools.product(range(batch), range(queries), range(keys)):
        mask[b, 0, q, k] = reference_visible(
            b, q, k, blocks.anchors, blocks.keep, blocks.context_length, blocks.block_size, causal, window
        )
    return mask


def _blocks(anchors, keep, context, block) -> BlockBatch:
    anchors, keep = torch.tensor(anchors), torch.tensor(keep)
    input_ids = torch.zeros(anchors.shape[0], context, dtype=torch.long)
    return build_blocks(input_ids, torch.ones_like(input_ids), anchors, keep, block, mask_token_id=1)


CASES = {
    "single block": ([[3]], [[True]], 8, 4),
    "anchor at 0 and at the last valid position": ([[0, 6]], [[True, True]], 8, 3),
    "consecutive anchors, two rows": ([[1, 2, 3], [4, 5, 0]], [[True] * 3, [True, True, False]], 7, 2),
    "all slots dummy in one row": ([[2, 0], [0, 0]], [[True, False], [False, False]], 5, 3),
    "block of one": ([[0, 2, 4]], [[True] * 3], 6, 1),
    "block longer than the context": ([[1]], [[True]], 3, 6),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(
    ("causal", "window"), [(False, None), (True, None), (True, 2), (False, 2), (True, 1), (False, 5)]
)
def test_dense_mask_equals_elementwise_reference(name, causal, window):
    blocks = _blocks(*CASES[name])
    assert torch.equal(dense_block_mask(blocks, causal, window), reference_mask(blocks, causal, window))


def test_random_stress_against_reference():
    generator = torch.Generator().manual_seed(0)
    for trial in range(6):
        length = int(torch.randint(4, 14, (1,), generator=generator))
        block = int(torch.randint(1, 6, (1,), generator=generator))
        loss_mask = (torch.rand(2, length, generator=generator) < 0.8).long()
        loss_mask[0, :2] = 1
        anchors, keep = sample_anchors(loss_mask, 4, AnchorDraw(seed=trial, step=0))
        blocks = build_blocks(torch.zeros_like(loss_mask), loss_mask, anchors, keep, block, mask_token_id=0)
        for causal, window in [(False, None), (True, 3), (False, 2)]:
            assert torch.equal(dense_block_mask(blocks, causal, window), reference_mask(blocks, causal, window))


def test_sliding_truth_table_moves_with_the_query_offset():
    # anchor 6, S = 12, B = 4, W = 4, causal sliding
    mask = dense_block_mask(_blocks([[6]], [[True]], 12, 4), causal=True, sliding_window=4)[0, 0]
    assert mask[0].nonzero()[:, 0].tolist() == [3, 4, 5, 12]
    assert mask[3].nonzero()[:, 0].tolist() == [12, 13, 14, 15]
    # W = 1: no context at all and a purely causal... diagonal draft
    mask = dense_block_mask(_blocks([[6]], [[True]], 12, 4), causal=True, sliding_window=1)[0, 0]
    assert [row.nonzero()[:, 0].tolist() for row in mask] == [[12], [13], [14], [15]]


def test_context_is_strictly_before_the_anchor_and_other_blocks_are_invisible():
    blocks = _blocks([[2, 5]], [[True, True]], 8, 3)
    mask = dense_block_mask(blocks, causal=False, sliding_window=None)[0, 0]
    assert mask[0, :8].nonzero()[:, 0].tolist() == [0, 1]  # anchor 2: context 0, 1 only
    assert mask[3, :8].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert not mask[:3, 11:].any() and not mask[3:, 8:11].any()
    assert mask[:3, 8:11].all() and mask[3:, 11:].all()  # bidirectional inside a block


@pytest.mark.skipif(not flex_attention_available(), reason="flex_attention not in this torch")
def test_flex_mask_mod_equals_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    blocks = _blocks([[1, 2, 3], [4, 5, 0]], [[True] * 3, [True, True, False]], 7, 2)
    for causal, window in [(False, None), (True, 2), (False, 2)]:

        def mask_mod(b, h, q, kv, causal=causal, window=window):
            return block_visible(b, q, kv, blocks.anchors, blocks.keep, blocks.starts, 7, 2, causal, window)

        dense = create_mask(mask_mod, 2, 1, 6, 13, device="cpu")
        assert torch.equal(dense, dense_block_mask(blocks, causal, window))
    block_mask = flex_block_mask(blocks, causal=False, sliding_window=None)
    assert block_mask.shape == (2, 1, 6, 13)


def test_one_mask_per_distinct_rule():
    full = tiny_config()
    masks = attention_masks(_blocks([[2]], [[True]], 6, 4), full.dflash_settings)
    assert list(masks) == ["full_attention"]
    hybrid = tiny_config(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=2)
    masks = attention_masks(_blocks([[2]], [[True]], 6, 4), hybrid.dflash_settings)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert not torch.equal(masks["full_attention"], masks["sliding_attention"])
    same = tiny_config(
        layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=64, is_causal=False
    )
    masks = attention_masks(_blocks([[2]], [[True]], 6, 4), same.dflash_settings)
    assert masks["full_attention"] is not masks["sliding_attention"]  # window differs, even if it never binds


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_dummy_rows_produce_no_nan(implementation):
    model = tiny_draft(seed=0, attn_implementation=implementation).eval()
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    loss_mask[1, 4:] = 1
    anchors, keep = sample_anchors(loss_mask, 3, AnchorDraw(0, 0))
    assert (~keep).sum() == 4
    blocks = build_blocks(torch.zeros_like(loss_mask), loss_mask, anchors, keep, 4, mask_token_id=3)
    with torch.no_grad():
        out = model(
            position_ids=blocks.model_position_ids(),
            noise_embedding=torch.randn(2, 12, 32),
            target_hidden=torch.randn(2, 6, 64),
            attention_mask=attention_masks(blocks, model.dflash),
        )
    assert torch.isfinite(out).all()

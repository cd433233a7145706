"""Anchors and block inputs (docs/objective.md §2 Anchors and §3 Blocks)."""

from __future__ import annotations

import pytest
import torch

from trainer.objective.blocks import AnchorDraw, build_blocks, sample_anchors, valid_anchor_mask


def test_valid_anchors_need_two_adjacent_supervised_tokens():
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1]])
    assert valid_anchor_mask(mask)[0].nonzero()[:, 0].tolist() == [0, 5]
    anchors, keep = sample_anchors(mask, num_anchors=4, draw=AnchorDraw(seed=0, step=0))
    assert anchors.tolist() == [[0, 5, 0, 0]]
    assert keep.tolist() == [[True, True, False, False]]


def test_partial_tail_block_has_exactly_one_target():
    input_ids = torch.tensor([[10, 11, 12, 13]])
    loss_mask = torch.ones(1, 4, dtype=torch.long)
    blocks = build_blocks(input_ids, loss_mask, torch.tensor([[2]]), torch.tensor([[True]]), 5, mask_token_id=99)
    assert blocks.weights.tolist() == [[[0.0, 1.0, 0.0, 0.0, 0.0]]]
    assert blocks.labels.tolist() == [[[12, 13, 13, 13, 13]]]  # positions past S clamp (weight 0)
    assert blocks.position_ids.tolist() == [[2, 3, 4, 5, 6]]


def test_block_inputs_by_hand():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]])
    anchors = torch.tensor([[2, 6, 0]])
    keep = torch.tensor([[True, True, False]])
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, block_size=3, mask_token_id=99)
    assert blocks.draft_ids.tolist() == [[12, 99, 99, 16, 99, 99, 99, 99, 99]]
    assert blocks.position_ids.tolist() == [[2, 3, 4, 6, 7, 8, 0, 1, 2]]
    assert blocks.labels.tolist() == [[[12, 13, 14], [16, 17, 17], [10, 11, 12]]]
    # slot 0 never scored; loss_mask at the label position; past S unscored; dummy block unscored
    assert blocks.weights.tolist() == [[[0, 1, 1], [0, 1, 0], [0, 0, 0]]]
    assert blocks.model_position_ids().tolist() == [[*list(range(8)), 2, 3, 4, 6, 7, 8, 0, 1, 2]]


def _random_mask(batch: int, length: int, seed: int) -> torch.Tensor:
    return (torch.rand(batch, length, generator=torch.Generator().manual_seed(seed)) < 0.7).long()


def test_sampled_anchors_are_sorted_unique_valid_and_kept_first():
    loss_mask = _random_mask(6, 40, seed=0)
    loss_mask[3] = 0  # a row without any valid anchor gets only dummy slots
    valid = valid_anchor_mask(loss_mask)
    anchors, keep = sample_anchors(loss_mask, 8, AnchorDraw(seed=1, step=2, rank=0))
    for row in range(6):
        kept = anchors[row][keep[row]].tolist()
        assert kept == sorted(set(kept))
        assert all(valid[row, a] for a in kept)
        assert len(kept) == min(int(valid[row].sum()), 8)
        assert keep[row].tolist() == [True] * len(kept) + [False] * (8 - len(kept))
        assert anchors[row][~keep[row]].eq(0).all()


def test_anchor_draw_is_reproducible_and_changes_with_each_input():
    loss_mask = torch.ones(2, 64, dtype=torch.long)
    draw = AnchorDraw(seed=3, step=10, rank=1)
    first = sample_anchors(loss_mask, 8, draw)[0]
    assert torch.equal(first, sample_anchors(loss_mask, 8, AnchorDraw(seed=3, step=10, rank=1))[0])
    for other in (AnchorDraw(4, 10, 1), AnchorDraw(3, 11, 1), AnchorDraw(3, 10, 0)):
        assert not torch.equal(first, sample_anchors(loss_mask, 8, other)[0])
    assert not torch.equal(first[0], first[1])  # rows differ


def test_anchor_choice_is_invariant_to_padding_and_other_rows():
    loss_mask = _random_mask(3, 30, seed=5)
    draw = AnchorDraw(seed=0, step=7)
    anchors, keep = sample_anchors(loss_mask, 6, draw)
    padded = torch.nn.functional.pad(loss_mask, (0, 25))
    padded_anchors, padded_keep = sample_anchors(padded, 6, draw)
    assert torch.equal(anchors, padded_anchors) and torch.equal(keep, padded_keep)
    alone, _ = sample_anchors(loss_mask[2:], 6, draw, row_ids=torch.tensor([2]))
    assert torch.equal(alone[0], anchors[2])


def test_anchor_sampling_is_uniform_without_replacement():
    loss_mask = torch.ones(1, 21, dtype=torch.long)  # 20 valid positions, 5 slots
    counts = torch.zeros(21)
    draws = 2000
    for step in range(draws):
        anchors, keep = sample_anchors(loss_mask, 5, AnchorDraw(seed=0, step=step))
        assert keep.all() and anchors.unique().numel() == 5
        counts[anchors[0]] += 1
    assert counts[20] == 0
    frequency = counts[:20] / draws
    # each position is chosen with probability 5/20; binomial sd ~ 0.0097 per position
    assert (frequency - 0.25).abs().max() < 0.045


def test_deterministic_anchors_take_every_valid_position_in_order():
    loss_mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1]])
    anchors, keep = sample_anchors(loss_mask, 10, draw=None)
    assert anchors[0][keep[0]].tolist() == [0, 1, 4, 5, 6]
    anchors, keep = sample_anchors(loss_mask, 3, draw=None)
    assert anchors.tolist() == [[0, 1, 4]] and keep.all()


def test_batch_without_valid_anchor_raises():
    with pytest.raises(ValueError, match="No valid anchor in this batch"):
        sample_anchors(torch.tensor([[1, 0, 1, 0], [0, 0, 0, 1]]), 4, AnchorDraw(0, 0))
    with pytest.raises(ValueError, match="num_anchors must be >= 1"):
        sample_anchors(torch.ones(1, 4), 0, None)

"""Sequence packing: rows of whole samples, and a packed row trains exactly what its documents
would alone (anchors, blocks, masks, losses, gradients, target features online and offline)."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import Qwen3NextForCausalLM

from modeling_dflash2 import DFlash2DraftModel
from tests.support.tiny_target import tiny_chat_dataset, tiny_draft_config_for, tiny_hybrid_config, tiny_target
from trainer.data.dataset import DFlashCollator
from trainer.data.feature_store import OfflineDataset, prepare_features
from trainer.data.packing import PackedDataset, pack_rows, padding_fraction, sample_lengths
from trainer.models.target import FrozenTarget
from trainer.objective.blocks import (
    AnchorDraw,
    anchor_keys,
    build_blocks,
    document_ends,
    document_starts,
    sample_anchors,
    valid_anchor_mask,
)
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import draft_objective
from trainer.objective.masks import dense_block_mask

LENGTHS = (11, 7, 14)  # three documents of different lengths in one row
PROMPT = 3  # unsupervised tokens at the start of each document


def packed_positions(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(length) for length in lengths])[None]


# -- rows ------------------------------------------------------------------------------------------


def test_pack_rows_places_every_sample_once_within_max_length_and_is_a_pure_function_of_the_seed():
    generator = torch.Generator().manual_seed(0)
    lengths = (torch.randint(5, 300, (500,), generator=generator)).tolist()
    rows = pack_rows(lengths, 512, seed=3)
    assert sorted(index for row in rows for index in row) == list(range(500))
    assert all(sum(lengths[index] for index in row) <= 512 for row in rows)
    assert pack_rows(lengths, 512, seed=3) == rows
    assert pack_rows(lengths, 512, seed=4) != rows
    # best fit: the rows are nearly full (next fit on the same order leaves far more room)
    fill = sum(lengths) / (512 * len(rows))
    assert fill > 0.97, fill


def test_pack_rows_refuses_a_sample_longer_than_a_row():
    with pytest.raises(ValueError, match="packing: sample 1 has 9 tokens, more than max_length=8"):
        pack_rows([3, 9], 8, seed=0)


def test_padding_fraction_worked_by_hand():
    # [3, 5] pads to 2 x 5 = 10 positions for 8 tokens; [4] computes 4 for 4
    assert padding_fraction([[3, 5], [4]]) == pytest.approx(1 - 12 / 14)


# -- documents, anchors and blocks ----------------------------------------------------------------


def test_document_starts_and_ends_from_restarting_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert document_starts(positions).tolist() == [[0, 0, 0, 3, 3, 5, 5, 5, 5]]
    assert document_ends(positions).tolist() == [[3, 3, 3, 5, 5, 9, 9, 9, 9]]


def test_an_anchor_and_its_first_target_lie_in_one_document():
    loss_mask = torch.ones(1, 6, dtype=torch.long)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert valid_anchor_mask(loss_mask, positions)[0].nonzero()[:, 0].tolist() == [0, 1, 3, 4]
    assert valid_anchor_mask(loss_mask)[0].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 4]


def test_each_document_gets_its_own_quota_of_anchors():
    """min(N, valid) per document, sampled inside it; the row has as many slots as its batch's fullest row."""
    masks = [torch.tensor([0] * PROMPT + [1] * (length - PROMPT)) for length in LENGTHS]
    loss_mask, positions = torch.cat(masks)[None], packed_positions(LENGTHS)
    valid = [length - PROMPT - 1 for length in LENGTHS]  # 7, 3, 10
    for draw in (None, AnchorDraw(seed=5, step=2)):
        anchors, keep = sample_anchors(loss_mask, 4, draw, position_ids=positions)
        assert anchors.shape == (1, 4 + 3 + 4) and bool(keep.all())
        starts = [0, 11, 18]
        for start, length, count in zip(starts, LENGTHS, valid, strict=True):
            inside = anchors[0][(anchors[0] >= start) & (anchors[0] < start + length)]
            assert len(inside) == min(4, count)
            assert all(PROMPT <= int(a) - start <= length - 2 for a in inside)
    first, _ = sample_anchors(loss_mask, 4, None, position_ids=positions)
    assert first[0].tolist() == [3, 4, 5, 6, 14, 15, 16, 21, 22, 23, 24]
    # a second row with fewer anchors gets dummy slots up to the fullest row's count
    short = torch.zeros_like(loss_mask)
    short[0, 3:6] = 1
    anchors, keep = sample_anchors(torch.cat([loss_mask, short]), 4, None, position_ids=positions.expand(2, -1))
    assert anchors.shape == (2, 11) and keep[1].tolist() == [True, True] + [False] * 9


def test_one_document_rows_keep_their_num_anchors_slots():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 0]])
    anchors, keep = sample_anchors(loss_mask, 5, None)
    assert anchors.tolist() == [[1, 2, 0, 0, 0]] and keep.tolist() == [[True, True, False, False, False]]


def test_a_packed_block_stops_at_its_document_end_and_takes_its_documents_positions():
    input_ids = torch.arange(10, 19)[None]
    loss_mask = torch.ones(1, 9, dtype=torch.long)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    blocks = build_blocks(input_ids, loss_mask, torch.tensor([[2, 5]]), torch.tensor([[True, True]]), 4, 99, positions)
    assert blocks.position_ids.tolist() == [[2, 3, 4, 5, 1, 2, 3, 4]]
    assert blocks.weights[0].tolist() == [[0, 1, 0, 0], [0, 1, 1, 1]]  # the first block ends with its document
    assert blocks.starts.tolist() == [[0, 4]]
    assert blocks.model_position_ids()[0, :9].tolist() == positions[0].tolist()
    visible = dense_block_mask(blocks, causal=False, sliding_window=None)[0, 0]
    assert visible[4:, :9].nonzero()[:, 1].unique().tolist() == [4]  # the second block: its own document only
    assert visible[:4, :9].nonzero()[:, 1].unique().tolist() == [0, 1]


# -- exactness: a packed row trains what its documents train alone ------------------------------


@pytest.fixture(scope="module")
def setting():
    target = tiny_target()
    torch.manual_seed(0)
    draft = DFlash2DraftModel(tiny_draft_config_for(target)).float()
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(4, target.vocab_rows, (length,), generator=generator) for length in LENGTHS]
    masks = [torch.tensor([0] * PROMPT + [1] * (length - PROMPT)) for length in LENGTHS]
    return target, draft, documents, masks


def objective(target, draft, input_ids, loss_mask, anchors, positions=None):
    hidden = target.capture(input_ids, None, draft.target_layer_ids, position_ids=positions)
    config = ObjectiveConfig(num_anchors=4, selector_alpha=0.5)
    return draft_objective(
        draft,
        input_ids,
        loss_mask,
        hidden,
        target.embedding_weight,
        target.lm_head,
        config,
        None,
        anchors=anchors,
        position_ids=positions,
    )


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_captured_target_features_of_a_packed_row_are_each_documents_own(setting, attention):
    target, _, documents, _ = setting
    target.model.config._attn_implementation = attention
    try:
        layers = list(range(target.num_layers))
        packed = target.capture(torch.cat(documents)[None], None, layers, position_ids=packed_positions(LENGTHS))
        start = 0
        for document in documents:
            alone = target.capture(document[None], None, layers)
            torch.testing.assert_close(packed[:, start : start + len(document)], alone, rtol=1e-5, atol=1e-5)
            start += len(document)
    finally:
        target.model.config._attn_implementation = "sdpa"


@pytest.mark.slow
def test_per_anchor_losses_and_draft_gradients_of_a_packed_row_equal_each_document_alone(setting):
    target, draft, documents, masks = setting
    input_ids, loss_mask, positions = torch.cat(documents)[None], torch.cat(masks)[None], packed_positions(LENGTHS)
    anchors, keep = sample_anchors(loss_mask, 4, AnchorDraw(seed=2, step=0), position_ids=positions)
    starts = torch.tensor([0, 11, 18])
    document_of = torch.bucketize(anchors[0], starts, right=True) - 1

    for slot in range(anchors.shape[1]):  # each anchor alone: its loss packed and in its document
        only = torch.zeros_like(keep)
        only[0, slot] = True
        packed = objective(target, draft, input_ids, loss_mask, (anchors, only), positions)
        index = int(document_of[slot])
        local = anchors[:, slot : slot + 1] - starts[index]
        alone = objective(
            target, draft, documents[index][None], masks[index][None], (local, torch.ones_like(local, dtype=torch.bool))
        )
        torch.testing.assert_close(packed.numerator, alone.numerator, rtol=1e-5, atol=1e-5)
        assert packed.denominator == alone.denominator

    draft.zero_grad()
    packed = objective(target, draft, input_ids, loss_mask, (anchors, keep), positions)
    packed.numerator.backward()
    packed_grads = {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    total, denominator = 0.0, 0.0
    for index, document in enumerate(documents):
        inside = anchors[0][document_of == index] - starts[index]
        alone = objective(
            target,
            draft,
            document[None],
            masks[index][None],
            (inside[None], torch.ones(1, len(inside), dtype=torch.bool)),
        )
        total, denominator = total + alone.numerator, denominator + alone.denominator
    total.backward()
    assert packed.denominator == denominator
    torch.testing.assert_close(packed.numerator, total, rtol=1e-5, atol=1e-5)
    assert len(packed_grads) > 10
    for name, parameter in draft.named_parameters():
        if name in packed_grads:
            torch.testing.assert_close(packed_grads[name], parameter.grad, rtol=1e-4, atol=1e-6, msg=name)
    draft.zero_grad()


# -- datasets and collation ---------------------------------------------------------------------


def test_a_packed_row_concatenates_whole_samples_with_restarting_positions():
    target = tiny_target()
    tokens = tiny_chat_dataset(target, 12)
    lengths = sample_lengths(tokens)
    assert lengths == [len(ids) for ids in tokens["input_ids"]]
    packed = PackedDataset.pack(tokens, 48, seed=0)
    assert sorted(index for row in packed.rows for index in row) == list(range(12))
    row = packed[0]
    samples = [tokens[index] for index in packed.rows[0]]
    assert row["input_ids"].tolist() == [token for sample in samples for token in sample["input_ids"]]
    assert row["position_ids"].tolist() == [p for sample in samples for p in range(len(sample["input_ids"]))]
    batch = DFlashCollator(pad_token_id=0)([packed[0], packed[1]])
    assert "attention_mask" not in batch
    width, short = batch["input_ids"].shape[1], len(min(packed[0]["input_ids"], packed[1]["input_ids"], key=len))
    shorter = 0 if len(packed[0]["input_ids"]) == short else 1
    # the padding is a document of its own, from position 0
    assert batch["position_ids"][shorter, short:].tolist() == list(range(width - short))
    assert batch["loss_mask"][shorter, short:].sum() == 0


def test_offline_features_of_a_packed_row_are_the_stored_per_sample_ones(tmp_path):
    target = tiny_target()
    tokens = tiny_chat_dataset(target, 8)
    offline = OfflineDataset(tokens, prepare_features(target, tokens, [2, 1], tmp_path, batch_size=4))
    packed = PackedDataset.pack(offline, 48, seed=1)
    assert sample_lengths(offline) == sample_lengths(tokens)
    for index, row in enumerate(packed.rows):
        stored = torch.cat([offline[sample]["target_hidden"] for sample in row])
        assert torch.equal(packed[index]["target_hidden"], stored)
        assert packed[index]["target_hidden"].shape[0] == len(packed[index]["input_ids"])


# -- the target must keep documents apart --------------------------------------------------------


def test_a_target_that_honours_packed_positions_passes_the_check():
    target = tiny_target("qwen3")
    target.check_packing()
    assert target._packing_checked


def test_a_target_whose_layers_carry_state_across_documents_is_refused_in_one_line():
    """Qwen3-Next's linear-attention layers run along the whole row, whatever the positions say."""
    config = tiny_hybrid_config(vocab_size=64)
    torch.manual_seed(0)
    target = FrozenTarget(Qwen3NextForCausalLM(config).float())
    with pytest.raises(ValueError) as error:
        target.check_packing()
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("packing: true: Qwen3NextForCausalLM lets packed documents see each other")
    assert message.endswith("set packing: false")


def test_sample_lengths_of_a_dataset_view_follow_its_rows():
    tokens = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (3, 9, 4, 7)], "loss_mask": [[1]] * 4})
    assert sample_lengths(tokens.select([3, 0])) == [7, 3]


def test_only_the_layers_a_capture_runs_are_probed():
    """A mixing layer deeper than every tapped layer never runs in the capture, so it is no reason to refuse."""
    torch.manual_seed(0)
    config = tiny_hybrid_config(vocab_size=64, layer_types=["full_attention", "linear_attention"])
    shallow = FrozenTarget(Qwen3NextForCausalLM(config).float())
    shallow.check_packing([0])
    deep = FrozenTarget(shallow.model)
    with pytest.raises(ValueError, match="lets packed documents see each other"):
        deep.check_packing([0, 1])


def reference_anchors(loss_mask, num_anchors, draw, positions):
    """Per row and document, a loop: the num_anchors smallest keys among the document's valid positions."""
    valid = valid_anchor_mask(loss_mask, positions)
    keys = anchor_keys(draw, torch.arange(loss_mask.shape[0]), loss_mask.shape[1])
    starts = document_starts(positions)
    rows = []
    for row in range(loss_mask.shape[0]):
        chosen = []
        for start in starts[row].unique().tolist():
            inside = [p for p in range(loss_mask.shape[1]) if starts[row, p] == start and valid[row, p]]
            chosen += sorted(inside, key=lambda p: int(keys[row, p]))[:num_anchors]
        rows.append(sorted(chosen))
    return rows


def test_packed_anchor_draws_equal_a_per_document_loop():
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        lengths = [torch.randint(2, 20, (3,), generator=generator).tolist() for _ in range(2)]
        width = max(sum(row) for row in lengths)
        positions = torch.stack(
            [torch.cat([packed_positions(row)[0], torch.arange(width - sum(row))]) for row in lengths]
        )
        loss_mask = (torch.rand(2, width, generator=generator) < 0.7).long()
        draw = AnchorDraw(seed=trial, step=1)
        if not valid_anchor_mask(loss_mask, positions).any():
            continue
        anchors, keep = sample_anchors(loss_mask, 3, draw, position_ids=positions)
        expected = reference_anchors(loss_mask, 3, draw, positions)
        assert [anchors[row][keep[row]].tolist() for row in range(2)] == expected
        assert anchors.shape[1] == max(len(row) for row in expected)

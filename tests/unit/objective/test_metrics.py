"""Metrics: acceptance-length convention, per-position accuracy, DFlash2 metrics by hand."""

from __future__ import annotations

import pytest
import torch

from trainer.objective.metrics import (
    acceptance_terms,
    add_terms,
    finalize_terms,
    flatten_terms,
    leading_run,
    ratios,
    selector_terms,
    unary_terms,
)


def test_acceptance_worked_example_is_3_25():
    correct = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1, 1],
            [1, 1, 0, 1, 1, 1, 1],
            [0, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    scored = torch.ones_like(correct)
    assert leading_run(correct, scored).tolist() == [7, 2, 0, 0]
    numerator, denominator = acceptance_terms(correct, scored)
    assert (numerator / denominator).item() == 3.25


def test_unscored_slot_ends_the_run_and_empty_blocks_are_not_counted():
    correct = torch.ones(3, 4, dtype=torch.bool)
    scored = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    assert leading_run(correct, scored).tolist() == [2, 0, 0]
    numerator, denominator = acceptance_terms(correct, scored)
    assert (numerator.item(), denominator.item()) == (3 + 1, 2)  # (2 + 1) + (0 + 1) over 2 blocks


def test_unary_terms_by_hand():
    labels = torch.tensor([[9, 1, 2, 3], [9, 4, 5, 6]])
    predicted = torch.tensor([[0, 1, 7, 3], [0, 4, 5, 0]])
    weights = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.float32)
    terms = finalize_terms(unary_terms(predicted, labels, weights))
    assert terms["accuracy"] == pytest.approx(4 / 5)
    assert (terms["accuracy_position_1"], terms["accuracy_position_2"], terms["accuracy_position_3"]) == (1.0, 0.5, 1.0)
    # block 0 accepts 1 (slot 2 wrong), block 1 accepts 2 (slot 3 unscored): tau = (2 + 3) / 2
    assert terms["tau_unary"] == 2.5


def test_selector_terms_by_hand():
    covered = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    selector_correct = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    unary_correct = torch.tensor([[0, 1, 0], [0, 0, 1]], dtype=torch.bool)
    walk_correct = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    weights = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    terms = finalize_terms(selector_terms(covered, selector_correct, unary_correct, walk_correct, weights))
    assert terms["coverage"] == pytest.approx(4 / 5)
    assert terms["selector_accuracy"] == 3 / 4
    assert terms["unary_accuracy_covered"] == 1 / 4
    assert terms["selector_lift"] == 2 / 4
    assert terms["tau_walk"] == ((1 + 1) + (2 + 1)) / 2
    assert terms["tau_oracle"] == ((2 + 1) + (2 + 1)) / 2


def test_terms_pool_exactly():
    a = {"x": (torch.tensor(1.0), torch.tensor(4.0))}
    b = {"x": (torch.tensor(3.0), torch.tensor(4.0)), "y": (torch.tensor(1.0), torch.tensor(0.0))}
    total = add_terms(add_terms({}, a), b)
    assert finalize_terms(total) == {"x": 0.5}


def test_per_slot_terms_flatten_to_one_name_per_slot_and_pool_as_one_tensor():
    terms = {
        "accuracy_position": (torch.tensor([1.0, 0.0, 2.0]), torch.tensor([2.0, 0.0, 4.0])),
        "tau_walk": (torch.tensor(6.0), torch.tensor(4.0)),
    }
    names, pairs = flatten_terms(terms)
    assert names == ["accuracy_position_1", "accuracy_position_2", "accuracy_position_3", "tau_walk"]
    assert pairs.tolist() == [[1.0, 0.0, 2.0, 6.0], [2.0, 0.0, 4.0, 4.0]]
    # a slot with nothing counted is left out, not reported as 0 or NaN
    assert ratios(names, pairs + pairs) == {"accuracy_position_1": 0.5, "accuracy_position_3": 0.5, "tau_walk": 1.5}

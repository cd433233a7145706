"""Issue 34: a held-out set that mixes thinking on and off reports each mode's metrics beside the
whole set's (`eval_thinking_*`, `eval_no_thinking_*`), from the one forward the batch already takes."""

from __future__ import annotations

import pytest
import torch

from tests.support.drafts import objective_batch, tiny_draft
from trainer.data.dataset import THINKING_COLUMN, THINKING_GROUPS, DFlashCollator
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import RowGroups, draft_objective
from trainer.objective.metrics import add_terms


def evaluate(model, rows: list[int], groups: list[int] | None = None):
    """The evaluation objective (every valid position an anchor) over the given rows of one batch."""
    input_ids, loss_mask, target_hidden, embedding, head = objective_batch(3, batch=3)
    config = ObjectiveConfig(num_anchors=12, loss_type="dpace")
    row_groups = None if groups is None else RowGroups(torch.tensor(groups), THINKING_GROUPS)
    pick = torch.tensor(rows)
    return draft_objective(
        model,
        input_ids[pick],
        loss_mask[pick],
        target_hidden[pick],
        embedding,
        head,
        config,
        None,
        row_groups=row_groups,
    )


def test_each_group_s_terms_are_its_rows_evaluated_alone_and_the_batch_s_are_unchanged():
    model = tiny_draft(seed=11).eval()
    with torch.no_grad():
        grouped = evaluate(model, [0, 1, 2], groups=[1, 0, -1])  # row 0 thinking, row 1 not, row 2 unrecorded
        whole = evaluate(model, [0, 1, 2])
        alone = {"thinking": evaluate(model, [0]), "no_thinking": evaluate(model, [1])}
        unrecorded = evaluate(model, [2])
    assert "tau_walk" in whole.terms  # a DFlash2 draft: the selector's terms are grouped too
    for name, (numerator, denominator) in whole.terms.items():
        torch.testing.assert_close(grouped.terms[name][0], numerator, msg=name)
        torch.testing.assert_close(grouped.terms[name][1], denominator, msg=name)
    summed: dict = {}
    for group, result in alone.items():
        for term, (numerator, denominator) in result.terms.items():
            if term.startswith("loss") and term != "loss_base_unweighted":
                continue  # the weighted losses are the batch's alone
            torch.testing.assert_close(grouped.terms[f"{group}_{term}"][0], numerator, msg=f"{group}_{term}")
            torch.testing.assert_close(grouped.terms[f"{group}_{term}"][1], denominator, msg=f"{group}_{term}")
        add_terms(summed, {term: pair for term, pair in result.terms.items()})
    add_terms(summed, unrecorded.terms)
    for term in ("accuracy", "tau_walk", "tau_unary"):  # the whole is the groups and the unrecorded row
        torch.testing.assert_close(summed[term][1], whole.terms[term][1], msg=term)
        torch.testing.assert_close(summed[term][0], whole.terms[term][0], msg=term)


def test_a_group_the_batch_lacks_is_a_zero_pair_so_every_rank_reduces_one_shape():
    model = tiny_draft(seed=11).eval()
    with torch.no_grad():
        result = evaluate(model, [0, 1], groups=[1, 1])
    thinking = {term[len("thinking_") :] for term in result.terms if term.startswith("thinking_")}
    absent = {term[len("no_thinking_") :] for term in result.terms if term.startswith("no_thinking_")}
    assert thinking == absent and "tau_walk" in thinking
    for term in absent:
        numerator, denominator = result.terms[f"no_thinking_{term}"]
        assert not numerator.any() and not denominator.any(), term
    assert result.terms["thinking_accuracy"][1] == result.terms["accuracy"][1] > 0


@pytest.mark.parametrize(("recorded", "expected"), [([True, False, None], [1, 0, -1]), (None, None)])
def test_the_collator_carries_each_row_s_thinking_switch_when_recorded(recorded, expected):
    samples = [{"input_ids": [5, 6], "loss_mask": [0, 1]} for _ in range(3)]
    if recorded is not None:
        for sample, value in zip(samples, recorded, strict=True):
            sample[THINKING_COLUMN] = value
    batch = DFlashCollator(pad_token_id=0)(samples)
    assert (batch["thinking"].tolist() if "thinking" in batch else None) == expected

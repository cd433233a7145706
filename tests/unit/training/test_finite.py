"""trainer.training.finite: a non-finite step stops (or is skipped) before the optimizer steps."""

from __future__ import annotations

import pytest
import torch

from trainer.training.finite import NonFiniteSteps, weights_are_finite


def nothing_saved() -> str:
    return "no checkpoint saved; there is no good checkpoint yet"


def test_weights_are_finite_looks_at_every_floating_parameter():
    model = torch.nn.Linear(3, 2)
    counts = torch.nn.Parameter(torch.tensor([1, 2]), requires_grad=False)  # integers are never non-finite
    assert weights_are_finite([*model.parameters(), counts], "cpu", world_size=1)
    with torch.no_grad():
        model.bias[1] = float("-inf")
    assert not weights_are_finite(model.parameters(), "cpu", world_size=1)
    assert weights_are_finite([], "cpu", world_size=1)


def test_a_finite_step_passes_and_a_non_finite_loss_of_any_micro_batch_stops_the_run():
    steps = NonFiniteSteps(skip_limit=0, device="cpu", world_size=1)
    steps.note_loss(torch.tensor(1.0))
    steps.check([], torch.tensor(2.0), step=1, nothing_saved=nothing_saved)
    steps.note_loss(torch.tensor(float("nan")))
    steps.note_loss(torch.tensor(1.0))  # a later finite micro-batch does not hide the first
    with pytest.raises(FloatingPointError) as stopped:
        steps.check([], torch.tensor(2.0), step=2, nothing_saved=nothing_saved)
    assert str(stopped.value) == f"non-finite loss at step 2: {nothing_saved()}"
    assert steps.loss_finite is None  # each step is judged on its own losses


def test_a_skipped_step_drops_its_gradients_until_the_budget_is_spent(caplog):
    steps = NonFiniteSteps(skip_limit=1, device="cpu", world_size=1)
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.full((2,), float("nan"))
    steps.check([weight], torch.tensor(float("nan")), step=3, nothing_saved=nothing_saved)
    assert weight.grad is None and steps.skipped_steps == [3]
    assert "non-finite gradient norm (nan) at step 3: step skipped" in caplog.text
    with pytest.raises(FloatingPointError) as stopped:
        steps.check([weight], torch.tensor(float("inf")), step=5, nothing_saved=nothing_saved)
    assert str(stopped.value) == (
        "non-finite gradient norm (inf) at step 5 after skipping 1 step(s) (skip_nonfinite_steps: 1): "
        + nothing_saved()
    )

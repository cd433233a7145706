"""trainer.training.pooling: a step's anchors do not depend on its split; metrics pool as sums."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trainer.objective.blocks import AnchorDraw
from trainer.objective.config import ObjectiveConfig
from trainer.training.pooling import PooledMetrics, draw_step_anchors

SETTINGS = SimpleNamespace(block_size=4, mask_token_id=0)


def rows(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 50, (count, 24), generator=generator)
    loss_mask = torch.zeros(count, 24, dtype=torch.long)
    loss_mask[:, 6:] = 1
    loss_mask[0, 20:] = 0
    return [{"input_ids": input_ids[i : i + 1], "loss_mask": loss_mask[i : i + 1]} for i in range(count)]


def test_the_anchors_and_denominator_of_a_step_do_not_depend_on_how_it_is_split():
    objective = ObjectiveConfig(num_anchors=3)
    draw = AnchorDraw(seed=0, step=5, rank=0)
    whole = rows(2)
    one = [{key: torch.cat([row[key] for row in whole]) for key in whole[0]}]
    reductions = []

    def reduce(total):
        reductions.append(total.clone())
        return total * 2  # as if a second rank had the same sum

    draw_step_anchors(one, SETTINGS, objective, draw, 2, "cpu", reduce)
    split = rows(2)
    draw_step_anchors(split, SETTINGS, objective, draw, 1, "cpu", reduce)
    assert torch.equal(one[0]["anchors"], torch.cat([batch["anchors"] for batch in split]))
    assert torch.equal(one[0]["anchor_keep"], torch.cat([batch["anchor_keep"] for batch in split]))
    assert len(reductions) == 2 and torch.equal(reductions[0], reductions[1])  # one reduce per step
    assert split[0]["loss_denominator"] is split[1]["loss_denominator"]
    assert torch.equal(split[0]["loss_denominator"], reductions[1] * 2)


def test_pooled_metrics_are_ratios_of_sums_reduced_once_then_cleared():
    metrics = PooledMetrics(torch.device("cpu"))
    metrics.add("train", {"accuracy": (torch.tensor(1.0), torch.tensor(4.0))})
    metrics.add("train", {"accuracy": (torch.tensor(3.0), torch.tensor(4.0))})
    metrics.add("eval", {"accuracy": (torch.tensor(1.0), torch.tensor(1.0))})
    assert metrics.pop("train", lambda pairs: pairs * 3) == {"accuracy": 0.5}  # (4 / 8), not a mean of ratios
    assert metrics.pop("train", lambda pairs: pairs) == {}
    assert metrics.pop("eval", lambda pairs: pairs) == {"accuracy": 1.0}

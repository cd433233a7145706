"""What the objective reads from a batch besides its tokens: the target's features and the anchors.

Online batches carry no features: the frozen target runs on them here (on packed rows too, which
`train_run` checked it keeps apart: `FrozenTarget.check_packing`). Offline batches carry them from
the feature store. Training batches carry the anchors `get_batch_samples` drew for the whole step
(`trainer.training.pooling`); evaluation ones get deterministic anchors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainer.objective.blocks import sample_anchors


def target_features(
    target: Any, inputs: dict[str, Any], layer_ids: Sequence[int], distills: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's hidden states at `layer_ids` and, when distilling, its final hidden states."""
    target_hidden, target_final = inputs.get("target_hidden"), inputs.get("target_final_hidden")
    if target_hidden is None:
        captured = target.capture(
            inputs["input_ids"],
            inputs.get("attention_mask"),
            layer_ids,
            final_hidden=distills,
            position_ids=inputs.get("position_ids"),
        )
        return captured if distills else (captured, None)
    if distills and target_final is None:
        raise ValueError(
            "kd_weight > 0: the offline features hold no target final hidden states; "
            "build the datasets with final_hidden=True (train.py and prepare.py do for a distilling recipe)"
        )
    return target_hidden, target_final


def batch_anchors(inputs: dict[str, Any], eval_num_anchors: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's drawn anchors, or in evaluation deterministic ones (by default at every valid position)."""
    if "anchors" in inputs:
        return inputs["anchors"], inputs["anchor_keep"]
    loss_mask = inputs["loss_mask"]
    count = eval_num_anchors or loss_mask.shape[1]
    return sample_anchors(loss_mask, count, draw=None, position_ids=inputs.get("position_ids"))

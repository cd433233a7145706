"""How many anchors a row gets at a context length (docs/planning.md, "Anchors at long context").

Anchors are drawn uniformly without replacement among a row's valid positions (`sample_anchors`),
so a fixed count spreads thinner as the supervised part grows: 512 anchors over a 30K-token answer
put an anchor on one supervised position in 59, and three quarters of the positions then fall in
no block at all. The rule keeps the 4K recipes' density, one anchor slot per 6 supervised tokens
(512 for their 3,072-token answers), and `trainer.plan.memory.fitting_anchors` caps it at what one micro-batch row
leaves room for on the planned GPUs. The context before the answer costs memory, not anchors.
"""

from __future__ import annotations

REFERENCE_SUPERVISED = 3072  # the 4K recipes' answers: max_new_tokens 3072 (prompts up to 1024)
REFERENCE_ANCHORS = 512
SUPERVISED_PER_ANCHOR = REFERENCE_SUPERVISED // REFERENCE_ANCHORS  # 6
ANCHOR_MULTIPLE = 8
MIN_ANCHORS = 16  # the demo recipe's count, for tiny answers


def supervised_bound(data_args) -> int:
    """The most supervised tokens one sample can hold: a regenerated answer's `max_new_tokens`
    (only the target's answer is supervised), else the whole `max_length`."""
    if getattr(data_args, "regenerate", False):
        return min(data_args.max_new_tokens, data_args.max_length)
    return data_args.max_length


def anchors_for_supervised(supervised: int) -> int:
    """One anchor slot per 6 supervised tokens (the 4K recipes' 512 for 3,072), rounded up to a
    multiple of 8, at least 16: the same share of a long sample's answer is trained as of a 4K
    one. `trainer.plan.memory.fitting_anchors` then caps it at what the GPUs hold."""
    if supervised < 1:
        raise ValueError(f"supervised tokens must be >= 1 (got {supervised})")
    anchors = -(-supervised // SUPERVISED_PER_ANCHOR)
    return max(MIN_ANCHORS, -(-anchors // ANCHOR_MULTIPLE) * ANCHOR_MULTIPLE)


def block_coverage(num_anchors: int, supervised: int, block_size: int) -> float:
    """The expected share of `supervised` positions that some block predicts in one step.

    Anchors are a uniform draw of min(N, V) of the V ≈ `supervised` valid positions; a position is
    predicted when one of the B - 1 positions before it is an anchor (1 - the chance that none of
    them is, drawing without replacement)."""
    if supervised < 1 or block_size < 2:
        raise ValueError(f"supervised={supervised}, block_size={block_size}: need >= 1 and >= 2")
    chosen = min(num_anchors, supervised)
    missed = 1.0
    for index in range(min(block_size - 1, supervised)):
        missed *= max(supervised - chosen - index, 0) / (supervised - index)
    return 1.0 - missed

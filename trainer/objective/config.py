"""The objective's settings: every knob of the DFlash / DFlash2 loss declared once, with its default,
its help text and its validation, plus the schedule and chunk sizes derived from them. Torch-free,
so the recipe parser (`DFlashTrainingArguments` inherits these fields) and the memory planner read
the same definitions without building anything.
"""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, field
from typing import Any

from trainer.recipe_types import Rule, above, at_least, between, check_fields, one_of

LOSS_TYPES = ("ce", "dpace", "kd")
DPACE_WEIGHTINGS = ("full", "prefix", "suffix")
SELECTOR_GOLD_MODES = ("skip", "insert")


def default_gamma(block_size: int) -> float | None:
    """gamma 7 for B = 16 and 4 for B = 8 (the published recipes); no decay otherwise."""
    return {16: 7.0, 8: 4.0}.get(block_size)


RECIPE_KEY = "recipe_key"  # field metadata: the recipe key of a field whose recipe name differs from its own


def _knob(default: Any, help: str, recipe_key: str | None = None) -> Any:
    """A field with its default and the help text `--help` prints for its recipe key."""
    metadata = {"help": help, **({RECIPE_KEY: recipe_key} if recipe_key else {})}
    return field(default=default, metadata=metadata)


def recipe_key(knob: Field) -> str:
    """The recipe key (and training-argument name) of one of ObjectiveConfig's fields."""
    return knob.metadata.get(RECIPE_KEY, knob.name)


@dataclass
class ObjectiveConfig:
    """Knobs of the objective. Defaults are those of the published recipes where they name one.

    Each field is declared here once, with its help text: `DFlashTrainingArguments` inherits them
    under their recipe keys (`recipe_key`; only `chunk_blocks` is spelled `loss_chunk_blocks` there)
    and `objective_config()` builds this from them, so the validation below (`OBJECTIVE_RULES`) is the only one.
    """

    num_anchors: int = _knob(512, "Anchor (block) slots per sequence.")
    loss_type: str = _knob(
        "ce",
        "ce (gamma-decayed CE) | dpace (dynamic position-aware CE, weights from dpace_weighting) | kd "
        "(gamma-decayed distillation from the target: ce with kd_weight 1).",
    )
    gamma: float | None = _knob(None, "Position decay exp(-(k-1)/gamma); unset: 7 for B=16, 4 for B=8; 0: off.")
    dpace_alpha: float = _knob(0.5, "D-PACE smoothing in [0, 1]: s_k = (1 - alpha) exp(-l_k) + alpha.")
    dpace_weighting: str = _knob("full", "D-PACE weights: full (W_k) | prefix (P_k) | suffix (W_k / P_k).")
    kd_weight: float | None = _knob(
        None, "Share of distillation in each slot's loss, (1 - w) CE + w T^2 KL; unset: 1 for kd, else 0."
    )
    kd_temperature: float = _knob(1.0, "Temperature of both distributions in the KD term.")
    chunk_blocks: int = _knob(
        16,
        "Blocks per LM-head chunk: one chunk of logits is the loss head's peak memory.",
        recipe_key="loss_chunk_blocks",
    )
    selector_alpha: float = _knob(1.0, "Weight of the selector's cross-entropy; 0 freezes the selector.")
    selector_warmup_ratio: float = _knob(0.0, "Share of the steps before the selector term starts (alpha 0).")
    selector_ramp_ratio: float = _knob(0.0, "Share of the steps over which alpha then ramps up to selector_alpha.")
    selector_gold: str = _knob(
        "skip",
        "skip (gold outside the strict top-K gets weight 0, as serving never injects gold) | insert (gold "
        "replaces the weakest candidate, training only).",
    )
    selector_stop_gradient: bool = _knob(False, "The selector term does not reach the backbone.")

    def __post_init__(self) -> None:
        check_fields(self, OBJECTIVE_RULES, name_of=recipe_key)  # named by recipe key (loss_chunk_blocks)
        if self.loss_type == "kd" and self.kd_weight == 0:
            raise ValueError("loss_type kd with kd_weight 0 distills nothing: use loss_type ce, or kd_weight > 0.")

    def resolved_gamma(self, block_size: int) -> float | None:
        gamma = default_gamma(block_size) if self.gamma is None else self.gamma
        return gamma if gamma is not None and gamma > 0 else None

    @property
    def resolved_kd_weight(self) -> float:
        if self.kd_weight is not None:
            return self.kd_weight
        return 1.0 if self.loss_type == "kd" else 0.0

    @property
    def distills(self) -> bool:
        """Whether the objective needs the target's final hidden states (the teacher's logits)."""
        return self.resolved_kd_weight > 0

    @property
    def selector_enabled(self) -> bool:
        """Configured alpha == 0 freezes the selector and skips its term."""
        return self.selector_alpha > 0


# Each knob's range (by field name), checked by `check_fields` here and where a recipe value is read.
OBJECTIVE_RULES: dict[str, Rule] = {
    "num_anchors": at_least(1),
    "loss_type": one_of(*LOSS_TYPES),
    "gamma": at_least(0, "(0: no decay)"),
    "dpace_alpha": between(0, 1),
    "dpace_weighting": one_of(*DPACE_WEIGHTINGS),
    "kd_weight": between(0, 1),
    "kd_temperature": above(0),
    "chunk_blocks": at_least(1),
    "selector_alpha": at_least(0, "(0: the selector is frozen)"),
    "selector_warmup_ratio": between(0, 1),
    "selector_ramp_ratio": between(0, 1),
    "selector_gold": one_of(*SELECTOR_GOLD_MODES),
}


def selector_alpha_at(step: int | None, total_steps: int | None, config: ObjectiveConfig) -> float:
    """alpha_eff: 0 during warmup, a linear ramp, then alpha; alpha itself with no step context.

    warm = floor(T * warmup), ramp = floor(T * ramp); alpha * clamp((step - warm + 1) / ramp, 0, 1).
    """
    alpha = config.selector_alpha
    if step is None or total_steps is None:
        return alpha
    warm = math.floor(total_steps * config.selector_warmup_ratio)
    ramp = math.floor(total_steps * config.selector_ramp_ratio)
    if step < warm:
        return 0.0
    if ramp <= 0:
        return alpha
    return alpha * min(max((step - warm + 1) / ramp, 0.0), 1.0)


def selector_chunk_blocks(chunk_blocks: int, vocab_size: int, rank: int, top_k: int) -> int:
    """Blocks per selector chunk: its [rows, K, r] codebook rows take no more memory than one LM-head
    chunk's [rows, V] logits of `chunk_blocks` blocks, so the selector never raises the loss head's
    peak (the planner sizes the loss head with this same function)."""
    return chunk_blocks * max(1, vocab_size // max(1, top_k * rank))

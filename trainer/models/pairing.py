"""The one draft-target pair check: whether a draft config fits a target, from the target's
dimensions alone (hidden size, vocabulary rows, depth).

Training (`FrozenTarget.check_draft`), planning (`trainer.plan.facts.check_pair`) and the export
(contract rules 10, 12 and 13 with a target) all call `pair_violations`, so a pair gets the same
verdict, in the same words, wherever it is checked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modeling_dflash2.configuration_dflash2 import is_int


@dataclass(frozen=True)
class TargetDimensions:
    """What a draft must match in its target (rules 10, 12, 13), and the card's base_model."""

    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass(frozen=True)
class PairViolation:
    """One way a draft does not fit its target: the contract rule it breaks and the one-line reason."""

    rule: int
    message: str

    def __str__(self) -> str:
        return self.message


def pair_violations(
    *,
    hidden_size: object,
    vocab_size: object,
    target_layer_ids: object,
    num_target_layers: object,
    target: TargetDimensions,
) -> list[PairViolation]:
    """Every way the draft's fields do not fit `target` (empty when they fit). The fields may be raw
    config.json values: ones that are not integers are the config rules' to report, and are skipped here."""
    found = []
    if is_int(hidden_size) and hidden_size != target.hidden_size:
        found.append(
            PairViolation(
                12,
                f"hidden_size {hidden_size} != the target's hidden size {target.hidden_size} "
                "(the draft runs at the target's width)",
            )
        )
    if is_int(vocab_size) and vocab_size != target.vocab_size:
        found.append(
            PairViolation(
                13,
                f"vocab_size {vocab_size} != the target's padded vocab {target.vocab_size} "
                "(the selector codebooks are indexed by target token id)",
            )
        )
    ids = list(target_layer_ids) if isinstance(target_layer_ids, (list, tuple)) else []
    too_deep = [layer_id for layer_id in ids if is_int(layer_id) and layer_id >= target.num_layers]
    if too_deep:
        found.append(
            PairViolation(
                10,
                f"dflash_config.target_layer_ids {ids} reach past the target's {target.num_layers} layers: {too_deep}",
            )
        )
    if num_target_layers is not None and num_target_layers != target.num_layers:
        found.append(
            PairViolation(10, f"num_target_layers {num_target_layers} != the target's depth {target.num_layers}")
        )
    return found


def check_pair(
    *,
    hidden_size: int,
    vocab_size: int,
    target_layer_ids: Sequence[int],
    num_target_layers: int | None,
    target: TargetDimensions,
) -> None:
    """Refuse a draft that does not fit `target`, in one line naming each field."""
    found = pair_violations(
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        target_layer_ids=target_layer_ids,
        num_target_layers=num_target_layers,
        target=target,
    )
    if found:
        raise ValueError(f"the draft does not fit the target {target.name}: " + "; ".join(map(str, found)))

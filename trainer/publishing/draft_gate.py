"""The export's rules applied to the recipe's draft before training, so a draft the export would
refuse is refused with the export's own rule and message before any work is lost: the config-only
rules as the config is read (`load_draft_config`), the rules that need the target once it is loaded
(`check_draft_for_target`). `dflash2 train`, `plan`, `prepare` and the rehearsal read the draft here.

A DFlash v1 config trains (it is `make compare`'s baseline) with a warning that it cannot be
exported, and is refused up front only when the run would end by pushing it."""

from __future__ import annotations

import functools
import logging
from typing import Any

from modeling_dflash2 import DFlash2Config
from trainer.models.draft import read_draft_config
from trainer.models.pairing import TargetDimensions
from trainer.publishing.contract import RULE_22_V1, check_exportable_draft

logger = logging.getLogger(__name__)

V1_TRAINS = (
    "%s is a DFlash v1 draft: it trains (as the baseline of make compare) and dflash2 evaluate reads it, "
    "but export and push_to_hub refuse it (docs/contract.md rule 22)"
)
V1_PUSH = "; push_to_hub would fail after training: unset push_to_hub, or train a DFlash2 draft_config"


def load_draft_config(model_args: Any, *, building: bool = True) -> DFlash2Config:
    """The recipe's draft config (`read_draft_config`), refused when the export would refuse it; a
    v1 draft only warns."""
    config, source = read_draft_config(model_args, building=building)
    if config.is_dflash2:
        check_exportable_draft(config, source)
    else:
        _warn_v1(source)
    return config


@functools.cache
def _warn_v1(source: str) -> None:
    """Once per config: the planner's memory check reads the draft config before training does."""
    logger.warning(V1_TRAINS, source)


def check_draft_for_target(config: DFlash2Config, target: Any, push_to_hub: bool = False) -> None:
    """Once the target is loaded, before training: the export's rules that need it (the pair check
    of rules 10, 12, 13) with its messages; a v1 draft is refused only when the run ends with a
    push, which would export it. `target` is a loaded `FrozenTarget` (or anything with its sizes)."""
    if not config.is_dflash2:
        if push_to_hub:
            raise ValueError(RULE_22_V1.format(source="the draft") + V1_PUSH)
        return
    dimensions = TargetDimensions(str(target.source_name), target.hidden_size, target.vocab_rows, target.num_layers)
    check_exportable_draft(config, "the draft", dimensions)

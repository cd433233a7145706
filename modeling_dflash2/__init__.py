# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dflash2-hub authors. Shipped inside every exported checkpoint under this licence.
"""DFlash / DFlash2 draft models, laid out as a transformers model folder (configuration, modeling,
ops, generation, checkpoint); every file but this one is also shipped inside every checkpoint."""

from .configuration_dflash2 import DFlash2Config, DFlashSettings, resolve_dflash_settings
from .generation_dflash2 import SamplingSettings, SpeculativeOutput, speculative_generate
from .modeling_dflash2 import (
    DFlash2CandidateSelector,
    DFlash2DecoderLayer,
    DFlash2DraftModel,
    DFlash2GroupedDynamicConv,
    DFlashDraftModel,
    join_lattices,
    unary_transform,
)
from .ops_dflash2 import block_visibility, grouped_dynamic_causal_conv

__all__ = [
    "DFlash2CandidateSelector",
    "DFlash2Config",
    "DFlash2DecoderLayer",
    "DFlash2DraftModel",
    "DFlash2GroupedDynamicConv",
    "DFlashDraftModel",
    "DFlashSettings",
    "SamplingSettings",
    "SpeculativeOutput",
    "block_visibility",
    "grouped_dynamic_causal_conv",
    "join_lattices",
    "resolve_dflash_settings",
    "speculative_generate",
    "unary_transform",
]

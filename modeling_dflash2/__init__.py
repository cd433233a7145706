# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dflash2-hub authors. Shipped inside every exported checkpoint under this licence.
"""DFlash / DFlash2 draft models (the code also shipped inside every checkpoint)."""

from .configuration_dflash2 import DFlash2Config, DFlashSettings, resolve_dflash_settings
from .modeling_dflash2 import (
    DFlash2CandidateSelector,
    DFlash2DecoderLayer,
    DFlash2DraftModel,
    DFlash2GroupedDynamicConv,
    DFlashDraftModel,
    SamplingSettings,
    SpeculativeOutput,
    block_visibility,
    grouped_dynamic_causal_conv,
    join_lattices,
    speculative_generate,
    unary_transform,
)

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

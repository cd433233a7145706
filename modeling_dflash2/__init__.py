"""DFlash / DFlash2 draft models (the code also shipped inside every checkpoint)."""

from .configuration_dflash2 import DFlash2Config, DFlashSettings, resolve_dflash_settings
from .modeling_dflash2 import (
    DFlash2CandidateSelector,
    DFlash2DecoderLayer,
    DFlash2DraftModel,
    DFlash2GroupedDynamicConv,
    DFlashDraftModel,
    block_visibility,
    grouped_dynamic_causal_conv,
    join_lattices,
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
    "block_visibility",
    "grouped_dynamic_causal_conv",
    "join_lattices",
    "resolve_dflash_settings",
    "unary_transform",
]

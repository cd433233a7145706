"""Warm starts from released drafts: z-lab DFlash2, z-lab DFlash v1, and this project's checkpoints.

The recipe's draft config decides the architecture; `init_from` provides weights. The two must
agree on everything that gives a tensor its meaning: widths and depth, vocabulary, mask token,
target layers and, unless the recipe explicitly allows it, block size. DFlash v1 sources have no
conv or selector tensors; those start as identity convs and a no-op selector, so the DFlash2
draft computes exactly what the v1 draft computed at step 0. Key-level problems (missing,
unexpected, mis-shaped tensors, part of the DFlash2 modules) are refused by
`DFlashDraftModel.from_pretrained`, naming the keys.
"""

from __future__ import annotations

import logging
import os

import torch

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from trainer.fileio import check_local_checkpoint
from trainer.models.config_bounds import FLOAT32_BYTES, check_checkpoint_config
from trainer.models.loading import assert_draft_class, from_pretrained_safetensors

logger = logging.getLogger(__name__)

# The draft trains with float32 master weights, as a fresh draft does; mixed precision comes from
# TrainingArguments (bf16 autocast), never from the `dtype` a config file happens to record.
TRAINING_DTYPE = torch.float32

# Fields whose disagreement makes the source's weights meaningless for the recipe's draft.
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)
DFLASH_FIELDS = ("mask_token_id", "target_layer_ids")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Fields that change serving numerics without changing shapes: reported, not refused.
SEMANTIC_FIELDS = (
    "rope_base",
    "layer_types",
    "sliding_window",
    "is_causal",
    "output_multiplier",
    "final_logit_softcapping",
)


def _value(config: DFlash2Config, name: str):
    settings = config.dflash_settings
    return getattr(settings, name) if hasattr(settings, name) else getattr(config, name, None)


def check_warm_start_compatible(
    source: DFlash2Config, recipe: DFlash2Config, *, source_name: str, allow_block_size_change: bool = False
) -> None:
    """Refuse an `init_from` whose config disagrees with the recipe's draft config, naming the field."""
    if not recipe.is_dflash2:
        raise ValueError("The recipe's draft config must describe a DFlash2DraftModel.")
    checked = SHAPE_FIELDS + DFLASH_FIELDS + (DFLASH2_FIELDS if source.is_dflash2 else ())
    for name in checked:
        mine, theirs = _value(recipe, name), _value(source, name)
        if theirs != mine:
            raise ValueError(f"init_from {source_name}: {name}={theirs!r} but the recipe's draft config has {mine!r}.")
    if source.num_target_layers is not None and source.num_target_layers != recipe.num_target_layers:
        raise ValueError(
            f"init_from {source_name}: num_target_layers={source.num_target_layers} but the recipe's draft "
            f"config has {recipe.num_target_layers} (the draft was trained on a different target)."
        )
    if source.block_size != recipe.block_size and not allow_block_size_change:
        raise ValueError(
            f"init_from {source_name}: block_size={source.block_size} but the recipe's draft config has "
            f"{recipe.block_size}; set init_allow_block_size_change: true to retrain at the new block size."
        )
    for name in SEMANTIC_FIELDS:
        mine, theirs = _value(recipe, name), _value(source, name)
        if theirs != mine:
            logger.warning("init_from %s: %s=%r, the recipe uses %r.", source_name, name, theirs, mine)


# Bytes per parameter of a warm start: the fp32 draft, and the checkpoint's tensors as read (at most fp32).
WARM_START_BYTES_PER_PARAMETER = 2 * FLOAT32_BYTES


def check_init_from(init_from: str | os.PathLike, **hub_kwargs) -> str:
    """`init_from` checked before anything is built from it: the path exists, its weights are
    safetensors (never pickles) and whole, and its config.json (read alone) has sizes within bounds
    and a draft that fits in memory. Returns the spec to load from."""
    init_from = check_local_checkpoint(init_from, "init_from", hub_kwargs.get("subfolder"))
    check_checkpoint_config(
        init_from,
        "init_from",
        purpose="warm-starting from this checkpoint",
        bytes_per_parameter=WARM_START_BYTES_PER_PARAMETER,
        detail="the fp32 draft and the checkpoint's tensors as read",
        **hub_kwargs,
    )
    return init_from


def warm_start(
    init_from: str | os.PathLike,
    recipe_config: DFlash2Config,
    *,
    allow_block_size_change: bool = False,
    **hub_kwargs,
) -> DFlash2DraftModel:
    """A DFlash2 draft with the recipe's config and `init_from`'s weights (dir or Hub id)."""
    source_name = str(init_from)
    init_from = check_init_from(init_from, **hub_kwargs)
    source = DFlash2Config.from_pretrained(init_from, **hub_kwargs)
    check_warm_start_compatible(
        source, recipe_config, source_name=source_name, allow_block_size_change=allow_block_size_change
    )
    model = from_pretrained_safetensors(
        DFlash2DraftModel, init_from, "init_from", config=recipe_config, dtype=TRAINING_DTYPE, **hub_kwargs
    )
    assert_draft_class(model)
    logger.info(
        "Warm start from %s (%s): %s",
        source_name,
        source.dflash_settings.architecture,
        "all tensors loaded" if source.is_dflash2 else "backbone loaded, convs identity, selector no-op",
    )
    return model

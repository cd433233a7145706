"""The recipe's draft, from `draft_config` or `init_from`: its config (which the planner reads
without building anything) and the model training builds from it (fresh, warm-started, LoRA)."""

from __future__ import annotations

from typing import Any

from torch import nn

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from trainer.fileio import require_existing_path
from trainer.models.config_bounds import FLOAT32_BYTES, bounds_violations, check_draft_config, read_config_file
from trainer.models.warm_start import check_init_from, warm_start
from trainer.recipe_files import resolve_path

V1_INIT_FROM = "init_from is a DFlash v1 draft: give a DFlash2 draft_config for the new modules."
NO_DRAFT = "draft_config is required (or init_from a DFlash2 checkpoint)."


def load_draft_config(model_args: Any, *, building: bool = True) -> DFlash2Config:
    """The recipe's draft config: `draft_config`, else a DFlash2 `init_from`'s config.json, read
    alone and its sizes bounded before anything is built. `building=False` (the planner, which builds
    on the meta device) skips the check that this machine's memory holds the fp32 weights."""
    if model_args.draft_config:
        path = resolve_path(model_args.draft_config, "draft_config")
        values = read_config_file(path, "draft_config")
        if building:
            check_draft_config(
                values,
                f"draft_config {path}",
                purpose="building this draft",
                bytes_per_parameter=FLOAT32_BYTES,
                detail="its fp32 weights",
            )
        elif failures := bounds_violations(values):
            raise ValueError(f"draft_config {path}: " + "; ".join(failures))
        return DFlash2Config.from_json_file(path)
    if model_args.init_from:
        spec = (
            check_init_from(model_args.init_from)
            if building
            else require_existing_path(model_args.init_from, "init_from")
        )
        config = DFlash2Config.from_pretrained(spec)
        if not config.is_dflash2:
            raise ValueError(V1_INIT_FROM)
        return config
    raise ValueError(NO_DRAFT)


def build_draft(model_args: Any) -> nn.Module:
    """The recipe's draft: fresh, warm-started from `init_from`, and optionally wrapped with LoRA."""
    config = load_draft_config(model_args)
    config._attn_implementation = model_args.attn_implementation
    if model_args.init_from:
        draft = warm_start(
            model_args.init_from, config, allow_block_size_change=model_args.init_allow_block_size_change
        )
    else:
        # a v1 config (no conv, no selector) trains a DFlash v1 draft with the same objective
        draft = DFlash2DraftModel(config) if config.is_dflash2 else DFlashDraftModel(config)
    if model_args.lora_r > 0:
        if not model_args.init_from:
            raise ValueError("lora_r > 0 fine-tunes a warm-started draft: set init_from.")
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=model_args.lora_target_modules,
            task_type=None,
        )
        draft = get_peft_model(draft, lora)
    return draft

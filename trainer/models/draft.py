"""The recipe's draft, from `draft_config` or `init_from`: its config (which the planner reads
without building anything) and the model training builds from it (fresh, warm-started, LoRA).

A draft config the export would refuse is refused here, before anything is built or trained, by the
export's own rules (`trainer.publishing.contract.draft_config_violations`): the config-only rules as
the config is read, the rules that need the target once it is loaded (`check_draft_for_target`).
A DFlash v1 config trains (it is `make compare`'s baseline) with a warning that it cannot be
exported, and is refused up front only when the run would end by pushing it.

flex_attention trains only where torch has its backward (CUDA): a CPU run asking for it is refused
before anything loads (`check_attention_for_training`); its forward runs anywhere, and
`flex_forward_gap` measures it against sdpa on a batch."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from trainer.fileio import require_existing_path
from trainer.models.config_bounds import FLOAT32_BYTES, bounds_violations, check_draft_config, read_config_file
from trainer.models.warm_start import check_init_from, warm_start
from trainer.objective.blocks import build_blocks, sample_anchors
from trainer.objective.loss import embed_draft_ids
from trainer.objective.masks import attention_masks
from trainer.publishing.contract import RULE_22_V1, TargetDimensions, check_exportable_draft
from trainer.recipe_files import resolve_path

logger = logging.getLogger(__name__)

V1_INIT_FROM = "init_from is a DFlash v1 draft: give a DFlash2 draft_config for the new modules."
NO_DRAFT = "draft_config is required (or init_from a DFlash2 checkpoint)."
V1_TRAINS = (
    "%s is a DFlash v1 draft: it trains (as the baseline of make compare) and dflash2 evaluate reads it, "
    "but export and push_to_hub refuse it (docs/contract.md rule 22)"
)
V1_PUSH = "; push_to_hub would fail after training: unset push_to_hub, or train a DFlash2 draft_config"
FLEX_ON_CPU = (
    "attn_implementation: flex_attention cannot train on CPU: torch has no CPU backward for flex_attention; "
    "use attn_implementation: sdpa here (the GPU run keeps flex_attention)"
)


def _read_config(path: Any, source: str) -> DFlash2Config:
    """`DFlash2Config.from_json_file`, its one-line error naming the file."""
    try:
        return DFlash2Config.from_json_file(path)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def _checked(config: DFlash2Config, source: str) -> DFlash2Config:
    """The export's config-only rules, before anything is built: a v1 draft only warns."""
    if config.is_dflash2:
        check_exportable_draft(config, source)
    else:
        _warn_v1(source)
    return config


@functools.cache
def _warn_v1(source: str) -> None:
    """Once per config: the planner's memory check reads the draft config before training does."""
    logger.warning(V1_TRAINS, source)


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
        return _checked(_read_config(path, f"draft_config {path}"), f"draft_config {path}")
    if model_args.init_from:
        spec = (
            check_init_from(model_args.init_from)
            if building
            else require_existing_path(model_args.init_from, "init_from")
        )
        try:
            config = DFlash2Config.from_pretrained(spec)
        except ValueError as error:
            raise ValueError(f"init_from {spec}: {error}") from None
        if not config.is_dflash2:
            raise ValueError(V1_INIT_FROM)
        return _checked(config, f"init_from {spec}")
    raise ValueError(NO_DRAFT)


def check_draft_for_target(config: DFlash2Config, target: Any, push_to_hub: bool = False) -> None:
    """Once the target is loaded, before training: the export's rules that need it (mask id, depth,
    hidden size, vocabulary: rules 9, 10, 12, 13) with its messages; a v1 draft is refused only when
    the run ends with a push, which would export it. `target` is a loaded `FrozenTarget`."""
    if not config.is_dflash2:
        if push_to_hub:
            raise ValueError(RULE_22_V1.format(source="the draft") + V1_PUSH)
        return
    dimensions = TargetDimensions(
        name=str(target.source_name),
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_rows,
        num_layers=target.num_layers,
    )
    check_exportable_draft(config, "the draft", dimensions)


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


def check_attention_for_training(implementation: str, device: torch.device) -> None:
    """Refuse flex_attention on a CPU run before anything loads: torch has no CPU backward for it,
    so the first training step would fail (under FSDP2 only after the first evaluation, which
    needs no gradients). `device` is the run's (`TrainingArguments.device`, known once the
    arguments are parsed: `use_cpu`, accelerate's ACCELERATE_USE_CPU, else the accelerator found)."""
    if implementation == "flex_attention" and device.type == "cpu":
        raise ValueError(FLEX_ON_CPU)


@torch.no_grad()
def flex_forward_gap(
    draft: nn.Module, batch: Mapping[str, torch.Tensor], embedding_weight: torch.Tensor, num_anchors: int | None = None
) -> float:
    """Max |flex_attention - sdpa| over the draft's block outputs on one batch (no gradients).

    `batch` is a collated batch with its target features: `input_ids`, `loss_mask`, `target_hidden`
    and, for packed rows, `position_ids`; `embedding_weight` the target's input embedding. Anchors
    are taken as evaluation takes them (the first `num_anchors` valid positions of each document,
    default all), and each backend gets the masks training builds for it (flex: BlockMasks; sdpa:
    dense bool masks), so packed rows and sliding-window layers are covered as the draft has them.
    The draft's attention setting is restored afterwards.
    """
    settings = draft.dflash
    input_ids, loss_mask, position_ids = batch["input_ids"], batch["loss_mask"], batch.get("position_ids")
    count = num_anchors or loss_mask.shape[1]
    anchors, keep = sample_anchors(loss_mask, count, draw=None, position_ids=position_ids)
    size, mask_id = settings.block_size, settings.mask_token_id
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, size, mask_id, position_ids)
    dtype = next(draft.parameters()).dtype
    noise = embed_draft_ids(embedding_weight, blocks.draft_ids, settings.input_embedding_scale).to(dtype)
    target_hidden = batch["target_hidden"].to(dtype)
    previous = draft.config._attn_implementation
    outputs = {}
    try:
        for backend in ("sdpa", "flex_attention"):
            draft.config._attn_implementation = backend
            outputs[backend] = draft(
                position_ids=blocks.model_position_ids(),
                noise_embedding=noise,
                target_hidden=target_hidden,
                attention_mask=attention_masks(blocks, settings, backend),
            )
    finally:
        draft.config._attn_implementation = previous
    return float((outputs["flex_attention"].float() - outputs["sdpa"].float()).abs().max())

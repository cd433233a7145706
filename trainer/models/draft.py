"""The recipe's draft, from `draft_config` or `init_from`: its config (which the planner reads
without building anything) and the model training builds from it (fresh, warm-started, LoRA).

`read_draft_config` applies the config's own rules and the size bounds; the export's stricter rules,
which training also applies before anything is built, are `trainer.publishing.draft_gate`'s.

flex_attention trains only where torch has its backward (CUDA): a CPU run asking for it is refused
before anything loads (`check_attention_for_training`); its forward runs anywhere, and
`flex_forward_gap` measures it against sdpa on a batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from trainer.fileio import read_json_object, require_existing_path
from trainer.models.config_bounds import FLOAT32_BYTES, MAX_CONFIG_BYTES, bounds_violations, check_draft_config
from trainer.models.warm_start import check_init_from, warm_start
from trainer.objective.blocks import build_blocks, sample_anchors
from trainer.objective.loss import embed_draft_ids
from trainer.objective.masks import attention_masks
from trainer.recipe_files import resolve_path

if TYPE_CHECKING:
    from peft import PeftModel

V1_INIT_FROM = "init_from is a DFlash v1 draft: give a DFlash2 draft_config for the new modules."
NO_DRAFT = "draft_config is required (or init_from a DFlash2 checkpoint)."
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


def read_draft_config(model_args: Any, *, building: bool = True) -> tuple[DFlash2Config, str]:
    """The recipe's draft config and where it came from (for messages): `draft_config`, else a
    DFlash2 `init_from`'s config.json, read alone and its sizes bounded before anything is built.
    `building=False` (the planner, which builds on the meta device) skips the check that this
    machine's memory holds the fp32 weights. The export's stricter rules are
    `trainer.publishing.draft_gate`'s to add."""
    if model_args.draft_config:
        path = resolve_path(model_args.draft_config, "draft_config")
        source = f"draft_config {path}"
        values = read_json_object(path, "draft_config", MAX_CONFIG_BYTES)
        if building:
            check_draft_config(
                values,
                source,
                purpose="building this draft",
                bytes_per_parameter=FLOAT32_BYTES,
                detail="its fp32 weights",
            )
        elif failures := bounds_violations(values):
            raise ValueError(f"{source}: " + "; ".join(failures))
        return _read_config(path, source), source
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
        return config, f"init_from {spec}"
    raise ValueError(NO_DRAFT)


def build_draft(model_args: Any) -> DFlashDraftModel | PeftModel:
    """The recipe's draft: fresh, warm-started from `init_from`, and optionally wrapped with LoRA."""
    config, _ = read_draft_config(model_args)
    config._attn_implementation = model_args.attn_implementation
    draft: DFlashDraftModel | PeftModel
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
    draft: DFlashDraftModel,
    batch: Mapping[str, torch.Tensor],
    embedding_weight: torch.Tensor,
    num_anchors: int | None = None,
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

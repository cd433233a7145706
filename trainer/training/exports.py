"""What a training run publishes: exports of the draft (contract-validated), never raw checkpoints.

`DFlash2Trainer.push_to_hub` and the push-on-save callback (`trainer.training.callbacks`) both go
through `export_and_publish`, so every upload is one commit of a folder `dflash2 export` would write.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeling_dflash2 import DFlash2DraftModel
from trainer.publishing.contract import TargetDimensions
from trainer.publishing.export import export_draft
from trainer.publishing.hub import publish
from trainer.training import checkpointing
from trainer.training.output_dir import output_path

if TYPE_CHECKING:
    from trainer.training.trainer import DFlash2Trainer


def draft_for_export(trainer: DFlash2Trainer) -> Any:
    """A plain DFlash2DraftModel with the trained weights (gathered under FSDP, LoRA merged)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.is_fsdp_enabled:
        plain = DFlash2DraftModel(model.config)
        plain.load_state_dict(checkpointing.full_state_dict(trainer.model))
        return plain
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


def export_and_publish(trainer: DFlash2Trainer, folder: Path, commit_message: str) -> Any:
    """Export the current draft into `folder` and publish it as one commit (rank 0; every rank
    joins the gather under FSDP). Returns the commit, None on the other ranks."""
    draft = draft_for_export(trainer)
    if not trainer.is_world_process_zero():
        return None
    target = trainer.target
    dimensions = TargetDimensions(
        name=trainer.target_hub_id or target.source_name,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_rows,
        num_layers=target.num_layers,
    )
    evaluations = [log for log in trainer.state.log_history if "eval_loss" in log]
    record = {
        **trainer.checkpointing.recipe_record(),
        "global_step": trainer.state.global_step,
        "evaluation": evaluations[-1] if evaluations else None,
    }
    export_draft(draft, folder, target=dimensions, record=record, expected_block_size=draft.dflash.block_size)
    args = trainer.args
    repo_id = args.hub_model_id or output_path(args).name
    return publish(
        folder, repo_id, private=args.hub_private_repo, token=trainer.hub_token, commit_message=commit_message
    )

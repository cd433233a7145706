"""Publishing exported drafts to the Hugging Face Hub, one commit per push.

Only folders written by `export_draft` are published, never raw Trainer checkpoints. The token
comes from the environment (`HF_TOKEN`) or `huggingface-cli login`, or is passed in memory; it is
never written to a file.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from huggingface_hub import CommitInfo, HfApi
from transformers import TrainerCallback

from trainer.export import EXPORT_FILES, PLOT_FILE

logger = logging.getLogger(__name__)


def check_export_folder(folder: Path) -> None:
    """Refuse anything but an export: exactly the export files (the plot is optional)."""
    files = {path.name for path in folder.iterdir()}
    missing = EXPORT_FILES - files
    extra = files - EXPORT_FILES - {PLOT_FILE}
    if missing or extra:
        raise ValueError(
            f"{folder} is not an export folder (missing {sorted(missing)}, unexpected {sorted(extra)}); "
            "publish the output of export_draft, never a raw training checkpoint."
        )


def publish(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload DFlash2 draft",
    revision: str | None = None,
) -> CommitInfo:
    """Create the repo if needed and upload the export folder as a single commit."""
    folder = Path(folder)
    check_export_folder(folder)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), commit_message=commit_message, revision=revision, repo_type="model"
    )
    logger.info("Published %s to %s (%s)", folder, repo_id, commit.oid)
    return commit


class PushExportOnSaveCallback(TrainerCallback):
    """At every save, export the model being trained and publish it (one commit per save)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            with tempfile.TemporaryDirectory() as scratch:
                self.trainer.export_and_publish(Path(scratch) / "export", f"Checkpoint at step {state.global_step}")
        return control

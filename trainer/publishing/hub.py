"""Publishing exported drafts to the Hugging Face Hub, one commit per push.

Only folders written by `export_draft` are published, never raw Trainer checkpoints, and every push
re-validates the folder on disk first: a retry (`dflash2 publish`) publishes whatever is there
now, which may have been edited, truncated or never exported. Every uploaded file is one export
wrote: no links (a README.md linked to a token file would publish the token), the remote code
byte-equal to what this version ships (every `trust_remote_code` user runs it), and exactly the
validated names are uploaded. The token comes from the environment
(`HF_TOKEN`) or `huggingface-cli login`, or is passed in memory; it is never written to a file.
"""

from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import CommitInfo, HfApi
from safetensors import SafetensorError
from safetensors.torch import load_file

from trainer.fileio import format_bytes, read_json_object
from trainer.models.config_bounds import (
    MAX_CONFIG_BYTES,
    bounds_violations,
    check_memory,
    parameter_count,
)
from trainer.publishing.contract import ExportValidationError, contract_violations
from trainer.publishing.export import (
    PLOT_FILE,
    PROVENANCE_FILE,
    REMOTE_CODE_FILES,
    export_folder_problems,
    shipped_remote_code,
)
from trainer.publishing.hub_ids import check_hub_id

logger = logging.getLogger(__name__)

DEFAULT_COMMIT_MESSAGE = "Upload DFlash2 draft"


class PublishError(OSError):
    """A push that failed on the way to the Hub (HTTP error, dropped connection): retrying the same
    folder can succeed. An OSError, like huggingface_hub's own HTTP errors."""


CARD_FRONT_MATTER = b"---\n"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_export_folder(folder: Path) -> list[str]:
    """Refuse anything but an export: exactly the export files (the plot is optional), each a file
    of its own (no symbolic or hard link, which would publish another file's bytes). Returns the
    names to upload."""
    if not folder.is_dir():
        raise ExportValidationError(f"{folder} is not a directory; publish the output of export_draft.")
    links = sorted(f"{path.name} -> {os.readlink(path)}" for path in folder.iterdir() if path.is_symlink())
    if links:
        raise ExportValidationError(
            f"{folder} holds symbolic links ({', '.join(links)}): publish uploads only the files export "
            "wrote; re-export the draft."
        )
    missing, extra = export_folder_problems(folder)
    if missing or extra:
        raise ExportValidationError(
            f"{folder} is not an export folder (missing {sorted(missing)}, unexpected {sorted(extra)}); "
            "publish the output of export_draft, never a raw training checkpoint."
        )
    names = sorted(path.name for path in folder.iterdir())
    shared = [name for name in names if (folder / name).stat().st_nlink > 1]
    if shared:
        raise ExportValidationError(
            f"{folder}: {shared} are hard links (the same bytes under other names elsewhere): publish uploads "
            "only the files export wrote; re-export the draft."
        )
    return names


def check_remote_code(folder: Path) -> None:
    """The modeling files byte-equal to the ones this version ships (as export copied them), else
    refused naming those that differ: every `trust_remote_code` user of the repo runs them."""
    differing = [name for name in REMOTE_CODE_FILES if not _same_bytes(folder / name, shipped_remote_code(name))]
    if differing:
        raise ExportValidationError(
            f"{folder}: {differing} differ from the modeling code this version of dflash2-hub ships (edited after "
            "export, or exported by another version); every trust_remote_code user runs them: re-export the draft."
        )


def _same_bytes(path: Path, reference: Path) -> bool:
    return path.stat().st_size == reference.stat().st_size and path.read_bytes() == reference.read_bytes()


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as file:
        return file.read(len(prefix)) == prefix


def check_card_and_plot(folder: Path) -> None:
    """README.md is a model card (UTF-8 text with metadata, of a card's size) and the plot a PNG."""
    card = folder / "README.md"
    if card.stat().st_size > MAX_CONFIG_BYTES or not _starts_with(card, CARD_FRONT_MATTER):
        raise ExportValidationError(f"{card} is not the model card export wrote; re-export the draft.")
    try:
        card.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ExportValidationError(f"{card} is not UTF-8 text; re-export the draft.") from None
    plot = folder / PLOT_FILE
    if plot.exists() and not _starts_with(plot, PNG_SIGNATURE):
        raise ExportValidationError(f"{plot} is not a PNG image; re-export the draft.")


def _read_json_object(path: Path, limit: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """A JSON object from an export, refusing a file too large to be one before reading it."""
    try:
        return read_json_object(path, "export file", limit)
    except ValueError as error:
        raise ExportValidationError(f"{error}; re-export the draft.") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The weights as safetensors (never pickle); a truncated or foreign file is refused here."""
    try:
        return load_file(path)
    except SafetensorError as error:
        raise ExportValidationError(f"{path} is not a readable safetensors file ({error}); re-export it.") from None


def _declared_dtype(config: dict[str, Any]) -> torch.dtype | None:
    dtype = getattr(torch, str(config.get("dtype")), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def check_publish_resources(folder: Path, config: dict[str, Any], dtype: torch.dtype) -> None:
    """Before the weights are read: the config's sizes within bounds, and the tensors (as many bytes
    as the config implies, or as the file holds, whichever is more) within the memory available."""
    failures = bounds_violations(config)
    if failures:
        raise ExportValidationError(f"{folder / 'config.json'}: {'; '.join(failures)}; re-export the draft.")
    count = parameter_count(config)
    size = torch.empty((), dtype=dtype).element_size()
    weights = (folder / "model.safetensors").stat().st_size
    check_memory(
        max(count * size, weights),
        str(folder),
        "checking this export before publishing",
        f"its tensors loaded once: {count:,} parameters x {size} bytes, model.safetensors {format_bytes(weights)}",
    )


def validate_export_folder(folder: str | os.PathLike) -> list[str]:
    """Re-check a folder against the public contract from what is on disk: the exact file set (no
    links), the remote code this version ships, the card, config.json, and every contract rule that
    needs no target (the target's dimensions were checked at export). The block size must be the
    one the provenance records for serving. Returns the names of the files to upload."""
    folder = Path(folder)
    names = check_export_folder(folder)
    check_remote_code(folder)
    check_card_and_plot(folder)
    config = _read_json_object(folder / "config.json")
    provenance = _read_json_object(folder / PROVENANCE_FILE, limit=16 * MAX_CONFIG_BYTES)
    dtype = _declared_dtype(config)
    check_publish_resources(folder, config, dtype or torch.bfloat16)
    tensors = _read_tensors(folder / "model.safetensors")
    failures = []
    if dtype is None:
        failures.append(f"rule 19: config.json dtype must name a floating torch dtype, got {config.get('dtype')!r}")
    serving = provenance.get("serving")
    block_size = serving.get("block_size") if isinstance(serving, dict) else None
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        failures.append(f"rule 21: {PROVENANCE_FILE} records no integer serving block_size, got {block_size!r}")
        block_size = None
    try:
        failures += contract_violations(config, tensors, None, dtype or torch.bfloat16, block_size)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        failures.append(f"config.json is malformed ({type(error).__name__}: {error})")
    if failures:
        raise ExportValidationError(
            f"{folder} breaks the public checkpoint contract; re-export the draft:\n  " + "\n  ".join(failures)
        )
    return names


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def publish(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
    revision: str | None = None,
) -> CommitInfo:
    """Re-validate the export, create the repo if needed and upload the folder as a single commit.

    A failed push raises `PublishError` and leaves no partial revision (the commit is atomic), so the
    same call can simply be repeated; invalid arguments (a malformed repo id) stay ValueErrors.
    """
    check_hub_id(repo_id, "repo_id")  # before anything: the id names the repo and lands in URLs
    folder = Path(folder)
    names = validate_export_folder(folder)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            allow_patterns=names,  # exactly the files validated, whatever appears there meanwhile
            commit_message=commit_message,
            revision=revision,
            repo_type="model",
        )
    except ValueError:
        raise
    except Exception as error:
        raise PublishError(f"push to {repo_id} failed ({_one_line(error)})") from error
    logger.info("Published %s to %s (%s)", folder, repo_id, commit.oid)
    return commit


def publish_command(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
    revision: str | None = None,
) -> str:
    """The shell command that publishes an existing export again, without re-exporting it."""
    command = ["dflash2", "publish", str(folder), repo_id]
    if private:
        command.append("--private")
    if commit_message != DEFAULT_COMMIT_MESSAGE:
        command += ["--commit-message", commit_message]
    if revision:
        command += ["--revision", revision]
    return shlex.join(command)

"""Crash-safe training checkpoints: staged writes, a completion manifest, safe rotation and resume.

A checkpoint is written under `.staging-checkpoint-N/checkpoint-N` by every rank, then, once all
ranks are done, the saving rank fsyncs it, writes `dflash2_checkpoint.json` (every file and its
size) and renames it to `checkpoint-N`. So a directory named `checkpoint-N` is complete whenever
it exists, whatever instant a kill hits; rotation renames a victim out of the `checkpoint-N`
namespace before deleting it, so it never leaves a half-deleted checkpoint under its final name.
Resume (`true`) takes the newest checkpoint whose manifest checks out and names the ones skipped.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from trainer.fileio import SAVING_PREFIX, TEMPORARY_SUFFIX, fsync_path, remove_directory, replace_directory

logger = logging.getLogger(__name__)

MANIFEST = "dflash2_checkpoint.json"
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".deleting-"
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model_fsdp_0")
# torch.distributed.checkpoint keeps its shard index (`.metadata`) as a pickle, which torch loads
# unrestricted on resume; these are the only globals such an index may name (plus torch dtypes and
# the classes of torch.distributed.checkpoint.metadata).
DCP_METADATA_GLOBALS = {
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class IncompleteCheckpointError(ValueError):
    """A checkpoint a run was asked to resume from is missing files or has truncated ones."""


# ---------------------------------------------------------------------------------------------
# Durable file operations
# ---------------------------------------------------------------------------------------------


def checkpoint_step(path: Path) -> int | None:
    match = CHECKPOINT_PATTERN.match(path.name)
    return int(match.group(1)) if match else None


def staging_parent(run_dir: Path, step: int) -> Path:
    """Where every rank writes checkpoint `step` before it becomes visible (deterministic across ranks)."""
    return run_dir / f"{STAGING_PREFIX}checkpoint-{step}"


def remove_tree(path: Path) -> None:
    """Delete a directory without ever leaving it half-deleted under its own name."""
    remove_directory(path, aside_prefix=TRASH_PREFIX)


def clean_leftovers(run_dir: Path) -> None:
    """Finish or undo what an interrupted save or rotation left behind.

    A staged checkpoint that is complete but was not renamed yet (the kill came between the last
    write and the rename, or while an older copy of the same step was moved aside) is renamed into
    place; everything else staged or half-deleted is removed.
    """
    if not run_dir.is_dir():
        return
    for parent in sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith(STAGING_PREFIX)):
        staged = parent / parent.name.removeprefix(STAGING_PREFIX)
        final = run_dir / staged.name
        if staged.is_dir() and not final.exists() and not checkpoint_problems(staged):
            os.replace(staged, final)
            fsync_path(run_dir)
            logger.warning("Recovered %s: its save had finished but was not renamed into place.", final)
        else:
            logger.warning("Removing %s, left by an interrupted save.", parent)
        shutil.rmtree(parent, ignore_errors=True)
    for path in run_dir.iterdir():
        if path.is_dir() and path.name.startswith((TRASH_PREFIX, SAVING_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_file() and path.name.startswith(".") and path.name.endswith(TEMPORARY_SUFFIX):
            path.unlink()


def publish_staged(staged: Path, final: Path, step: int) -> None:
    """Make a fully written checkpoint visible under its final name in one rename."""
    write_manifest(staged, step)
    replace_directory(staged, final, aside_prefix=TRASH_PREFIX)  # an older copy of the step (saved again) goes
    shutil.rmtree(staged.parent, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The manifest: what "complete" means
# ---------------------------------------------------------------------------------------------


def _files(directory: Path) -> dict[str, int]:
    return {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


def write_manifest(directory: Path, step: int) -> None:
    """fsync every file, then record each with its size: the last write of a complete checkpoint."""
    files = _files(directory)
    for name in files:
        fsync_path(directory / name)
    manifest = {"format": "dflash2-hub checkpoint", "step": step, "files": files}
    temporary = directory / f".{MANIFEST}.tmp"
    temporary.write_text(json.dumps(manifest, indent=1) + "\n")
    fsync_path(temporary)
    os.replace(temporary, directory / MANIFEST)
    for subdirectory in {(directory / name).parent for name in files} | {directory}:
        fsync_path(subdirectory)


def checkpoint_problems(directory: Path) -> list[str]:
    """Why `directory` cannot be resumed from (empty when it is complete per its manifest)."""
    manifest_file = directory / MANIFEST
    if not manifest_file.is_file():
        return [f"no {MANIFEST} (an interrupted save, or written before dflash2-hub recorded completion)"]
    try:
        files = json.loads(manifest_file.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return [f"{MANIFEST} is not valid"]
    problems = []
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {size}")
    return problems + unsafe_pickles(directory)


def legacy_checkpoint_problems(directory: Path, needs_optimizer: bool = True) -> list[str]:
    """For a checkpoint without a manifest that the user names explicitly: the files resume needs."""
    problems = []
    if not (directory / "trainer_state.json").is_file():
        problems.append("trainer_state.json is missing")
    if not any((directory / name).exists() for name in WEIGHT_FILES):
        problems.append(f"no weights ({' or '.join(WEIGHT_FILES)})")
    if needs_optimizer and not any(p.name.startswith("optimizer") for p in directory.iterdir()):
        problems.append("no optimizer state")
    return problems + unsafe_pickles(directory)


# ---------------------------------------------------------------------------------------------
# Pickles torch would load unrestricted
# ---------------------------------------------------------------------------------------------


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Loads a DCP `.metadata` index but refuses any global outside the index's own classes."""

    def find_class(self, module: str, name: str):
        found = (
            super().find_class(module, name) if module.split(".")[0] in ("torch", "pathlib", "collections") else None
        )
        allowed = (
            (module, name) in DCP_METADATA_GLOBALS
            or (module == DCP_METADATA_MODULE and isinstance(found, type))
            or (module == "torch" and isinstance(found, torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refers to {module}.{name}")
        return found


def unsafe_pickles(directory: Path) -> list[str]:
    """torch.distributed.checkpoint unpickles `.metadata` without restriction on resume: vet each
    one first with an allow-listed unpickler, so a crafted checkpoint cannot run code."""
    problems = []
    for path in sorted(directory.rglob(".metadata")):
        try:
            with path.open("rb") as handle:
                _DCPMetadataUnpickler(handle).load()
        except Exception as error:  # any failure means torch must not load it either
            problems.append(f"{path.relative_to(directory)} is not a plain checkpoint index ({error})")
    return problems


# ---------------------------------------------------------------------------------------------
# Choosing what to resume from, and rotation
# ---------------------------------------------------------------------------------------------


def list_checkpoints(run_dir: Path) -> list[Path]:
    """`checkpoint-N` directories, oldest step first."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def newest_complete_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose manifest checks out; every newer one skipped is logged with why."""
    for candidate in reversed(list_checkpoints(run_dir)):
        problems = checkpoint_problems(candidate)
        if not problems:
            return candidate
        logger.warning("Skipping incomplete checkpoint %s: %s", candidate, "; ".join(problems))
    return None


def check_resumable(directory: Path, needs_optimizer: bool = True) -> None:
    """Refuse an explicitly named checkpoint that cannot be resumed from, naming what is wrong."""
    if not directory.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint: {directory} is not a directory")
    if (directory / MANIFEST).is_file():
        problems = checkpoint_problems(directory)
    else:
        problems = legacy_checkpoint_problems(directory, needs_optimizer)
        if not problems:
            logger.warning("%s has no %s: resuming without a completeness check.", directory, MANIFEST)
    if problems:
        raise IncompleteCheckpointError(f"checkpoint {directory} cannot be resumed from: {'; '.join(problems)}")


def rotate(run_dir: Path, keep: int | None, protected: Iterable[Path | str | None] = ()) -> list[Path]:
    """Delete the oldest checkpoints beyond `keep`, never the newest one nor any `protected` one."""
    checkpoints = list_checkpoints(run_dir)
    if not keep or keep <= 0 or len(checkpoints) <= keep:
        return []
    spared = {checkpoints[-1].resolve()} | {Path(p).resolve() for p in protected if p}
    kept = [p for p in checkpoints if p.resolve() in spared]
    excess = len(checkpoints) - max(keep, len(kept))
    victims = [p for p in checkpoints if p.resolve() not in spared][: max(excess, 0)]
    for victim in victims:
        remove_tree(victim)
    return victims

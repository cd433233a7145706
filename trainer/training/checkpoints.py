"""Crash-safe training checkpoints: staged writes, a completion manifest, safe rotation and resume.

A checkpoint is written under `.staging-checkpoint-N/checkpoint-N` by every rank, then, once all
ranks are done, the saving rank fsyncs it, writes `dflash2_checkpoint.json` (every file with its
size and sha256, and the manifest's own sha256) and renames it to `checkpoint-N`. So a directory
named `checkpoint-N` is complete whenever it exists, whatever instant a kill hits; rotation renames
a victim out of the `checkpoint-N` namespace before deleting it, so it never leaves a half-deleted
checkpoint under its final name.

Resume verifies every file against its recorded size and digest before anything loads (a flipped
byte is a damaged checkpoint, not a silent resume): `true` takes the newest checkpoint that checks
out and names each one skipped and the file that failed; a named one that fails is refused in one
line. A manifest written before digests were recorded is accepted on sizes plus the files' own
structure (JSON, safetensors headers, the CRCs of torch's zip files), with one warning saying so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from trainer.fileio import (
    SAVING_PREFIX,
    TEMPORARY_SUFFIX,
    DamagedFileError,
    check_safetensors_file,
    fsync_path,
    read_json,
    remove_directory,
    replace_directory,
    sha256_file,
    write_file_atomically,
)
from trainer.training.resume_check import recorded_recipe_problems

logger = logging.getLogger(__name__)

MANIFEST = "dflash2_checkpoint.json"
MANIFEST_FORMAT = "dflash2-hub checkpoint"
DIGEST = "sha256"
HASH_THREADS = 8
# Files HF writes with torch.save (a zip whose entries carry CRC-32s) and the JSON files that must hold objects.
TORCH_ZIP_SUFFIXES = (".pt", ".pth", ".bin")
JSON_OBJECT_FILES = ("trainer_state.json", "config.json", "adapter_config.json", "dflash2_recipe.json")
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
    """A checkpoint a run was asked to resume from is missing files or has truncated or damaged ones."""


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


def _files(directory: Path) -> list[str]:
    return [
        str(path.relative_to(directory))
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    ]


def _manifest_digest(body: dict[str, Any]) -> str:
    """The manifest's own digest, over its canonical JSON: damage to it is named as such."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _in_threads(function, items: list) -> list:
    """`function` over `items` in threads (file reads and hashlib release the GIL)."""
    if len(items) <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(items))) as pool:
        return list(pool.map(function, items))


def write_manifest(directory: Path, step: int) -> None:
    """fsync every file, then record each with its size and sha256: the last write of a complete
    checkpoint. Each file is read once, right after its fsync (from the page cache), several at a
    time: hashing runs at about 1-2 GB/s per thread, a few seconds for a multi-GB optimizer state."""
    names = _files(directory)

    def record(name: str) -> dict[str, Any]:
        path = directory / name
        fsync_path(path)
        return {"size": path.stat().st_size, DIGEST: sha256_file(path)}

    body = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "digest": DIGEST,
        "files": dict(zip(names, _in_threads(record, names), strict=True)),
    }
    manifest = {**body, "manifest_sha256": _manifest_digest(body)}
    write_file_atomically(
        directory / MANIFEST, lambda temporary: temporary.write_text(json.dumps(manifest, indent=1) + "\n")
    )
    for subdirectory in {(directory / name).parent for name in names} | {directory}:
        fsync_path(subdirectory)


def _safe_name(name: Any) -> bool:
    """A manifest entry names a file inside the checkpoint (never an absolute path or `..`)."""
    return isinstance(name, str) and bool(name) and not Path(name).is_absolute() and ".." not in Path(name).parts


def _entry(value: Any) -> tuple[int, str | None] | None:
    """(size, sha256 or None) of one manifest entry: `{"size", "sha256"}`, or a bare size (older manifests)."""
    if type(value) is int and value >= 0:
        return value, None
    if isinstance(value, dict) and set(value) == {"size", DIGEST}:
        size, digest = value["size"], value[DIGEST]
        if type(size) is int and size >= 0 and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest):
            return size, digest
    return None


def read_manifest(directory: Path) -> dict[str, tuple[int, str | None]]:
    """name -> (size, sha256; None in a manifest written before digests) from the checkpoint's
    manifest; a manifest that is unreadable, not valid JSON, not of this shape or not matching its
    own digest raises DamagedFileError (the checkpoint is damaged, whatever its other files hold)."""
    path = directory / MANIFEST

    def damaged(reason: str) -> DamagedFileError:
        return DamagedFileError(path, None, f"is damaged ({reason})")

    try:
        manifest = read_json(path, None, dict)
    except DamagedFileError as error:
        raise damaged(error.reason.removeprefix("is ")) from None

    files = manifest.get("files")
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict) or not files:
        raise damaged(f'not a "{MANIFEST_FORMAT}" manifest with a map of files')
    parsed = {name: _entry(value) for name, value in files.items()}
    bad = [name for name, entry in parsed.items() if entry is None or not _safe_name(name)]
    if bad:
        raise damaged(f"the entry for {json.dumps(bad[0])[:80]} is not a file name with its size and {DIGEST}")
    entries = {name: entry for name, entry in parsed.items() if entry is not None}  # all of them, as none is bad
    with_digest = [entry[1] is not None for entry in entries.values()]
    if any(with_digest):
        body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
        if not all(with_digest) or manifest.get("manifest_sha256") != _manifest_digest(body):
            raise damaged("it does not match its own recorded digest")
    return entries


def _digest_problem(item: tuple[Path, str, str]) -> str | None:
    path, name, expected = item
    try:
        actual = sha256_file(path)
    except OSError as error:
        return f"{name} cannot be read ({error.strerror or error})"
    return None if actual == expected else f"{name} does not match its recorded {DIGEST} (damaged since it was saved)"


def structure_problems(directory: Path, names: Iterable[str]) -> list[str]:
    """What can be told damaged from the files themselves, for checkpoints without digests: JSON
    that does not parse (named with line and column), safetensors headers, torch zips' CRC-32s."""
    problems = []
    for name in names:
        path = directory / name
        try:
            if name.endswith(".json"):
                read_json(path, None, dict if Path(name).name in JSON_OBJECT_FILES else None)
            elif name.endswith(".safetensors"):
                check_safetensors_file(path)
            elif name.endswith(TORCH_ZIP_SUFFIXES):
                with zipfile.ZipFile(path) as archive:
                    failed = archive.testzip()
                if failed is not None:
                    problems.append(f"{name} is damaged (its entry {failed} fails its CRC check)")
        except DamagedFileError as error:
            problems.append(f"{name} {error.reason}")
        except zipfile.BadZipFile as error:
            problems.append(f"{name} is damaged (not a readable torch.save archive: {error})")
        except (ValueError, OSError) as error:
            problems.append(str(error).replace(str(path), name))
    return problems


_WARNED_WITHOUT_DIGESTS: set[Path] = set()


def checkpoint_problems(directory: Path) -> list[str]:
    """Why `directory` cannot be resumed from (empty when it is complete per its manifest and every
    file matches its recorded digest; older manifests: sizes and `structure_problems`)."""
    incomplete, damaged = _incomplete_and_damaged(Path(directory))
    return incomplete + damaged


def _incomplete_and_damaged(directory: Path) -> tuple[list[str], list[str]]:
    """(what is missing or cut short, what is damaged or unsafe) in `directory`."""
    if not (directory / MANIFEST).is_file():
        return [f"no {MANIFEST} (an interrupted save, or written before dflash2-hub recorded completion)"], []
    try:
        entries = read_manifest(directory)
    except DamagedFileError as error:
        return [], [f"{MANIFEST} {error.reason}"]
    except OSError as error:
        return [], [f"{MANIFEST} cannot be read ({error.strerror or error})"]
    incomplete, to_hash, sized = [], [], []
    for name, (size, digest) in entries.items():
        path = directory / name
        if not path.is_file():
            incomplete.append(f"{name} is missing")
        elif path.stat().st_size != size:
            incomplete.append(f"{name} has {path.stat().st_size} bytes, the manifest says {size}")
        elif digest is not None:
            to_hash.append((path, name, digest))
        else:
            sized.append(name)
    problems = [problem for problem in _in_threads(_digest_problem, to_hash) if problem]
    if sized:
        if directory.resolve() not in _WARNED_WITHOUT_DIGESTS:
            _WARNED_WITHOUT_DIGESTS.add(directory.resolve())
            logger.warning(
                "%s was saved before dflash2-hub recorded file digests: checked by size and structure only.", directory
            )
        problems += structure_problems(directory, sized)
    if not incomplete and not problems:  # else a damaged recipe is named by its size or digest already
        problems = recorded_recipe_problems(directory)
    return incomplete, problems + unsafe_pickles(directory)


def legacy_checkpoint_problems(directory: Path, needs_optimizer: bool = True) -> list[str]:
    """For a checkpoint without a manifest that the user names explicitly: the files resume needs."""
    problems = []
    if not (directory / "trainer_state.json").is_file():
        problems.append("trainer_state.json is missing")
    if not any((directory / name).exists() for name in WEIGHT_FILES):
        problems.append(f"no weights ({' or '.join(WEIGHT_FILES)})")
    if needs_optimizer and not any(p.name.startswith("optimizer") for p in directory.iterdir()):
        problems.append("no optimizer state")
    json_files = [str(p.relative_to(directory)) for p in sorted(directory.glob("*.json")) if p.is_file()]
    return (
        problems
        + structure_problems(directory, json_files)
        + recorded_recipe_problems(directory)
        + unsafe_pickles(directory)
    )


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
    steps = {p: step for p in run_dir.iterdir() if p.is_dir() and (step := checkpoint_step(p)) is not None}
    return sorted(steps, key=steps.__getitem__)


_SKIPS_SAID: set[tuple[str, str]] = set()


def newest_complete_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose manifest checks out; every newer one skipped is logged with why."""
    for candidate in reversed(list_checkpoints(run_dir)):
        incomplete, damaged = _incomplete_and_damaged(candidate)
        if not incomplete and not damaged:
            return candidate
        kind = "damaged" if damaged else "incomplete"
        said = (str(candidate), "; ".join(incomplete + damaged))
        if said not in _SKIPS_SAID:  # asked again (a save's message names the last good one): said once
            _SKIPS_SAID.add(said)
            logger.warning("Skipping %s checkpoint %s: %s", kind, *said)
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

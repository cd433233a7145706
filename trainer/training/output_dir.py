"""A run owns its output_dir for good: another run never writes over, rotates away or mixes into it.

Two trainings on one folder would share checkpoint names: the second replaces the first's
`checkpoint-N` and final draft, and rotation (oldest step first) deletes the second's own early
checkpoints because the first's later ones look newer. So a folder that holds a run's results is
refused to any run that neither resumes it (`resume_from_checkpoint`) nor asks to replace it
(`overwrite_output_dir`, the name transformers used); a fresh or empty folder is free.

A run's results are what `dflash2 train` writes there that outlives it (`RESULT_NAMES`, and any
`checkpoint-N`). The lock file, the TensorBoard logs and leftovers of interrupted saves are not
results: a run stopped before its first checkpoint leaves nothing worth keeping, and the next run
may start there. Overwriting removes exactly what a run writes (`RUN_NAMES`, `checkpoint-N`,
leftovers), each entry renamed into one `.deleting-…` folder inside output_dir first and only then
deleted, so nothing is ever half-deleted under its own name; any other file there stays.

An output_dir must also keep clear of what the run reads: a run folder that is, holds or lies
inside the target, the dataset, the cache or the warm-start checkpoint would overwrite it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from modeling_dflash2.checkpoint_dflash2 import REMOTE_CODE_FILES
from trainer.fileio import SAVING_PREFIX, TEMPORARY_SUFFIX, fsync_path
from trainer.locks import RUN_LOCK_NAME
from trainer.training.checkpoints import STAGING_PREFIX, TRASH_PREFIX, checkpoint_step

if TYPE_CHECKING:
    from transformers import TrainingArguments

# What a finished or checkpointed run leaves at the top of its output_dir (besides checkpoint-N):
# any one of these means the folder holds a run's results.
RESULT_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "config.json",
    "dflash2_recipe.json",
    "trainer_state.json",
    "training_args.bin",
    "demo_summary.json",
)
# Also written by a run (or by `dflash2 evaluate` into it), removed with its results on overwrite.
RUN_NAMES = (
    *RESULT_NAMES,
    "adapter_config.json",
    *REMOTE_CODE_FILES,
    "generation_config.json",
    "speculative",
    "runs",
)
LEFTOVER_PREFIXES = (STAGING_PREFIX, TRASH_PREFIX, SAVING_PREFIX)
SHOWN = 4  # names quoted in a refusal


class OutputDirInUseError(FileExistsError):
    """output_dir holds another run's results (a FileExistsError: the scripts print it in one line and exit 2)."""


def _is_result(path: Path) -> bool:
    return path.name in RESULT_NAMES or (path.is_dir() and checkpoint_step(path) is not None)


def _is_leftover(path: Path) -> bool:
    return path.name.startswith(LEFTOVER_PREFIXES) or (
        path.name.startswith(".") and path.name.endswith(TEMPORARY_SUFFIX)
    )


def _by_step_then_name(path: Path) -> tuple[int, int, str]:
    step = checkpoint_step(path)
    return (0, step, "") if step is not None else (1, 0, path.name)


def output_path(args: TrainingArguments) -> Path:
    """The run's `output_dir` as a Path: HF's `__post_init__` fills in its default, so it is set once built."""
    if args.output_dir is None:
        raise ValueError("output_dir is not set")
    return Path(args.output_dir)


def run_results(output_dir: Path) -> list[Path]:
    """The run results in `output_dir` (checkpoints by step, then files by name); empty when none."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return sorted((path for path in output_dir.iterdir() if _is_result(path)), key=_by_step_then_name)


def describe(paths: list[Path]) -> str:
    names = [path.name for path in paths]
    shown = ", ".join(names[:SHOWN])
    return f"{shown}, … {len(names) - SHOWN} more" if len(names) > SHOWN else shown


def wants_resume(resume_from_checkpoint: str | bool | None) -> bool:
    """Whether the recipe resumes (`true` or a checkpoint path); `false` / unset do not."""
    if isinstance(resume_from_checkpoint, str):
        return resume_from_checkpoint.strip().lower() not in ("", "false")
    return bool(resume_from_checkpoint)


def resumed_checkpoint(resume_from_checkpoint: str | bool | None) -> Path | None:
    """The checkpoint a recipe names to resume from; None for `true` / `false` / unset."""
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.strip().lower() not in ("", "true", "false"):
        return Path(resume_from_checkpoint).expanduser()
    return None


def check_output_dir(output_dir: Path, resume_from_checkpoint: str | bool | None, overwrite: bool) -> None:
    """Refuse, in one line, a run that would write over another run's results in `output_dir`.

    Free: a missing or result-free folder; a resume of the run there (`true` when it has a
    checkpoint-N, or a checkpoint inside output_dir; resume_check then refuses a changed recipe);
    `overwrite_output_dir`. A resume from a checkpoint elsewhere starts a new history in output_dir,
    so it needs a free folder or `overwrite_output_dir`; overwriting the very checkpoints a resume
    would read is refused.
    """
    output_dir = Path(output_dir)
    resume = wants_resume(resume_from_checkpoint)
    named = resumed_checkpoint(resume_from_checkpoint)
    inside = named is not None and named.resolve().is_relative_to(output_dir.resolve())
    if resume and overwrite and (named is None or inside):
        shown = str(resume_from_checkpoint).lower() if isinstance(resume_from_checkpoint, bool) else named
        raise ValueError(
            f"resume_from_checkpoint {shown} and overwrite_output_dir: true contradict each other "
            f"(overwriting {output_dir} would delete the checkpoint to resume from): set one"
        )
    results = run_results(output_dir)
    if overwrite or not results:
        return
    held = f"output_dir {output_dir} holds another run's results ({describe(results)})"
    replace = "replace them with --overwrite_output_dir true, or choose another output_dir"
    if not resume:
        raise OutputDirInUseError(f"{held}: continue it with --resume_from_checkpoint true, {replace}")
    if named is None:
        if any(checkpoint_step(path) is not None for path in results):
            return
        raise OutputDirInUseError(f"{held} but no checkpoint-N to resume from: {replace}")
    if not inside:
        raise OutputDirInUseError(
            f"{held} and resume_from_checkpoint {resume_from_checkpoint} lies outside it (the resumed run would "
            f"mix its checkpoints into the other run's): {replace}"
        )


def check_fresh_start(output_dir: Path) -> None:
    """`resume_from_checkpoint: true` found no complete checkpoint: starting at step 0 is right in a
    result-free folder (the first launch of a job that always passes `true`), never over results."""
    results = run_results(output_dir)
    if results:
        raise OutputDirInUseError(
            f"resume_from_checkpoint true: output_dir {output_dir} holds another run's results ({describe(results)}) "
            "but no complete checkpoint to resume from: replace them with --overwrite_output_dir true, or choose "
            "another output_dir"
        )


def remove_run(output_dir: Path) -> list[str]:
    """Overwrite: every name a run writes in `output_dir` renamed into one `.deleting-…` folder there
    (one rename each: an entry is whole or gone), the folder's entries fsynced, then deleted; a kill
    before the delete leaves only that folder, which the next run's start removes. Returns the
    names removed; the lock file and any other file stay."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    doomed = sorted(
        (
            path
            for path in output_dir.iterdir()
            if path.name != RUN_LOCK_NAME
            and (path.name in RUN_NAMES or _is_result(path) or _is_leftover(path))
            and not path.name.startswith(TRASH_PREFIX)
        ),
        key=_by_step_then_name,
    )
    if not doomed:
        return []
    trash = output_dir / f"{TRASH_PREFIX}overwritten-{uuid.uuid4().hex[:8]}"
    trash.mkdir()
    for path in doomed:
        os.replace(path, trash / path.name)
    fsync_path(output_dir)
    shutil.rmtree(trash, ignore_errors=True)
    for leftover in output_dir.glob(f"{TRASH_PREFIX}*"):  # earlier removals a kill interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    return [path.name for path in doomed]


def local_path(spec: str | os.PathLike | None) -> Path | None:
    """`spec` resolved (symlinks, `~`, relative to the working directory): a Path always (a folder
    the run creates, such as the cache), a string when it names an existing local file or folder;
    None for a Hub id, a `pypi:` distribution or a dataset name."""
    if spec is None or (isinstance(spec, str) and (not spec or spec.startswith("pypi:") or "://" in spec)):
        return None
    path = Path(os.path.expanduser(spec))
    return path.resolve() if isinstance(spec, Path) or path.exists() else None


def check_sources(output_dir: Path, sources: Mapping[str, str | os.PathLike | None]) -> None:
    """Refuse an output_dir that is, holds or lies inside one of `sources` (what the run reads:
    name -> spec, `local_path`; non-local ones are skipped), naming both paths, before anything is written."""
    output = Path(os.path.expanduser(output_dir)).resolve()
    for what, spec in sources.items():
        source = local_path(spec)
        if source is None:
            continue
        if output == source:
            relation = "is"
        elif source.is_relative_to(output):
            relation = "holds"
        elif output.is_relative_to(source):
            relation = "lies inside"
        else:
            continue
        raise ValueError(
            f"output_dir {output_dir} {relation} the {what} {spec}"
            f"{f' ({source})' if str(source) != str(spec) else ''}: the run would write over it; "
            "choose an output_dir of its own"
        )

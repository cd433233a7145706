"""Test-only: play training scenarios, each command in a process forked from this one after it
imported torch, transformers and the trainer, so the seconds of imports are paid once, not per run.

Usage: python tests/support/faults/forked_runs.py PLAN.json WORKERS

PLAN.json maps a scenario name to {"cwd": DIR, "runs": [ARGV, ...]}; an ARGV is `["-m", "trainer",
...]` (as `python -m trainer ...`) or `[SCRIPT, ...]` (as `python SCRIPT ...`). A scenario's runs go one
after another (a faulted run, then its resume), WORKERS scenarios at a time. Each run is a fresh
process that has run nothing: it starts from the disk alone, as a new `python` would, and ends as one
does (its exit status, or the signal that killed it). For run I it writes DIR/run-I.{out,err,rc}; before
every run but the first, DIR/survivors-I.json: each checkpoint directory left, with its problems.
The forking is tests/support/forked_python.py's.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

import torch  # noqa: F401  (the imports a run pays for, paid here once)
import transformers.trainer  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import trainer.commands.train
import trainer.training.run  # noqa: F401
from tests.support.forked_python import forked, forked_pool, redirect_output, run_as_python
from trainer.training.checkpoints import checkpoint_problems, list_checkpoints

HERE = str(Path(__file__).resolve().parent)
BASE_PATH = [entry for entry in sys.path if entry not in ("", os.getcwd(), HERE)]


def command(argv: list[str], folder: Path, index: int) -> int:
    """In the child: argv as `python ARGV` run in `folder`, its output in run-INDEX.{out,err}."""
    os.chdir(folder)
    redirect_output(folder / f"run-{index}")
    return run_as_python(argv, BASE_PATH)


def survivors(folder: Path, index: int) -> int:
    """In the child: the checkpoints the previous run left, with their problems."""
    found = {path.name: checkpoint_problems(path) for path in list_checkpoints(folder / "output")}
    (folder / f"survivors-{index}.json").write_text(json.dumps(found))
    return 0


def scenario(folder: Path, runs: list[list[str]]) -> int:
    for index, argv in enumerate(runs):
        if index:
            forked(partial(survivors, folder, index))
        status = forked(partial(command, argv, folder, index))
        (folder / f"run-{index}.rc").write_text(str(status))
    return 0


def main() -> None:
    plan, workers = json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2])
    forked_pool([partial(scenario, Path(job["cwd"]), job["runs"]) for job in plan.values()], workers)


if __name__ == "__main__":
    main()

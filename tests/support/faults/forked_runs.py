"""Test-only: play training scenarios, each command in a process forked from this one after it
imported torch, transformers and the trainer, so the seconds of imports are paid once, not per run.

Usage: python tests/support/faults/forked_runs.py PLAN.json WORKERS

PLAN.json maps a scenario name to {"cwd": DIR, "runs": [ARGV, ...]}; an ARGV is `["-m", "trainer",
...]` (as `python -m trainer ...`) or `[SCRIPT, ...]` (as `python SCRIPT ...`). A scenario's runs go one
after another (a faulted run, then its resume), WORKERS scenarios at a time. Each run is a fresh
process that has run nothing: it starts from the disk alone, as a new `python` would, and ends as one
does (its exit status, or the signal that killed it). For run I it writes DIR/run-I.{out,err,rc}; before
every run but the first, DIR/survivors-I.json: each checkpoint directory left, with its problems.
The parent imports modules and forks; it runs no torch operation, so no thread pool is inherited.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from functools import partial
from pathlib import Path

import torch  # noqa: F401  (the imports a run pays for, paid here once)
import transformers.trainer  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import trainer.commands.train
import trainer.training.run  # noqa: F401
from trainer.training.checkpoints import checkpoint_problems, list_checkpoints

HERE = str(Path(__file__).resolve().parent)
BASE_PATH = [entry for entry in sys.path if entry not in ("", os.getcwd(), HERE)]


def forked(work) -> int:
    """`work()` in a forked child, which exits with what it returns; the child's exit code (-N: signal N)."""
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = work()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def command(argv: list[str], folder: Path, index: int) -> int:
    """In the child: argv as `python ARGV` run in `folder`, its output in run-INDEX.{out,err}."""
    os.chdir(folder)
    for fd, suffix in ((1, "out"), (2, "err")):
        os.dup2(os.open(folder / f"run-{index}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    try:
        if argv[0] == "-m":  # python -m: the working directory first
            sys.argv, sys.path[:] = [argv[1], *argv[2:]], [str(folder), *BASE_PATH]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python script.py: the script's folder first
            sys.argv, sys.path[:] = list(argv), [os.path.dirname(os.path.abspath(argv[0])), *BASE_PATH]
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    return code


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
    running: set[int] = set()
    for job in plan.values():
        if len(running) >= workers:
            running.discard(os.wait()[0])
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                scenario(Path(job["cwd"]), job["runs"])
            finally:
                os._exit(0)
        running.add(pid)
    while running:
        running.discard(os.wait()[0])


if __name__ == "__main__":
    main()

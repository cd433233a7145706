"""Test-only: run commands as a fresh `python ARGV` would, each in a process forked from one that has
already imported the costly libraries, so seconds of imports are paid once rather than per command.

A child gets the argv, sys.path and `__main__` the real invocation would give it, so a missing module
or a bad flag fails there as it would in a new interpreter; it ends as one does, with its exit status
(or the signal that killed it). The forking process runs no torch operation, so no thread pool is
inherited.

As a script (stdlib only; the forking process imports nothing of this repository):
    python tests/support/forked_python.py JOBS.json OUT WORKERS [MODULE ...]
imports each MODULE, then runs JOBS.json's argvs (`["-m", MODULE, ...]` or `[SCRIPT, ...]`) in the
working directory, WORKERS at a time; job I writes OUT/I.{out,err,rc}.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path


def start(work: Callable[[], int]) -> int:
    """The pid of a forked child that runs `work()` and exits with what it returns."""
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = work()
        finally:
            os._exit(code)
    return pid


def forked(work: Callable[[], int]) -> int:
    """`work()` in a forked child; the child's exit code (-N: killed by signal N)."""
    return os.waitstatus_to_exitcode(os.waitpid(start(work), 0)[1])


def forked_pool(works: Sequence[Callable[[], int]], workers: int) -> list[int]:
    """Each work in its own forked child, at most `workers` at once; their exit codes, in order."""
    codes = [0] * len(works)
    running: dict[int, int] = {}

    def reap() -> None:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)

    for index, work in enumerate(works):
        if len(running) >= workers:
            reap()
        running[start(work)] = index
    while running:
        reap()
    return codes


def redirect_output(prefix: Path) -> None:
    """In a child: stdout and stderr into PREFIX.out and PREFIX.err."""
    for fd, suffix in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{prefix}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)


def run_as_python(argv: Sequence[str], base_path: Sequence[str]) -> int:
    """In a child: `python ARGV` in the working directory; its exit code. `-m` puts the working
    directory before `base_path`, a script its own folder, as the interpreter does."""
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[:] = [argv[1], *argv[2:]], [os.getcwd(), *base_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[:] = list(argv), [os.path.dirname(os.path.abspath(argv[0])), *base_path]
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    return code


def job(argv: Sequence[str], prefix: Path, base_path: Sequence[str]) -> int:
    redirect_output(prefix)
    return run_as_python(argv, base_path)


def main() -> None:
    jobs_file, out, workers, *preloaded = sys.argv[1:]
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if entry not in ("", os.getcwd(), here)]
    for name in preloaded:
        importlib.import_module(name)
    jobs = json.loads(Path(jobs_file).read_text())
    works = [partial(job, argv, Path(out) / str(index), list(sys.path)) for index, argv in enumerate(jobs)]
    for index, code in enumerate(forked_pool(works, int(workers))):
        (Path(out) / f"{index}.rc").write_text(str(code))


if __name__ == "__main__":
    main()

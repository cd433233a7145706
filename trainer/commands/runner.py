"""The one error runner of every command (`run`) and the parser they share (`command_parser`): a
user's mistake is one line on stderr, not a traceback.

Errors a user can fix (a refused recipe value, a missing file, a broken contract rule, a Hub
refusal) print `error: <message>` and exit with status 2; `--debug` anywhere on the command line,
or `DFLASH2_DEBUG=1`, shows the full traceback instead. A run stopped by SIGTERM/SIGINT exits with
128 + the signal number after its one line; Ctrl-C anywhere else (loading, regenerating, evaluating)
is `interrupted: ...` saying what the command kept, and 130. Under torchrun / accelerate launch
rank 0 prints; another rank's user error is printed by that rank as `error: rank N: ...` when rank 0
has not ended the job within a grace period (then the error was its own: rank 0 runs on).
A rank that died or stalled (`trainer.training.watchdog`) ends the others with status 1 after one line naming
it, printed by the lowest surviving rank. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import yaml

from trainer.commands import kept_on_interrupt
from trainer.console import DEBUG_FLAG, USER_ERROR_STATUS, close_progress_bars, describe
from trainer.recipe_types import refuse_argv_credentials
from trainer.training.preemption import TrainingInterrupted
from trainer.training.watchdog import watched_run

SILENT_RANK_GRACE_SECONDS = 5.0
INTERRUPTED_STATUS = 128 + signal.SIGINT
# ValueError covers refused recipes, export rules and Hub id validation; OSError covers missing
# files, full disks and Hub HTTP/connection errors; YAMLError a recipe that is not YAML;
# FloatingPointError a diverged run (the step is named).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, yaml.YAMLError, FloatingPointError)


def debug_requested(argv: list[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get("DFLASH2_DEBUG", "").lower() in ("1", "true", "yes")


def is_rank_zero() -> bool:
    """Only one process of a multi-process launch speaks (RANK is set by torchrun and accelerate)."""
    return os.environ.get("RANK", "0") == "0"


def say(message: str) -> None:
    """The one line, on a line of its own: a progress bar still open (the error came mid-loop) is
    closed first, so the line neither lands after the bar nor gets redrawn over."""
    if is_rank_zero():
        close_progress_bars()
        print(message, file=sys.stderr, flush=True)


def run(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> NoReturn:
    """Call `main(argv)` (without `--debug`) and exit with 0, 2 for a user error, or 128 + signal."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [arg for arg in argv if arg != DEBUG_FLAG]
    try:
        with watched_run(debug):  # a collective failed by a lost rank: one line naming it, exit 1
            refuse_argv_credentials(argv)  # no flag's URL credentials reach a log, record or export
            main(argv)
    except TrainingInterrupted as stop:
        say(f"interrupted: {stop}")
        sys.exit(stop.exit_status)
    except KeyboardInterrupt:
        if debug:
            raise
        # a second Ctrl-C while this line is printed, or while the interpreter shuts down, ends at once
        # (handlers can only be set from the main thread; elsewhere the default stays)
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, lambda *_: os._exit(INTERRUPTED_STATUS))
        say(f"interrupted: stopped by SIGINT (Ctrl-C): {kept_on_interrupt(module_of(main))}")
        let_rank_zero_speak_first()
        sys.exit(INTERRUPTED_STATUS)
    except USER_ERRORS as error:
        if debug:
            raise
        say(f"error: {describe(error)}")
        speak_unless_rank_zero_did(f"error: rank {os.environ.get('RANK')}: {describe(error)}")
        sys.exit(USER_ERROR_STATUS)
    sys.exit(0)


def let_rank_zero_speak_first() -> None:
    """Every rank meets the same error (or Ctrl-C, which the launcher forwards to all); the launcher
    tears the job down when the first rank exits, so the silent ranks give rank 0 a moment to print
    its line first."""
    if not is_rank_zero() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(SILENT_RANK_GRACE_SECONDS)


def speak_unless_rank_zero_did(message: str) -> None:
    """A rank other than 0 waits the grace period with SIGTERM at its default, then prints `message`.

    When every rank met the error, rank 0 printed it and exited, and the launcher's SIGTERM ends this
    rank within the grace (a handler the run installed, such as the preemption callback's, would
    keep it alive to print the same line again). A rank still running met an error of its own, which
    no other rank can print: it prints it. Rank 0 and single processes print nothing here.
    """
    if is_rank_zero() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    previous = None
    with contextlib.suppress(ValueError):  # handlers can only be set from the main thread
        previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(SILENT_RANK_GRACE_SECONDS)
    close_progress_bars()
    print(message, file=sys.stderr, flush=True)
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def module_of(main: Callable) -> str:
    """The module `main` is defined in, by its import name also when it runs as `python -m module`."""
    module = getattr(main, "__module__", "") or ""
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None else module
    return module


class CommandParser(argparse.ArgumentParser):
    """argparse whose refusals are user errors: `run` prints them as the one `error:` line, exit 2
    (argparse itself would print its usage block and exit 2 from deep inside `parse_args`)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def command_parser(prog: str, doc: str | None, **kwargs: Any) -> CommandParser:
    """The parser every command uses: its module docstring as the help text, no abbreviations."""
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return CommandParser(prog=prog, description=doc, allow_abbrev=False, **kwargs)

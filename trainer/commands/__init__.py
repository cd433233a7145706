"""`dflash2 COMMAND ...` (and `python -m trainer COMMAND ...`): the one front door to every step,
from configuring a draft to publishing it.

This package holds every command: one module each (`trainer/commands/<name>.py`, its argument
parsing and its `main(argv)`), the error runner they all go through (`runner.run`, the project's one
error convention) and, here, the table of commands. The concern packages (data, training,
evaluation, plan, publishing, rehearsal) are libraries without a `main`. This module imports
nothing heavy, because the dispatcher must stay cheap: `dflash2 --help`, an unknown command or a
misplaced flag is answered from this table alone, before torch is imported (the runner and every
command import it, about 8 s). Each command is imported only when it runs.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass
from typing import NoReturn

from trainer.console import DEBUG_FLAG, USER_ERROR_STATUS

PROG = "dflash2"


@dataclass(frozen=True)
class Command:
    """A subcommand: the module whose `main(argv)` runs it, its line in `dflash2 --help`, and what
    its Ctrl-C line says was kept (`runner.run`)."""

    module: str
    summary: str
    kept: str


RERUN = "run the same command again"
COMMANDS: dict[str, Command] = {
    "configure": Command(
        "trainer.commands.configure",
        "write a draft config and a starter recipe for any causal LM",
        f"nothing was written (the draft config and recipe are written whole at the end); {RERUN}",
    ),
    "plan": Command(
        "trainer.commands.plan",
        "per-rank memory of a training run, from the recipe and configs alone",
        "nothing was written (plan only reads)",
    ),
    "rehearse": Command(
        "trainer.commands.rehearse",
        "run a recipe here at tiny widths, as its GPU run will: every check, and what only a GPU shows",
        "the rehearsal's workspace (printed first) keeps what finished; nothing of the recipe's own was written; "
        f"{RERUN}",
    ),
    "prepare": Command(
        "trainer.commands.prepare",
        "answer the prompts and capture target features ahead of training",
        f"the answers finished so far (the cache's journal) and complete feature stores are kept; {RERUN} "
        "to continue from them",
    ),
    "train": Command(
        "trainer.commands.train",
        "train a draft on a recipe (no recipe: the embedded default)",
        "complete checkpoints in output_dir and the cache's finished answers and features are kept; "
        f"{RERUN} to continue (with --resume_from_checkpoint true if a checkpoint was saved)",
    ),
    "evaluate": Command(
        "trainer.commands.evaluate",
        "real speculative decoding: τ, acceptance, speed-up",
        f"no report was written (it is written when decoding ends); {RERUN}",
    ),
    "export": Command(
        "trainer.commands.export",
        "a checkpoint to a publishable folder (and the Hub)",
        "an export folder is written whole, then renamed, and a Hub push is one commit: neither was left "
        f"half-written; {RERUN}",
    ),
    "publish": Command(
        "trainer.commands.publish",
        "push an existing export folder to the Hub",
        f"the upload is one commit, so the Hub repo is unchanged unless it had completed; {RERUN}",
    ),
    "tau-gap": Command(
        "trainer.commands.tau_gap",
        "teacher-forced τ at the anchors real decoding visited",
        f"no report was written (it is written at the end); {RERUN}",
    ),
}
# the Ctrl-C line of a `main` that is none of the commands' (e.g. a test's)
UNKNOWN_KEPT = f"stopped before finishing; {RERUN}"


def kept_on_interrupt(module: str) -> str:
    """What the command whose `main` lives in `module` keeps when Ctrl-C stops it."""
    return next((command.kept for command in COMMANDS.values() if command.module == module), UNKNOWN_KEPT)


def usage() -> str:
    """The text of `dflash2 --help`: every command with its one line."""
    width = max(len(name) for name in COMMANDS)
    lines = [
        f"usage: {PROG} COMMAND [options]   ({PROG} COMMAND --help lists a command's options)",
        "",
        "Train, evaluate, export and publish DFlash2 speculative-decoding drafts.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()),
        "",
        f"{DEBUG_FLAG} anywhere shows the traceback of a user error instead of its one line.",
    ]
    return "\n".join(lines)


def refuse(message: str) -> NoReturn:
    """The runner's convention for a user error: one line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_STATUS)


def find_command(name: str) -> Command:
    """The named command, or a ValueError naming the closest one."""
    if name in COMMANDS:
        return COMMANDS[name]
    close = difflib.get_close_matches(name, COMMANDS, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ValueError(f"unknown command {name!r}{hint} (choose from {', '.join(COMMANDS)})")


def split_command(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the command's name, the arguments it gets); `--debug` may precede the name and is kept."""
    for index, arg in enumerate(argv):
        if arg == DEBUG_FLAG:
            continue
        if arg in ("-h", "--help"):
            return "--help", []
        if arg.startswith("-"):
            raise ValueError(f"unrecognized option {arg!r} before the command (options go after it)")
        debug = [DEBUG_FLAG] if index else []  # only --debug can come before the name
        return arg, [*argv[index + 1 :], *debug]
    return None, []


def main(argv: list[str] | None = None) -> NoReturn:
    """`dflash2 COMMAND ARGS`: run the command's `main(ARGS)` through `runner.run`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        name, rest = split_command(argv)
        if name == "--help":
            print(usage())
            sys.exit(0)
        if name is None:
            raise ValueError(f"no command given; {PROG} --help lists them ({', '.join(COMMANDS)})")
        command = find_command(name)
    except ValueError as error:
        refuse(str(error))
    from trainer.commands.runner import run

    module = importlib.import_module(command.module)
    run(module.main, rest)

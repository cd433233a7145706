"""Every `dflash2 ...`, `python -m trainer ...` and `python -m benchmarks...` command the docs show
runs as written.

A reader copies these lines from a fresh clone, where only `trainer/` and `modeling_dflash2/` are
installed (`pip install -e .`, which also installs the `dflash2` script) and PYTHONPATH is unset: a
script that imports `examples.` or `tests.` then dies with ModuleNotFoundError before parsing a
flag. `dflash2` lines run the installed console script itself. Each command runs with `--help`
appended, so the script imports everything and parses its arguments, then prints its usage and
exits 0 without doing the work; placeholders (RECIPE, my-recipe.yaml, OUTPUT) need not exist.

`accelerate launch ... -m trainer train` lines are not run here: the launcher spawns workers of
`python -m trainer train`, which is `dflash2 train`, covered here; tests/integration/test_commands.py launches
one for real. `make` targets do the work itself and are left to CI.

Each command costs seconds of importing torch and transformers, and the docs show about 80: the
first command of each form (`dflash2`, `python -m ...`) runs as its own
fresh process; the others run through tests/support/forked_python.py, forked from one process
that has imported only those third-party libraries (nothing of this repository), each child with the
argv, sys.path and `__main__` the real invocation gives it, so a missing module or a bad flag fails
there as it would.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCUMENTS = (README, *sorted(path for path in (REPO / "docs").iterdir() if path.suffix == README.suffix))
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")  # a code span may wrap onto the next prose line
PREFIXES = ("dflash2 ", "python -m trainer ", "python -m benchmarks.")
SCRIPT = Path(sys.executable).with_name("dflash2")  # the console script next to the interpreter
TIMEOUT_S = 120  # a --help imports torch and transformers: seconds, not minutes


def fenced_lines(text: str) -> list[str]:
    """The lines of every fenced block, a `\\` continuation joined with the line after it."""
    lines = []
    for block in FENCE.findall(text):
        pending = ""
        for line in block.splitlines():
            stripped = line.rstrip()
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            lines.append(pending + stripped)
            pending = ""
        if pending:
            lines.append(pending)
    return lines


def inline_spans(text: str) -> list[str]:
    """Inline code spans outside the fenced blocks, a wrapped span joined with a space."""
    return [" ".join(span.split()) for span in INLINE.findall(FENCE.sub("", text))]


def command_argv(line: str) -> list[str] | None:
    """The argv of a documented command, or None when the line is not one.

    `$ ` prompts and `# comments` go (shlex keeps a `#` inside quotes); optional `[--flag value]`
    groups are kept with their brackets removed, so every documented flag is parsed; `...` is an
    elision, not an argument.
    """
    try:
        words = shlex.split(line.strip().removeprefix("$ "), comments=True)
    except ValueError:  # prose with an unbalanced quote
        return None
    if not (" ".join(words[:3]) + " ").startswith(PREFIXES):
        return None
    argv = [word.removeprefix("[").removesuffix("]") for word in words if word != "..."]
    return [word for word in argv if word]


def documented_commands(documents: tuple[Path, ...] = DOCUMENTS) -> list[tuple[str, ...]]:
    """Every distinct documented command, in document order."""
    found: dict[tuple[str, ...], None] = {}
    for document in documents:
        text = document.read_text()
        for line in (*fenced_lines(text), *inline_spans(text)):
            argv = command_argv(line)
            if argv is not None:
                found.setdefault(tuple(argv), None)
    return list(found)


def fresh_clone_environment() -> dict[str, str]:
    """The test process's environment without PYTHONPATH: what a user's shell has."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment["OMP_NUM_THREADS"] = "1"
    return environment


def run_with_help(argv: tuple[str, ...]) -> subprocess.CompletedProcess:
    """`python` is the test's interpreter (the project's environment), `dflash2` its console
    script; the rest as written."""
    program = [str(SCRIPT)] if argv[0] == "dflash2" else [sys.executable]
    command = [*program, *argv[1:], "--help"]
    return subprocess.run(
        command, cwd=REPO, env=fresh_clone_environment(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


COMMANDS = documented_commands()
# third-party libraries the installed project requires (setup.cfg): the forking process imports
# these and nothing of this repository
PRELOADED = ("torch", "transformers", "transformers.trainer", "accelerate", "datasets")
FORKED_PYTHON = REPO / "tests" / "support" / "forked_python.py"


def as_python_argv(argv: tuple[str, ...]) -> list[str]:
    """What `python` runs for a documented line: the console script is a script like any other."""
    return [str(SCRIPT), *argv[1:]] if argv[0] == "dflash2" else list(argv[1:])


def forked_help_runs(commands: list[tuple[str, ...]]) -> list[subprocess.CompletedProcess]:
    """`run_with_help` for each command, in children forked from one process (see the docstring)."""
    workers = max(1, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as out:
        jobs = Path(out) / "jobs.json"
        jobs.write_text(json.dumps([[*as_python_argv(argv), "--help"] for argv in commands]))
        server = subprocess.run(
            [sys.executable, str(FORKED_PYTHON), str(jobs), out, str(workers), *PRELOADED],
            cwd=REPO,
            env=fresh_clone_environment(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S * 4,
        )
        assert server.returncode == 0, server.stderr[-3000:]
        folder = Path(out)
        return [
            subprocess.CompletedProcess(
                [*argv, "--help"],
                int((folder / f"{index}.rc").read_text()),
                (folder / f"{index}.out").read_text(),
                (folder / f"{index}.err").read_text(),
            )
            for index, argv in enumerate(commands)
        ]


def form(argv: tuple[str, ...]) -> str:
    return "dflash2" if argv[0] == "dflash2" else ("-m" if argv[1] == "-m" else "script")


@cache
def help_runs() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """The first command of each form in a fresh process, the rest forked (see the docstring)."""
    firsts = list({form(argv): argv for argv in reversed(COMMANDS)}.values())
    rest = [argv for argv in COMMANDS if argv not in firsts]
    with ThreadPoolExecutor(max_workers=len(firsts)) as pool:
        fresh = dict(zip(firsts, pool.map(run_with_help, firsts), strict=True))
    return {**fresh, **dict(zip(rest, forked_help_runs(rest), strict=True))}


def test_the_extraction_joins_continuations_and_drops_comments_prompts_and_elisions():
    text = (
        "Run `python -m trainer evaluate ... --compare-untrained` or `make demo`, or\n"
        "`dflash2 tau-gap --target T\n--draft D`.\n"
        "```bash\n"
        "# a comment line\n"
        "python -m trainer export CKPT OUT \\\n"
        "    --target T --push-to-hub org/name   # B - 1\n"
        "$ python -m benchmarks.run --device cuda\n"
        "python -m trainer.plan RECIPE\n"
        "dflash2 evaluate --draft D [--max-samples N]   # real decoding\n"
        "accelerate launch --config_file x.yaml -m trainer train my-recipe.yaml\n"
        "dflash2 publish OUT org/name [--private] [--revision BRANCH]\n"
        "vllm serve T --speculative-config '{\"num_speculative_tokens\": 15}  # not a comment'\n"
        "```\n"
    )
    commands = [command_argv(line) for line in (*fenced_lines(text), *inline_spans(text))]
    assert [argv for argv in commands if argv is not None] == [
        ["python", "-m", "trainer", "export", "CKPT", "OUT", "--target", "T", "--push-to-hub", "org/name"],
        ["python", "-m", "benchmarks.run", "--device", "cuda"],
        ["dflash2", "evaluate", "--draft", "D", "--max-samples", "N"],
        ["dflash2", "publish", "OUT", "org/name", "--private", "--revision", "BRANCH"],
        ["python", "-m", "trainer", "evaluate", "--compare-untrained"],
        ["dflash2", "tau-gap", "--target", "T", "--draft", "D"],
    ]


def test_the_docs_show_the_commands_a_fresh_clone_must_run():
    """The extraction still finds what the docs show: a README edit or a broken parser would
    otherwise leave the run below with nothing to check."""
    scripts = {argv[2] if argv[1] == "-m" else argv[1] for argv in COMMANDS if len(argv) > 1}
    assert {"configure", "plan", "prepare", "train", "evaluate", "export", "publish", "tau-gap"} <= scripts
    assert {"benchmarks.run", "benchmarks.gpu_check", "benchmarks.compare"} <= scripts
    assert ("dflash2", "prepare", "my-recipe.yaml", "--regenerate-only") in COMMANDS


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(argv[1:]) for argv in COMMANDS])
def test_a_documented_command_takes_help_without_pythonpath(argv: tuple[str, ...]):
    result = help_runs()[argv]
    assert "ModuleNotFoundError" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout.lower(), f"--help did not print a usage: {result.stdout[-2000:]}"

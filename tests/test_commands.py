"""`dflash2`, the one front door: the installed script lists every command, each command's `--help`
shows its own options, a wrong command or flag is one `error:` line with status 2, and the
examples/ scripts and the subcommands run the very same library `main`."""

from __future__ import annotations

import ast
import importlib
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import commands

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("dflash2")
# the script of examples/ that runs each command (a launcher needs a file: accelerate launch examples/train.py)
EXAMPLE_OF = {
    "prepare": "prepare.py",
    "train": "train.py",
    "evaluate": "evaluate.py",
    "export": "export.py",
    "publish": "publish.py",
    "tau-gap": "tau_gap.py",
    "compare": "compare_recipes.py",
}
# one real option of each command, as its --help must show it
OPTION_OF = {
    "configure": ("--num-draft-layers", "--block-size"),
    "plan": ("--num-gpus", "--accelerate-config"),
    "rehearse": ("--ranks", "--accelerate-config"),
    "prepare": ("--regenerate-only", "--offline"),
    "train": ("--learning_rate", "--num_anchors"),
    "evaluate": ("--max-samples", "--compare-untrained"),
    "export": ("--push-to-hub", "--evaluation-report"),
    "publish": ("--commit-message", "--revision"),
    "tau-gap": ("--max-samples", "--paths"),
    "compare": ("--recipes", "--seeds"),
}


def installed_script(*args: str) -> subprocess.CompletedProcess:
    """The console script as a user runs it: outside the checkout, PYTHONPATH unset."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment["OMP_NUM_THREADS"] = "1"
    return subprocess.run([str(SCRIPT), *args], cwd="/", env=environment, capture_output=True, text=True, timeout=120)


def test_the_table_names_the_nine_commands_and_each_module_has_a_main():
    assert list(commands.COMMANDS) == list(OPTION_OF)
    for command in commands.COMMANDS.values():
        assert callable(importlib.import_module(command.module).main), command.module


def test_installed_help_lists_every_command_with_its_line_without_importing_torch():
    assert SCRIPT.is_file(), "pip install -e . did not install the dflash2 script"
    result = installed_script("--help")
    assert result.returncode == 0, result.stderr
    for name, command in commands.COMMANDS.items():
        assert f"  {name}" in result.stdout and command.summary in result.stdout, name
    assert result.stderr == ""
    # the same text without the script: cheap because the dispatcher imports nothing heavy
    probe = "import sys, trainer.commands; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trian", "recipe.yaml"], "error: unknown command 'trian'; did you mean train?"),
        (["--bogus", "train"], "error: unrecognized option '--bogus' before the command"),
        ([], "error: no command given"),
    ],
)
def test_a_wrong_command_is_one_error_line_and_status_2(argv, message):
    result = installed_script(*argv)
    assert result.returncode == 2
    assert result.stdout == "" and result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


def test_train_help_is_reachable_through_the_installed_script():
    """HfArgumentParser's listing of every recipe key, under the command's own name."""
    result = installed_script("train", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: dflash2 train" in result.stdout
    assert "--learning_rate" in result.stdout and "--num_anchors" in result.stdout and "--loss_type" in result.stdout


@pytest.mark.parametrize("name", list(OPTION_OF))
def test_each_command_help_exits_0_and_shows_its_own_options(name, capsys):
    with pytest.raises(SystemExit) as stop:
        commands.main([name, "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    assert f"dflash2 {name}" in out, out[:500]
    for option in OPTION_OF[name]:
        assert option in out, f"{name} --help does not show {option}"


@pytest.mark.parametrize("name", ["evaluate", "export", "configure", "plan", "compare"])
def test_a_bad_flag_of_a_command_is_one_error_line_and_status_2(name, capsys):
    argv = {"plan": ["plan", "recipe.yaml", "--num-gpus", "many"]}.get(name, [name, "--no-such-flag"])
    with pytest.raises(SystemExit) as stop:
        commands.main(argv)
    captured = capsys.readouterr()
    assert stop.value.code == 2
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err


def recording_main(monkeypatch, module: str) -> list[list[str]]:
    """Replace the library `main` of a command by one that records its arguments."""
    calls: list[list[str]] = []
    monkeypatch.setattr(importlib.import_module(module), "main", lambda argv: calls.append(list(argv)))
    return calls


def test_the_command_runs_the_library_main_with_its_arguments_and_debug_anywhere(monkeypatch):
    calls = recording_main(monkeypatch, "trainer.training.run")
    for argv in (["train", "r.yaml", "--max_steps", "2"], ["--debug", "train", "r.yaml", "--max_steps", "2"]):
        with pytest.raises(SystemExit) as stop:
            commands.main(argv)
        assert stop.value.code == 0
    assert calls == [["r.yaml", "--max_steps", "2"]] * 2  # `--debug` is trainer.cli.run's, not the command's


@pytest.mark.parametrize(("name", "script"), list(EXAMPLE_OF.items()))
def test_each_example_is_a_thin_script_over_the_command_main(name, script):
    """Nothing but a docstring, the two imports and `run(main)`: the logic lives in the library."""
    tree = ast.parse((REPO / "examples" / script).read_text())
    docstring, *statements = tree.body
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
    imports = {(node.module, alias.name) for node in statements[:-1] for alias in node.names}
    assert imports == {("trainer.cli", "run"), (commands.COMMANDS[name].module, "main")}
    assert ast.unparse(statements[-1]) == "if __name__ == '__main__':\n    run(main)"


def test_an_example_script_calls_the_same_main_as_its_command(monkeypatch):
    calls = recording_main(monkeypatch, "trainer.evaluation.evaluate_command")
    monkeypatch.setattr(sys, "argv", ["examples/evaluate.py", "--target", "T", "--draft", "D"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / "examples" / "evaluate.py"), run_name="__main__")
    assert stop.value.code == 0 and calls == [["--target", "T", "--draft", "D"]]


def test_nothing_installed_imports_examples_or_tests():
    """The console script runs where only the package is installed: no examples/, no tests/."""
    offenders = []
    for folder in ("trainer", "modeling_dflash2", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                if any(name.split(".")[0] in ("examples", "tests") for name in names):
                    offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_python_dash_m_trainer_is_the_same_front_door():
    result = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == commands.usage() + "\n"

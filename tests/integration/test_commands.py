"""`dflash2`, the one front door: the installed script lists every command, each command's `--help`
shows its own options, a wrong command or flag is one `error:` line with status 2, every command
lives in trainer/commands/ (the concern packages have no `main`), `python -m trainer` is the same
front door, and `accelerate launch -m trainer train RECIPE` trains for real."""

from __future__ import annotations

import ast
import importlib
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.distributed.tiny_setup import write_tiny_run
from trainer import commands
from trainer.evaluation.report import run_summary

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("dflash2")
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
}


def installed_script(*args: str) -> subprocess.CompletedProcess:
    """The console script as a user runs it: outside the checkout, PYTHONPATH unset."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment["OMP_NUM_THREADS"] = "1"
    return subprocess.run([str(SCRIPT), *args], cwd="/", env=environment, capture_output=True, text=True, timeout=120)


def test_the_table_names_the_nine_commands_and_each_module_has_a_main():
    assert list(commands.COMMANDS) == list(OPTION_OF)
    for name, command in commands.COMMANDS.items():
        assert command.module == f"trainer.commands.{name.replace('-', '_')}", name  # one name, one module
        assert callable(importlib.import_module(command.module).main), command.module


def module_level_mains(path: Path) -> list[str]:
    """`def main` and `if __name__ == "__main__"` at a module's top level."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            found.append(f"{path.relative_to(REPO)}:{node.lineno} def main")
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} __main__")
    return found


def test_every_command_lives_in_the_commands_package_and_the_libraries_have_no_main():
    """The concern packages (data, training, evaluation, plan, publishing, rehearsal, ...) are
    libraries: a command's parsing and `main` live in trainer/commands/ only."""
    offenders = [
        found
        for path in sorted((REPO / "trainer").rglob("*.py"))
        if "commands" not in path.relative_to(REPO / "trainer").parts and path.name != "__main__.py"
        for found in module_level_mains(path)
    ]
    assert offenders == []
    assert [found.split()[-1] for found in module_level_mains(REPO / "trainer" / "__main__.py")] == ["__main__"]
    scripts = sorted(path.name for path in (REPO / "examples").glob("*.py"))
    assert scripts == ["__init__.py"], "examples/ holds recipes and accelerate configs; launchers take -m trainer"


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


@pytest.mark.parametrize("name", ["evaluate", "export", "configure", "plan"])
def test_a_bad_flag_of_a_command_is_one_error_line_and_status_2(name, capsys):
    argv = {"plan": ["plan", "recipe.yaml", "--num-gpus", "many"]}.get(name, [name, "--no-such-flag"])
    with pytest.raises(SystemExit) as stop:
        commands.main(argv)
    captured = capsys.readouterr()
    assert stop.value.code == 2
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err


def recording_main(monkeypatch, module: str) -> list[list[str]]:
    """Replace the `main` of a command by one that records its arguments."""
    calls: list[list[str]] = []
    monkeypatch.setattr(importlib.import_module(module), "main", lambda argv: calls.append(list(argv)))
    return calls


def test_the_command_runs_its_main_with_its_arguments_and_debug_anywhere(monkeypatch):
    calls = recording_main(monkeypatch, "trainer.commands.train")
    for argv in (["train", "r.yaml", "--max_steps", "2"], ["--debug", "train", "r.yaml", "--max_steps", "2"]):
        with pytest.raises(SystemExit) as stop:
            commands.main(argv)
        assert stop.value.code == 0
    assert calls == [["r.yaml", "--max_steps", "2"]] * 2  # `--debug` is the runner's, not the command's


def test_python_dash_m_trainer_runs_the_same_main_as_the_command(monkeypatch):
    """`python -m trainer evaluate ...` (what a launcher's `-m trainer` starts) is `dflash2 evaluate ...`."""
    calls = recording_main(monkeypatch, "trainer.commands.evaluate")
    monkeypatch.setattr(sys, "argv", ["trainer", "evaluate", "--target", "T", "--draft", "D"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_module("trainer", run_name="__main__")
    assert stop.value.code == 0 and calls == [["--target", "T", "--draft", "D"]]


def test_accelerate_launch_dash_m_trainer_train_trains_a_tiny_recipe(tmp_path):
    """The documented multi-GPU launch, `accelerate launch --config_file examples/accelerate/fsdp2.yaml
    -m trainer train RECIPE`, for real on two CPU ranks: no script file is needed. The shipped config
    with only num_processes and use_cpu changed (FSDP does not run on CPU: the ranks train as DDP)."""
    recipe = write_tiny_run(tmp_path, max_steps=2, save_steps=2)
    shipped = yaml.safe_load((REPO / "examples" / "accelerate" / "fsdp2.yaml").read_text())
    config = tmp_path / "accelerate.yaml"
    config.write_text(yaml.safe_dump({**shipped, "num_processes": 2, "use_cpu": True}))
    accelerate = Path(sys.executable).with_name("accelerate")
    launcher = (
        [str(accelerate)] if accelerate.is_file() else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
    )
    environment = {
        key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "DFLASH2_DEBUG")
    }
    environment.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [*launcher, "launch", "--config_file", str(config), "--main_process_port", "0"]
    result = subprocess.run(
        [*command, "-m", "trainer", "train", str(recipe)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    output = tmp_path / "output"
    state = json.loads((output / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    checkpoint = output / "checkpoint-2"
    assert (checkpoint / "rng_state_0.pth").is_file() and (checkpoint / "rng_state_1.pth").is_file()  # 2 ranks
    assert (output / "model.safetensors").is_file()
    trained = run_summary(output)["trained"]
    assert result.stdout.count("Draft checkpoint:") == 1  # rank 0 alone prints the summary
    assert f"{trained['eval_loss']:>12.4f}" in result.stdout


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

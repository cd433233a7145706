"""Issue 31, row "tracebacks where one line is promised": same-size damage to a real checkpoint's
safetensors header, optimizer.pt, trainer_state.json or manifest, then `dflash2 train` resumes from
it. A named checkpoint is refused in one `error:` line naming the file (exit 2, no traceback);
`--resume_from_checkpoint true` skips it for the previous complete one and finishes the run."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import yaml

from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.commands import train
from trainer.commands.runner import run
from trainer.training.checkpoints import MANIFEST, checkpoint_problems, list_checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished tiny run (4 steps) holding checkpoint-2 and checkpoint-4."""
    root = tmp_path_factory.mktemp("trained")
    recipe = write_tiny_run(root)
    train.main([str(recipe)])
    assert [p.name for p in list_checkpoints(root / "output")] == ["checkpoint-2", "checkpoint-4"]
    return root


def copy_of(trained: Path, where: Path) -> tuple[str, Path]:
    """A recipe training into a copy of the finished run's output_dir, and that copy."""
    shutil.copytree(trained / "output", where / "output")
    values = yaml.safe_load((trained / "recipe.yaml").read_text())
    values["output_dir"] = str(where / "output")
    recipe = where / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    return str(recipe), where / "output"


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {  # file -> the byte flipped (same size)
    "model.safetensors": lambda size: 20,  # inside the JSON header
    "optimizer.pt": lambda size: size // 2,
    "trainer_state.json": lambda size: size // 2,
    MANIFEST: lambda size: size // 2,
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_named_damaged_checkpoint_is_one_error_line_naming_the_file(trained, tmp_path, capsys, name):
    recipe, output = copy_of(trained, tmp_path)
    damaged = output / "checkpoint-4"
    flip(damaged / name, DAMAGE[name]((damaged / name).stat().st_size))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run(train.main, [recipe, "--resume_from_checkpoint", str(damaged)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"error: checkpoint {damaged} cannot be resumed from: {name} "), errors[0]
    assert "damaged" in errors[0]


def test_resume_true_skips_a_damaged_checkpoint_and_finishes_from_the_previous(trained, tmp_path, caplog):
    recipe, output = copy_of(trained, tmp_path)
    damaged = output / "checkpoint-4"
    flip(damaged / "optimizer.pt", (damaged / "optimizer.pt").stat().st_size // 2)
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as finished:
        run(train.main, [recipe, "--resume_from_checkpoint", "true"])
    assert finished.value.code == 0
    skipped = (
        f"Skipping damaged checkpoint {damaged}: optimizer.pt does not match its recorded sha256 "
        "(damaged since it was saved)"
    )
    assert caplog.text.count(skipped) == 1
    assert f"Resuming from {output / 'checkpoint-2'}" in caplog.text
    assert {p.name: checkpoint_problems(p) for p in list_checkpoints(output)} == {
        "checkpoint-2": [],
        "checkpoint-4": [],  # saved again by the resumed run
    }


def test_a_run_resumes_with_its_target_moved_and_named_by_a_relative_path(trained, tmp_path, monkeypatch, caplog):
    _, output = copy_of(trained, tmp_path)
    shutil.copytree(trained / "target", tmp_path / "moved" / "target")
    values = yaml.safe_load((trained / "recipe.yaml").read_text())
    values.update(output_dir=str(output), target="./target", max_steps=5)
    recipe = tmp_path / "moved" / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    monkeypatch.chdir(tmp_path / "moved")
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as finished:
        run(train.main, [str(recipe), "--resume_from_checkpoint", "true"])
    assert finished.value.code == 0, caplog.text[-2000:]
    assert f"Resuming from {output / 'checkpoint-4'}" in caplog.text
    assert "changed target" not in caplog.text
    assert (output / "checkpoint-5").is_dir()

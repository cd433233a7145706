"""Loose ends of issue 31: settings files are read like recipes, and a folder lock's grace for an
empty record counts from when the record was seen empty."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.cli import run
from trainer.plan.cli import main as plan_main
from trainer.plan.facts import read_accelerate_config

REPO = Path(__file__).resolve().parents[1]
FSDP2 = REPO / "examples" / "accelerate" / "fsdp2.yaml"
RECIPE_8B = REPO / "examples" / "recipes" / "qwen3-8b-fsdp2.yaml"
TARGET_8B = REPO / "tests" / "fixtures" / "targets" / "qwen3-8b"


def test_an_accelerate_config_with_a_key_given_twice_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "accelerate.yaml"
    lines = FSDP2.read_text().splitlines()
    first = lines.index("num_processes: 8") + 1
    path.write_text("\n".join(lines) + "\nnum_processes: 2\n")
    with pytest.raises(ValueError) as refused:
        read_accelerate_config(str(path))
    message = str(refused.value)
    assert message.startswith(f"--accelerate-config {path}: key 'num_processes' is given twice (first on line {first})")
    assert message.endswith(f"(line {len(lines) + 1}, column 1)")


def test_an_accelerate_config_with_an_alias_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: &kind FSDP\nmixed_precision: *kind\nnum_processes: 2\n")
    with pytest.raises(ValueError, match=rf"^--accelerate-config {path}: YAML anchors \(&kind\) are not allowed"):
        read_accelerate_config(str(path))


def test_the_plan_command_names_a_damaged_accelerate_config_in_one_line(tmp_path, capsys):
    path = tmp_path / "accelerate.yaml"
    path.write_text("num_processes: 8\nnum_processes: 1\n")
    with pytest.raises(SystemExit) as stop:
        run(plan_main, [str(RECIPE_8B), "--target", str(TARGET_8B), "--accelerate-config", str(path)])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: --accelerate-config {path}: key 'num_processes' is given twice (first on line 1): keep one "
        "(line 2, column 1)"
    ]

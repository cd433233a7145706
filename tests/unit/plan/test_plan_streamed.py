"""`dflash2 plan` with features streamed from vLLM servers (`feature_endpoint`, `offline: false`): the
target is its embedding and LM head only, nothing is captured, and the plan says how many feature
bytes cross the network per optimizer step. Also the figures and commands docs/scale.md quotes for
a DeepSeek-V3-sized target on two nodes."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig

from modeling_dflash2 import DFlash2Config
from trainer.commands.configure import main as configure
from trainer.commands.plan import main
from trainer.data.engine_features import engine_feature_command
from trainer.plan import fit_check
from trainer.plan.facts import GIB, draft_facts, run_facts, target_facts
from trainer.plan.memory import MemoryPlan, capture_bytes, step_shape, streamed_feature_bytes
from trainer.training.arguments import parse_arguments

REPO = Path(__file__).resolve().parents[3]
RECIPE_8B = REPO / "examples" / "recipes" / "qwen3-8b-fsdp2.yaml"
FSDP2 = REPO / "examples" / "accelerate" / "fsdp2.yaml"
DEEPSEEK = REPO / "tests" / "fixtures" / "deepseek-v3-config"
SCALE_DOC = REPO / "docs" / "scale.md"
ENDPOINT = "http://serving-node:8000/v1"
STORAGE = "/shared/hidden-states"
STREAMED = ("--target_sharding", "none", "--feature_endpoint", ENDPOINT, "--feature_storage_path", STORAGE)
# DeepSeek-V3: vocabulary 129280 x hidden 7168, untied, 61 layers; 671,026,404,352 parameters in
# transformers' DeepseekV3ForCausalLM (the multi-token-prediction layer is not part of it).
VOCAB, HIDDEN = 129280, 7168
DEEPSEEK_PARAMETERS = 671_026_404_352
# The mask id of the config-only planning target (it has no tokenizer to choose from): the last row.
# It changes no byte of the plan; configure picks the real one from deepseek-ai/DeepSeek-V3's tokenizer.
MASK_ID = 129279
CONFIGURE = (
    f"dflash2 configure tests/fixtures/deepseek-v3-config --num-draft-layers 5 --block-size 16 "
    f"--mask-token-id {MASK_ID} --output my-drafts/deepseek-v3.json"
)


@pytest.fixture(scope="module")
def deepseek_draft(tmp_path_factory) -> Path:
    """The draft `dflash2 configure` writes for the config-only DeepSeek-V3 (the command docs/scale.md shows)."""
    path = tmp_path_factory.mktemp("drafts") / "deepseek-v3.json"
    configure([*shlex.split(CONFIGURE)[2:-2], "--output", str(path)])
    return path


def plan(capsys, draft: Path, *argv: str) -> tuple[MemoryPlan, str]:
    """`dflash2 plan` of the 8B recipe's shapes for the DeepSeek-V3 target: the plan and what it printed."""
    capsys.readouterr()
    recipe = [
        str(RECIPE_8B),
        "--accelerate-config",
        str(FSDP2),
        "--target",
        str(DEEPSEEK),
        "--draft_config",
        str(draft),
    ]
    result = main([*recipe, *argv])
    return result, capsys.readouterr().out


# -- the network bytes, worked by hand ------------------------------------------------------------


def test_streamed_feature_bytes_worked_by_hand(deepseek_draft):
    arguments = parse_arguments([str(RECIPE_8B), "--target", str(DEEPSEEK), *STREAMED])
    draft = draft_facts(DFlash2Config.from_json_file(deepseek_draft))
    target = target_facts(AutoConfig.from_pretrained(DEEPSEEK))
    run = run_facts(*arguments, 8, None)
    assert draft.target_layer_ids == (1, 15, 30, 44, 58)
    # 4 rows x 4096 tokens x 5 layers x 7168 x 2 bytes (bf16) = 1,174,405,120 bytes a micro-batch,
    # x 2 accumulation steps x 8 ranks
    assert streamed_feature_bytes(draft, target, run) == 4 * 4096 * 5 * 7168 * 2 * 2 * 8 == 18_790_481_920
    # a repeated layer crosses once (vLLM's ids are de-duplicated); fp32, other shapes
    repeated = dataclasses.replace(draft, target_layer_ids=(3, 3, 7))
    other = dataclasses.replace(
        run, micro_batch=3, max_length=100, target_bytes=4, gradient_accumulation=5, world_size=3
    )
    assert streamed_feature_bytes(repeated, target, other) == 3 * 100 * 2 * 7168 * 4 * 5 * 3 == 258_048_000
    assert streamed_feature_bytes(draft, target, dataclasses.replace(run, feature_servers=0)) == 0


def test_head_only_parameters_worked_by_hand():
    deepseek = target_facts(AutoConfig.from_pretrained(DEEPSEEK))
    assert deepseek.parameters == DEEPSEEK_PARAMETERS
    assert deepseek.embedding_parameters == deepseek.head_parameters == VOCAB * HIDDEN == 926_679_040
    assert deepseek.head_only_parameters == deepseek.whole_parameters - HIDDEN  # all but the final norm
    smollm2 = target_facts(
        LlamaConfig(**json.loads((REPO / "tests/fixtures/target_configs/smollm2-135m-instruct.json").read_text()))
    )
    assert smollm2.head_parameters == 0 and smollm2.head_only_parameters == 49152 * 576  # tied: counted once


# -- the plan ------------------------------------------------------------------------------------


def test_the_training_node_holds_the_embedding_and_head_only(capsys, deepseek_draft):
    streamed, _ = plan(capsys, deepseek_draft, *STREAMED, "--gpu-memory-gb", "141")
    full, _ = plan(capsys, deepseek_draft, "--target_sharding", "none", "--gpu-memory-gb", "141")
    head_bytes = (VOCAB * HIDDEN + VOCAB * HIDDEN) * 2  # untied embedding and LM head, bf16
    assert streamed.parts["target_weights"] == head_bytes == 3_706_716_160
    assert full.parts["target_weights"] == DEEPSEEK_PARAMETERS * 2
    assert streamed.parts["target_weights"] < 0.003 * full.parts["target_weights"]
    assert streamed.per_rank_bytes < full.per_rank_bytes / 12
    assert streamed.fits and not full.fits and streamed.max_micro_batch >= 4 and full.max_micro_batch == 0
    for part in ("draft_weights", "draft_gradients", "optimizer_states", "loss_head", "other"):
        assert streamed.parts[part] == full.parts[part]
    assert streamed.parts["activations"] <= full.parts["activations"]  # no capture working set
    assert streamed.as_json()["streamed_feature_bytes_per_step"] == 18_790_481_920
    assert "streamed_feature_bytes_per_step" not in full.as_json()


def test_the_capture_working_set_is_not_planned_with_streamed_features(deepseek_draft):
    draft = draft_facts(DFlash2Config.from_json_file(deepseek_draft))
    target = target_facts(AutoConfig.from_pretrained(DEEPSEEK))
    online = run_facts(
        *parse_arguments([str(RECIPE_8B), "--target", str(DEEPSEEK), "--target_sharding", "none"]), 8, None
    )
    streamed = run_facts(*parse_arguments([str(RECIPE_8B), "--target", str(DEEPSEEK), *STREAMED]), 8, None)
    shape = step_shape(draft, online, 4)
    assert capture_bytes(draft, target, online, shape) > 4 * 4096 * 5 * HIDDEN * 2  # the target ran here
    assert capture_bytes(draft, target, streamed, shape) == 0
    assert streamed.feature_bytes == online.feature_bytes == 2  # arriving in target_dtype, as captured


def test_the_printed_plan_says_what_is_loaded_and_what_crosses_the_network(capsys, deepseek_draft):
    _, text = plan(capsys, deepseek_draft, *STREAMED, "--feature_endpoint", ENDPOINT, "http://replica:8000/v1")
    assert "target: bfloat16, embedding + LM head only (features streamed from feature_endpoint)" in text
    assert "features: streamed from 2 vLLM servers (feature_endpoint)" in text
    assert (
        "features over the network per optimizer step: 17.50 GiB (4 rows x 4096 tokens x 5 layers x 7168 x "
        "2 bytes, x 2 micro-batches x 8 ranks)" in text
    )
    assert "target parameters: 671,026,404,352 (loaded: 1,853,358,080, the embedding and LM head)" in text
    _, one = plan(capsys, deepseek_draft, *STREAMED)
    assert "features: streamed from 1 vLLM server (feature_endpoint)" in one


def test_engine_features_stored_first_are_not_streamed(capsys, deepseek_draft):
    stored, text = plan(capsys, deepseek_draft, *STREAMED, "--offline", "true")
    assert "features: offline (from disk)" in text and "target: bfloat16, whole" in text
    assert stored.parts["target_weights"] == DEEPSEEK_PARAMETERS * 2 and stored.streamed_feature_bytes is None


def test_what_training_refuses_with_streamed_features_the_plan_refuses(capsys, deepseek_draft, tmp_path):
    with pytest.raises(ValueError, match="no decoder layers to shard with streamed features") as sharded:
        plan(capsys, deepseek_draft, *STREAMED, "--target_sharding", "fsdp")
    with pytest.raises(ValueError, match="distillation") as distills:
        plan(capsys, deepseek_draft, *STREAMED, "--kd_weight", "0.5")
    config = json.loads(deepseek_draft.read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 30, 60]
    last = tmp_path / "last-layer.json"
    last.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"includes the target's last layer \(60\)") as last_layer:
        plan(capsys, last, *STREAMED)
    assert all("\n" not in str(error.value) for error in (sharded, distills, last_layer))


# -- docs/scale.md: the two-node layout's figures and commands ---------------------------------------


def scale_doc_rows(capsys, draft: Path) -> list[str]:
    """The table docs/scale.md shows for a DeepSeek-V3 draft at the 8B recipe's shapes, recomputed."""

    def row(label: str, result: MemoryPlan) -> str:
        weights = result.parts["target_weights"]
        return (
            f"| {label} | {weights / GIB:.2f} GiB ({weights:,} bytes) | {result.per_rank_bytes / GIB:.2f} GiB | "
            f"{'yes' if result.fits else 'no'} | {result.max_micro_batch} |"
        )

    streamed_141, _ = plan(capsys, draft, *STREAMED, "--gpu-memory-gb", "141")
    streamed_80, _ = plan(capsys, draft, *STREAMED, "--gpu-memory-gb", "80")
    whole, _ = plan(capsys, draft, "--target_sharding", "none", "--gpu-memory-gb", "141")
    sharded, _ = plan(capsys, draft, "--target_sharding", "fsdp", "--gpu-memory-gb", "141")
    network = streamed_141.streamed_feature_bytes
    return [
        row("features streamed, 8 × 141 GiB (H200)", streamed_141),
        row("features streamed, 8 × 80 GiB (H100)", streamed_80),
        row("whole target on every rank, 8 × 141 GiB", whole),
        row("target sharded 8 ways (`target_sharding: fsdp`), 8 × 141 GiB", sharded),
        f"{network / GIB:.2f} GiB ({network:,} bytes) of features per optimizer step",
    ]


def test_the_scale_doc_quotes_the_planned_figures(capsys, deepseek_draft):
    text = SCALE_DOC.read_text()
    for line in scale_doc_rows(capsys, deepseek_draft):
        assert line in text, line
    assert CONFIGURE in text
    streamed, printed = plan(capsys, deepseek_draft, *STREAMED, "--gpu-memory-gb", "141")
    layer_ids = json.loads(deepseek_draft.read_text())["dflash_config"]["target_layer_ids"]
    assert f"`target_layer_ids` {layer_ids}" in text
    assert f"The draft has {streamed.draft_parameters:,} parameters" in text
    # docs/planning.md shows the same run's printed plan, whole
    assert printed.strip() in (REPO / "docs" / "planning.md").read_text()


def test_the_documented_two_node_commands_are_the_ones_the_code_builds(deepseek_draft):
    text = SCALE_DOC.read_text()
    layer_ids = json.loads(deepseek_draft.read_text())["dflash_config"]["target_layer_ids"]
    serving = shlex.join(engine_feature_command("deepseek-ai/DeepSeek-V3", layer_ids, STORAGE, tensor_parallel=8))
    assert serving in text
    training = (
        "accelerate launch --config_file examples/accelerate/fsdp2.yaml -m trainer train my-drafts/deepseek-v3.yaml "
        f"--feature_endpoint {ENDPOINT} --feature_storage_path {STORAGE} --offline false"
    )
    assert training in text
    arguments = parse_arguments([str(RECIPE_8B), *shlex.split(training)[8:]])  # the flags parse as a run's
    assert arguments[1].feature_endpoint == [ENDPOINT] and arguments[1].feature_storage_path == [STORAGE]


def test_prepare_sizes_the_whole_target_also_for_a_streamed_run(monkeypatch):
    """`dflash2 prepare` regenerating in process runs the whole target, whatever the trainer loads later."""
    monkeypatch.setattr(fit_check, "available_memory", lambda: 2**50)
    arguments = parse_arguments([str(RECIPE_8B), "--target", str(DEEPSEEK), *STREAMED])
    assert fit_check.check_target_fits(*arguments) == DEEPSEEK_PARAMETERS * 2
    monkeypatch.setattr(fit_check, "available_memory", lambda: 2**40)
    with pytest.raises(fit_check.RecipeDoesNotFit, match="671,026,404,352 parameters in bfloat16 need"):
        fit_check.check_target_fits(*arguments)

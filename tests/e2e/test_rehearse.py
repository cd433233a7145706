"""`dflash2 rehearse`: the shipped GPU recipes and `configure`'s starter recipe rehearsed on CPU ranks,
each check printed; a recipe that would fail is caught (a FAILED line, exit 1); bad input is one
line (exit 2); and the pieces (tiny architectures, the stand-in tokenizer, the rewritten recipe)
keep what they promise to keep.

The full rehearsals run the console script as a user does, offline (HF_HUB_OFFLINE=1: the data is
the local stand-in) with their own HF_HOME (no default accelerate config) and cache.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from transformers import AutoConfig

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from trainer.commands import configure
from trainer.commands import rehearse as command
from trainer.commands.runner import run
from trainer.data.chat import tokenize_chat
from trainer.data.dataset import DFlashCollator, tokenize_conversations, truncate_and_filter
from trainer.models.target import FrozenTarget
from trainer.rehearsal import run as rehearsal_run
from trainer.rehearsal.architecture import stand_in_tokenizer, tiny_draft_values, tiny_target_config
from trainer.rehearsal.data import shortest
from trainer.rehearsal.launch import Launched, failure_line
from trainer.rehearsal.limits import NOT_CHECKED_ON_CPU, gpu_only_keys
from trainer.rehearsal.recipe import rewrite_recipe
from trainer.rehearsal.run import Rehearsal
from trainer.training.arguments import DFlashTrainingArguments
from trainer.training.trainer import DFlash2Trainer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("dflash2")
FSDP2 = "examples/accelerate/fsdp2.yaml"
TARGETS = REPO / "tests" / "fixtures" / "targets"
ALL_CHECKS = (
    "config rules",
    "memory plan",
    "dataset + chat template",
    "regeneration",
    "two optimizer steps",
    "checkpoint",
    "resume",
    "export",
    "reload",
    "flex_attention forward",
)


def rehearse(tmp_path: Path, *argv: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    """The whole rehearsal has a deadline (each of its two launches has its own, 600 s): CI runs it
    beside other test processes on two cores, where it has taken up to three times its idle time."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), DFLASH2_CACHE=str(tmp_path / "cache"))
    return subprocess.run(
        [str(SCRIPT), "rehearse", *argv, "--output", str(tmp_path / "rehearsal")],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_lines(output: str) -> dict[str, str]:
    """Each check's line after `check <name>: `."""
    found = {}
    for line in output.splitlines():
        if line.startswith("check "):
            name, _, verdict = line[len("check ") :].partition(": ")
            found[name] = verdict
    return found


def assert_every_check_passed(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    checks = check_lines(result.stdout)
    assert list(checks) == list(ALL_CHECKS), checks
    assert all(verdict.startswith("ok") for verdict in checks.values()), checks
    # what only a GPU shows: the one list, each entry once, after the checks
    for limit in NOT_CHECKED_ON_CPU:
        assert result.stdout.count(f"not checked here: {limit.line()}") == 1
    return checks


def test_the_qwen3_8b_recipe_rehearses_on_two_fsdp2_ranks(tmp_path):
    result = rehearse(
        tmp_path,
        "examples/recipes/qwen3-8b-fsdp2.yaml",
        "--ranks",
        "2",
        "--accelerate-config",
        FSDP2,
        "--target",
        str(TARGETS / "qwen3-8b"),
    )
    checks = assert_every_check_passed(result)
    out = result.stdout
    assert "Qwen3ForCausalLM (qwen3), 36 layers, 32/8 heads, hidden 4096, vocab 151936" in out
    assert "num_attention_heads 32 -> 4, num_key_value_heads 8 -> 1; vocab kept (151936)" in out
    assert "tokenizer: stand-in (byte-level, ChatML template, 151936 tokens)" in out
    assert "data: stand-in: 64 chitchat-dataset conversations as 'messages'" in out
    assert "changed: attn_implementation flex_attention -> sdpa (torch has no CPU backward" in out
    assert "changed: accelerate num_processes 8 -> 2 (--ranks)" in out
    assert "gpu only: attn_implementation: flex_attention:" in out
    # kept as written: nothing about them is said
    for key in ("target_dtype", "target_sharding", "loss_chunk_blocks", "gradient_accumulation_steps", "seed"):
        assert f"changed: {key} " not in out
    assert "fits on 8 x 80.0 GiB" in checks["memory plan"]
    assert checks["two optimizer steps"].startswith("ok (FSDP2 on 2 gloo rank(s), bf16 (accelerate's mixed_precision)")
    assert "weights max |diff| 0.0e+00" in checks["resume"]
    rehearsal = yaml.safe_load((tmp_path / "rehearsal" / "recipe.yaml").read_text())
    assert (
        rehearsal["target_sharding"] == "fsdp"
        and rehearsal["num_anchors"] == 64
        and rehearsal["max_length"] == 128
        and rehearsal["max_steps"] == 2
    )


def prepared(tmp_path: Path, *argv: str) -> Rehearsal:
    """A rehearsal run in process up to its launch: the real sizes' checks and the tiny models, data
    and recipe (what `dflash2 rehearse` does before `accelerate launch`)."""
    rehearsal = Rehearsal(command.parse([*argv, "--output", str(tmp_path / "rehearsal")]))
    assert rehearsal.prepare()
    return rehearsal


def trained_losses(target: FrozenTarget, rows, draft_file: Path, output_dir: Path) -> list[float]:
    """Two optimizer steps of the tiny draft on `target` (its features captured online), their losses."""
    torch.manual_seed(0)
    draft = DFlash2DraftModel(DFlash2Config.from_json_file(draft_file))
    values = dict(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2, learning_rate=5e-3)
    values.update(logging_steps=1, save_strategy="no", num_anchors=8, report_to=[], use_cpu=True)
    trainer = DFlash2Trainer(
        model=draft,
        args=DFlashTrainingArguments(**values, dataloader_num_workers=0),
        target=target,
        train_dataset=rows,
        data_collator=DFlashCollator(target.require_tokenizer().pad_token_id),
    )
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_the_qwen3_6_27b_recipe_rehearses_its_hybrid_target(tmp_path, capsys, monkeypatch):
    """In process up to the launch: the hybrid architecture, its rewrite and its 141 GiB plan; then the
    tiny hybrid target (linear attention layers) captures for two real optimizer steps."""
    monkeypatch.chdir(REPO)
    argv = ["examples/recipes/qwen3.6-27b-fsdp2.yaml", "--ranks", "2", "--accelerate-config", FSDP2]
    rehearsal = prepared(tmp_path, *argv, "--target", str(TARGETS / "qwen3.6-27b"), "--gpu-memory-gb", "141")
    out = capsys.readouterr().out
    checks = check_lines(out)
    assert list(checks) == ["config rules", "memory plan"] and all(v.startswith("ok") for v in checks.values())
    assert "64 layers: 48 linear_attention + 16 full_attention, 24/4 heads" in out
    assert "linear_num_key_heads 16 -> 4, linear_num_value_heads 48 -> 12; vocab kept (248320)" in out
    assert "sliding_window 2048 -> 24" in out
    assert "fits on 8 x 141.0 GiB" in checks["memory plan"]
    assert "changed: accelerate num_processes 8 -> 2 (--ranks)" in out and rehearsal.fsdp
    workspace = tmp_path / "rehearsal"
    tiny = AutoConfig.from_pretrained(workspace / "target")
    assert tiny.layer_types == AutoConfig.from_pretrained(TARGETS / "qwen3.6-27b").layer_types
    target = FrozenTarget.load(str(workspace / "target"), dtype=torch.float32)
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
    chats = datasets.Dataset.from_json(str(workspace / "data.jsonl")).select(range(8))
    rows = truncate_and_filter(tokenize_conversations(target.require_tokenizer(), chats), 64)
    losses = trained_losses(target, rows, workspace / "draft.json", tmp_path / "run")
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses


def test_the_configure_starter_recipe_rehearses_packed_and_checkpointed(tmp_path, capsys, monkeypatch):
    """configure's GPU recipe (packing, activation checkpointing, no eval_num_anchors) prepared in
    process; its flex_attention forward runs on packed rows of the tiny target's own answers."""
    monkeypatch.chdir(REPO)
    folder = tmp_path / "starter"
    (folder / "qwen3-8b").mkdir(parents=True)
    shutil.copyfile(REPO / "tests/fixtures/target_configs/qwen3-8b.json", folder / "qwen3-8b" / "config.json")
    recipe = folder / "recipe.yaml"
    configure.main(
        [
            str(folder / "qwen3-8b"),
            "--num-draft-layers",
            "5",
            "--block-size",
            "16",
            "--mask-token-id",
            "151669",
            "--output",
            str(folder / "draft.json"),
            "--recipe",
            str(recipe),
            "--recipe-size",
            "gpu",
        ]
    )
    capsys.readouterr()
    rehearsal = prepared(tmp_path, str(recipe), "--accelerate-config", FSDP2)
    out = capsys.readouterr().out
    checks = check_lines(out)
    assert list(checks) == ["config rules", "memory plan"] and all(v.startswith("ok") for v in checks.values())
    workspace = tmp_path / "rehearsal"
    rehearsed = yaml.safe_load((workspace / "recipe.yaml").read_text())
    assert rehearsed["packing"] is True and rehearsed["activation_checkpointing"] is True
    # 8 micro-batches a step: 2 accumulate all the same, at a quarter of the CPU's forwards and backwards
    assert "changed: gradient_accumulation_steps 8 -> 2 (2 micro-batches a step accumulate as more do" in out
    assert rehearsed["gradient_accumulation_steps"] == 2 and rehearsed["num_train_samples"] == 4
    assert "changed: accelerate num_processes 8 -> 1 (--ranks)" in out and rehearsal.fsdp
    # what export writes for the flex check to load: the tiny draft (untrained: the kernels' gap is the check)
    DFlash2DraftModel(DFlash2Config.from_json_file(workspace / "draft.json")).save_pretrained(workspace / "export")
    assert rehearsal.checks.run("flex_attention forward", rehearsal.flex_forward)
    assert "packed rows" in check_lines(capsys.readouterr().out)["flex_attention forward"]


def test_a_packed_recipe_on_the_hybrid_target_fails_at_its_launch_with_the_rank_s_line(tmp_path, capsys, monkeypatch):
    """packing: true on Qwen3.6's linear-attention layers: the run refuses it once the target is
    loaded (the run's own check, on the rehearsal's tiny target), so the rehearsal's launch fails with
    that line and what needs a trained run is not checked; the memory plan of the packed rows fails too.
    The launch is the one piece not run here: it ends as that refusal's launch does (exit 1, the line in
    its log); the 8B rehearsal launches for real, and `failure_line` is proven below."""
    monkeypatch.chdir(REPO)
    recipe = yaml.safe_load((REPO / "examples/recipes/qwen3.6-27b-fsdp2.yaml").read_text())
    recipe.update(packing=True, target=str(TARGETS / "qwen3.6-27b"))
    (tmp_path / "packed.yaml").write_text(yaml.safe_dump(recipe))
    rehearsal = prepared(
        tmp_path, str(tmp_path / "packed.yaml"), "--accelerate-config", FSDP2, "--gpu-memory-gb", "141"
    )
    workspace = tmp_path / "rehearsal"
    target = FrozenTarget.load(str(workspace / "target"), dtype=torch.float32)
    layer_ids = DFlash2Config.from_json_file(workspace / "draft.json").dflash_settings.target_layer_ids
    with pytest.raises(ValueError) as refused:
        target.check_packing(layer_ids)  # what `trainer train` runs once the target is loaded
    assert str(refused.value).startswith("packing: true: Qwen3_5ForCausalLM lets packed")

    def refused_launch(accelerate_config, recipe, extra, log, deadline_s, fsdp):
        assert (accelerate_config, recipe, fsdp) == (rehearsal.accelerate_file, rehearsal.rehearsal_recipe, True)
        log.write_text(f"Loading weights\nerror: {refused.value}\nTraceback\nCalledProcessError: exit 1\n")
        return Launched(1, log, 1.0)

    monkeypatch.setattr(rehearsal_run, "launch", refused_launch)
    rehearsal.checks.run("dataset + chat template", rehearsal.data_check)
    rehearsal.launched_checks()
    assert rehearsal.finish() == 1
    out = capsys.readouterr().out
    checks = check_lines(out)
    assert checks["dataset + chat template"].startswith("ok")
    failed = checks["two optimizer steps"]
    assert failed.startswith("FAILED: the training launch failed: error: packing: true: Qwen3_5ForCausalLM lets packed")
    for name in ("checkpoint", "resume", "export", "reload", "flex_attention forward"):
        assert checks[name].startswith("not checked here: needs "), checks[name]
    # packed, a 4096-token row's worst case of block slots is far larger than 512: the plan says so too
    assert checks["memory plan"].startswith("FAILED: the real run does not fit: ")
    assert "rehearse: 2 passed, 2 failed" in out


def test_a_recipe_whose_draft_would_not_export_is_a_failed_check_and_exit_1(tmp_path, capsys):
    config = DFlash2Config.from_json_file(REPO / "hub_configs" / "qwen3-8b-dflash2.json").to_dict()
    config["dflash_config"]["selector_top_k"] = 1  # the selector needs 2 or more candidates (rule 8)
    (tmp_path / "draft.json").write_text(json.dumps(config))
    recipe = yaml.safe_load((REPO / "examples/recipes/qwen3-8b-fsdp2.yaml").read_text())
    recipe.update(draft_config=str(tmp_path / "draft.json"), target=str(TARGETS / "qwen3-8b"))
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as stop:
        run(command.main, [str(tmp_path / "recipe.yaml"), "--output", str(tmp_path / "rehearsal")])
    assert stop.value.code == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("check ")]
    assert len(failed) == 1 and failed[0].startswith("check config rules: FAILED: ")
    assert "selector_top_k" in failed[0]
    assert "rehearse: 0 passed, 1 failed" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.yaml"], "error: recipe missing.yaml does not exist"),
        (["recipe.txt"], "error: usage: dflash2 rehearse RECIPE"),
        (["examples/recipes/qwen3-8b-fsdp2.yaml", "--ranks", "0"], "error: --ranks must be >= 1 (got 0)"),
        (["examples/recipes/qwen3-8b-fsdp2.yaml", "--ranks", "two"], "error: argument --ranks: invalid int value"),
        (
            ["examples/recipes/qwen3-8b-fsdp2.yaml", "--accelerate-config", "nowhere.yaml"],
            "error: --accelerate-config: nowhere.yaml",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as stop:
        run(command.main, [*argv, "--output", str(tmp_path / "rehearsal")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_workspace_holding_other_files_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as stop:
        run(command.main, ["examples/recipes/qwen3-8b-fsdp2.yaml", "--output", str(tmp_path)])
    assert stop.value.code == 2
    assert "holds files of something other than a rehearsal" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------------------------
# The pieces
# ---------------------------------------------------------------------------------------------


def test_the_tiny_target_keeps_architecture_depth_ratios_head_sizes_and_vocab():
    real = AutoConfig.from_pretrained(TARGETS / "qwen3.6-27b")
    tiny, changes = tiny_target_config(real)
    assert type(tiny) is type(real) and tiny.layer_types == real.layer_types
    assert (tiny.num_hidden_layers, tiny.vocab_size, tiny.hidden_size) == (64, 248320, 64)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (6, 1)  # 24 : 4
    assert (tiny.linear_num_key_heads, tiny.linear_num_value_heads) == (4, 12)  # 16 : 48, and 24 / 4 = 6 / 1
    assert (tiny.head_dim, tiny.linear_key_head_dim, tiny.linear_value_head_dim) == (256, 128, 128)
    assert tiny.rope_parameters == real.rope_parameters and tiny.intermediate_size == 128
    assert changes[0] == "hidden_size 5120 -> 64"


def test_the_tiny_draft_keeps_every_dflash_setting_but_the_selector_rank():
    draft = DFlash2Config.from_json_file(REPO / "hub_configs" / "qwen3-8b-dflash2.json")
    values, changes = tiny_draft_values(draft, 64)
    real = draft.to_dict()["dflash_config"]
    assert {**values["dflash_config"], "selector_rank": real["selector_rank"]} == real
    assert values["dflash_config"]["selector_rank"] == 16
    assert values["layer_types"] == draft.layer_types and values["num_target_layers"] == 36
    assert (values["num_attention_heads"], values["num_key_value_heads"], values["head_dim"]) == (4, 1, 128)
    DFlash2Config(**values).dflash_settings  # noqa: B018  (valid)
    assert "dflash_config.selector_rank 256 -> 16" in changes


def test_the_stand_in_tokenizer_decodes_every_row_and_supervises_exactly_the_answer():
    tokenizer = stand_in_tokenizer(1000)
    assert len(tokenizer) == 1000 and tokenizer.decode([999]) == "<t999>"
    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi!"}]
    sample = tokenize_chat(tokenizer, messages)
    supervised = [token for token, mask in zip(sample["input_ids"], sample["loss_mask"], strict=True) if mask]
    assert tokenizer.decode(supervised) == "hi!<|im_end|>"
    assert (
        tokenizer.decode(sample["input_ids"])
        == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\nhi!<|im_end|>\n"
    )


def test_the_rewritten_recipe_changes_only_what_it_says(tmp_path):
    recipe = yaml.safe_load((REPO / "examples/recipes/qwen3-8b-fsdp2.yaml").read_text())
    rewrite = rewrite_recipe(
        recipe,
        world=2,
        workspace=tmp_path,
        target="T",
        draft_config="D",
        dataset="data.jsonl",
        dataset_note="stand-in",
        keep_endpoint=False,
    )
    said = {line.split()[1] for line in rewrite.changes}
    changed = {key for key in recipe.keys() | rewrite.values.keys() if recipe.get(key) != rewrite.values.get(key)}
    assert changed == said
    assert all(line.startswith("changed: ") and line.endswith(")") for line in rewrite.changes)
    assert "changed: num_train_samples 100000 -> 8 (enough for two steps)" in rewrite.changes
    kept = ("bf16", "target_dtype", "target_sharding", "packing", "loss_chunk_blocks", "dataloader_num_workers")
    assert all(rewrite.values.get(key) == recipe.get(key) for key in kept)


def test_a_long_gradient_accumulation_is_rehearsed_over_two_micro_batches(tmp_path):
    """Two micro-batches a step exercise accumulation as eight do; the six more would each be a
    forward and backward of every rehearsed step on a CPU (the starter recipe's 8 made its rehearsal
    twice the 8B recipe's)."""
    recipe = yaml.safe_load((REPO / "examples/recipes/qwen3-8b-fsdp2.yaml").read_text())
    recipe["gradient_accumulation_steps"] = 8
    common = dict(workspace=tmp_path, target="T", draft_config="D", dataset="d.jsonl", dataset_note="stand-in")
    rewrite = rewrite_recipe(recipe, world=1, keep_endpoint=False, **common)
    assert rewrite.values["gradient_accumulation_steps"] == 2 and rewrite.values["num_train_samples"] == 4
    assert [line for line in rewrite.changes if "gradient_accumulation_steps" in line] == [
        "changed: gradient_accumulation_steps 8 -> 2 (2 micro-batches a step accumulate as more do; each more "
        "costs a forward and backward on a CPU)"
    ]
    recipe["gradient_accumulation_steps"] = 2  # already short: kept, nothing said
    rewrite = rewrite_recipe(recipe, world=1, keep_endpoint=False, **common)
    assert rewrite.values["gradient_accumulation_steps"] == 2
    assert not any("gradient_accumulation_steps" in line for line in rewrite.changes)


def test_the_shortest_rows_are_kept_in_their_order():
    rows = [{"m": "x" * length} for length in (9, 1, 5, 3, 7)]
    assert shortest(rows, 3) == [{"m": "x"}, {"m": "xxxxx"}, {"m": "xxx"}]


def test_gpu_only_keys_are_listed():
    keys = gpu_only_keys({"attn_implementation": "flex_attention", "tf32": True, "optim": "adamw_bnb_8bit"})
    assert [key.key for key in keys] == ["attn_implementation", "tf32", "optim"]
    assert gpu_only_keys({"attn_implementation": "sdpa", "bf16": True}) == []


def test_a_failed_launch_shows_a_rank_s_own_line():
    log = "noise\n[rank1]: error: dataset x row 3: message 0 has no 'role'\nTraceback\nChildFailedError: boom\n"
    assert failure_line(log) == "[rank1]: error: dataset x row 3: message 0 has no 'role'"
    log = "Traceback (most recent call last):\n  File x\nRuntimeError: gloo timed out\ntorch.distributed.elastic...\n"
    assert failure_line(log) == "RuntimeError: gloo timed out"


@pytest.mark.parametrize(
    ("flags", "verdict"),
    [
        ([], "not checked here: no accelerate config (given, or accelerate's default), so the launch is unknown"),
        (["--accelerate-config", FSDP2, "--gpu-memory-gb", "40"], "FAILED: the real run does not fit: "),
        (["--accelerate-config", FSDP2], "ok ("),
    ],
)
def test_the_memory_plan_fails_only_against_a_known_launch(flags, verdict, tmp_path, monkeypatch, capsys):
    """Without an accelerate config the GPU launch is unknown: one GPU is a guess, so not fitting
    there is said, not failed; against the given config and GPU size it is a real verdict."""
    monkeypatch.setattr(rehearsal_run, "default_accelerate_config", lambda: None)
    recipe = "examples/recipes/qwen3-8b-fsdp2.yaml"
    argv = [recipe, "--target", str(TARGETS / "qwen3-8b"), "--output", str(tmp_path / "rehearsal"), *flags]
    rehearsal = Rehearsal(command.parse(argv))
    rehearsal.read_target()
    rehearsal.checks.run("memory plan", rehearsal.memory_plan)
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check memory plan: ")]
    assert len(line) == 1 and line[0].startswith(f"check memory plan: {verdict}"), line

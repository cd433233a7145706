"""`make compare` (benchmarks/compare.py): the recipes as training flags, the v1 draft config, the numbers read
back from a finished run, the table, and resuming where a comparison stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import compare as compare_recipes
from modeling_dflash2 import DFlash2Config, DFlashDraftModel
from trainer.training.arguments import parse_arguments


def test_v1_config_is_the_same_draft_without_conv_and_selector():
    dflash2 = json.loads(compare_recipes.DRAFT_CONFIG.read_text())
    config = DFlash2Config(**compare_recipes.v1_config(dflash2))
    assert not config.is_dflash2
    settings = config.dflash_settings
    assert (settings.conv_kernel_size, settings.selector_top_k) == (None, None)
    assert settings.block_size == dflash2["dflash_config"]["block_size"]
    assert list(settings.target_layer_ids) == dflash2["dflash_config"]["target_layer_ids"]
    assert config.num_hidden_layers == dflash2["num_hidden_layers"]
    assert "selector_rank" in dflash2["dflash_config"]  # the source is left untouched
    assert not hasattr(DFlashDraftModel(config), "candidate_selector")


@pytest.mark.parametrize(
    ("recipe", "loss_type", "kd_weight"),
    [("dflash-ce", "ce", 0.0), ("dflash2-ce", "ce", 0.0), ("dflash2-kd", "kd", 1.0), ("dflash2-ce+kd", "ce", 0.5)],
)
def test_each_recipe_is_the_default_recipe_with_its_own_objective(tmp_path, recipe, loss_type, kd_weight):
    command = compare_recipes.train_command(recipe, 2, tmp_path / "run", tmp_path / "draft.json")
    model_args, data_args, training_args = parse_arguments(command[len(compare_recipes.dflash2("train")) :])
    objective = training_args.objective_config()
    assert (objective.loss_type, objective.resolved_kd_weight) == (loss_type, kd_weight)
    assert (training_args.seed, training_args.max_steps, objective.num_anchors) == (2, 300, 16)
    assert training_args.eval_strategy == "no" and training_args.save_strategy == "no"
    assert (data_args.num_train_samples, data_args.dataset) == (256, "chitchat")
    assert model_args.draft_config == str(tmp_path / "draft.json")


STAGES = ("train", "heldout", "humaneval")


def write_finished_run(run_dir: Path, *, walk: bool = True, lossless: bool = True, stages=STAGES) -> None:
    """What `dflash2 train` and `dflash2 evaluate` leave in a run directory (for the given stages)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if "train" in stages:
        trained = {"eval_tau_unary": 2.5, **({"eval_tau_walk": 2.75} if walk else {})}
        history = [
            {"eval_loss": 9.0, "eval_tau_unary": 1.0, "eval_runtime": 10.0, "step": 0},
            {"train_runtime": 310.0, "step": 300},
            {"eval_loss": 3.0, **trained, "eval_runtime": 12.0, "step": 300},
        ]
        (run_dir / "trainer_state.json").write_text(json.dumps({"global_step": 300, "log_history": history}))
    served = "trained/selector" if walk else "trained/unary"
    for benchmark, tau in (("heldout", 2.0), ("humaneval", 1.25)):
        if benchmark not in stages:
            continue
        paths = {"trained/unary": {"mean_tau": tau - 0.125}, served: {"mean_tau": tau}}
        report = run_dir / "speculative" / benchmark / "speculative_report.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({"paths": paths, "lossless": lossless}))


def test_run_numbers_read_back_by_hand(tmp_path):
    write_finished_run(tmp_path / "dflash2")
    numbers = compare_recipes.run_numbers(tmp_path / "dflash2")
    assert numbers == {
        "seconds_per_step": 1.0,  # (310 s - the 10 s evaluation at step 0) / 300 steps
        "teacher_forced_tau": 2.75,
        "teacher_forced_tau_unary": 2.5,
        "heldout_tau": 2.0,
        "heldout_tau_unary": 1.875,
        "humaneval_tau": 1.25,
    }
    write_finished_run(tmp_path / "v1", walk=False)  # no selector: the unary path is the served one
    numbers = compare_recipes.run_numbers(tmp_path / "v1")
    assert numbers["teacher_forced_tau"] == 2.5 and numbers["heldout_tau"] == numbers["heldout_tau_unary"] == 2.0
    write_finished_run(tmp_path / "lossy", lossless=False)
    with pytest.raises(RuntimeError, match="did not reproduce"):
        compare_recipes.run_numbers(tmp_path / "lossy")


def test_table_mean_and_sample_spread_by_hand():
    runs = {
        seed: {key: value for key, _ in compare_recipes.COLUMNS}
        for seed, value in zip((0, 1, 2), (2.0, 2.2, 2.4), strict=True)
    }
    table = compare_recipes.aggregate({"dflash2-ce": runs, "one-seed": {0: runs[0]}})
    assert table["dflash2-ce"]["heldout_tau"]["mean"] == pytest.approx(2.2)
    assert table["dflash2-ce"]["heldout_tau"]["spread"] == pytest.approx(0.2)  # sample standard deviation
    assert table["one-seed"]["heldout_tau"] == {"mean": 2.0, "spread": 0.0}
    markdown = compare_recipes.render_table(table)
    assert "| dflash2-ce | 3 | 2.200 ± 0.200 |" in markdown and "| one-seed | 1 | 2.000 ± 0.000 |" in markdown


def test_a_comparison_resumes_without_repeating_finished_stages(tmp_path, monkeypatch):
    """Training and each evaluation run once; a second comparison reuses the recorded numbers."""
    commands = []

    def fake_run(command, check):
        commands.append(command)
        if "--draft" in command:  # evaluate.py: its benchmark's report
            run_dir, stage = Path(command[command.index("--draft") + 1]), command[command.index("--benchmark") + 1]
        else:
            run_dir, stage = Path(command[command.index("--output_dir") + 1]), "train"
        write_finished_run(run_dir, stages=(stage,))

    monkeypatch.setattr(compare_recipes.subprocess, "run", fake_run)
    output = tmp_path / "compare"
    write_finished_run(output / "dflash2-kd" / "seed-1", stages=("train",))  # seed 1 stopped after training
    table = compare_recipes.main(["--recipes", "dflash2-kd", "--seeds", "0", "1", "--output", str(output)])
    assert len(commands) == 5 and sum(1 for command in commands if "--draft" not in command) == 1
    assert table["dflash2-kd"]["seeds"] == [0, 1] and compare_recipes.comparison_file(output, "md").exists()
    compare_recipes.main(["--recipes", "dflash2-kd", "--seeds", "0", "1", "--output", str(output)])
    assert len(commands) == 5
    saved = json.loads(compare_recipes.comparison_file(output, "json").read_text())
    assert saved["runs"]["dflash2-kd"]["1"]["heldout_tau"] == 2.0


def test_the_default_changes_only_beyond_the_seed_spread():
    """2.5 ± 0.1 against 2.2 ± 0.1 wins (0.3 > 0.2); 2.35 ± 0.1 does not (0.15 <= 0.2)."""

    def row(mean, spread):
        return {compare_recipes.DECIDING_FIGURE: {"mean": mean, "spread": spread}}

    default = row(2.2, 0.1)
    assert compare_recipes.beats_beyond_spread(row(2.5, 0.1), default)
    assert not compare_recipes.beats_beyond_spread(row(2.35, 0.1), default)
    assert not compare_recipes.beats_beyond_spread(row(1.9, 0.0), default)
    name = compare_recipes.DEFAULT_RECIPE
    lines = compare_recipes.verdict({name: default, "dflash2-kd": row(2.5, 0.1), "dflash-ce": row(2.35, 0.1)})
    assert f"- dflash2-kd beats {name} beyond the seed spread on held-out τ (+0.300" in lines
    assert f"- dflash-ce does not beat {name} beyond the seed spread on held-out τ (+0.150" in lines


def test_the_default_recipe_is_what_the_base_recipe_trains():
    """The recipe the verdict judges against trains the base recipe's own objective and draft: the
    embedded default (`make demo`, train.py with no arguments) and the comparison cannot drift apart."""
    _, _, base = parse_arguments([str(compare_recipes.BASE_RECIPE)])
    default = compare_recipes.DEFAULT_RECIPE
    command = compare_recipes.train_command(default, 0, Path("run"), compare_recipes.DRAFT_CONFIG)
    _, _, training_args = parse_arguments(command[len(compare_recipes.dflash2("train")) :])
    assert training_args.objective_config() == base.objective_config()
    assert base.objective_config().distills == compare_recipes.RECIPES[default]["distills"]
    assert not compare_recipes.RECIPES[default]["v1"]


@pytest.mark.slow
def test_step_cost_of_each_recipe():
    """At the demo's step shape: v1 saves the convs and the selector (a little), distillation adds
    one LM-head forward (the teacher's logits), whatever its weight."""
    cost = {recipe: compare_recipes.step_gflops(recipe) for recipe in compare_recipes.RECIPES}
    assert cost["dflash-ce"] < cost["dflash2-ce"] < 1.05 * cost["dflash-ce"]
    assert cost["dflash2-kd"] == cost["dflash2-ce+kd"]
    # 4 rows x 16 anchors x 7 scored slots, H = 576, V = 49152
    assert cost["dflash2-kd"] - cost["dflash2-ce"] == pytest.approx(2 * 4 * 16 * 7 * 576 * 49152 / 1e9)

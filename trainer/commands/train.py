"""`dflash2 train RECIPE [--key value ...]`: train a DFlash2 draft on a recipe.

With no arguments it runs the embedded default recipe (examples/recipes/smollm2-135m-chitchat.yaml):
SmolLM2-135M-Instruct as the target, chitchat prompts answered by the target, CPU-sized settings.
On several GPUs: `accelerate launch --config_file examples/accelerate/fsdp2.yaml -m trainer train
RECIPE`. SIGTERM / SIGINT save a checkpoint and exit with 128 + the signal;
`--resume_from_checkpoint true` continues from the newest complete checkpoint.
`--debug` shows tracebacks of user errors. `--help` lists every recipe key.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

from transformers import HfArgumentParser

from trainer.evaluation.report import SUMMARY_KEYS, run_summary
from trainer.models.draft import check_attention_for_training
from trainer.recipe_files import DEFAULT_RECIPE
from trainer.training.arguments import ARGUMENT_CLASSES, parse_arguments
from trainer.training.distributed import adopt_cpu_ranks
from trainer.training.output_dir import check_output_dir
from trainer.training.run import check_output_sources, run_folder_lock, train_run


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train on the recipe (or the embedded default) and return the final held-out metrics."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_recipe_help("dflash2 train", __doc__)
    model_args, data_args, training_args = parse_arguments(argv, DEFAULT_RECIPE)
    adopt_cpu_ranks(training_args)  # several processes, no GPU, no use_cpu: CPU ranks, before the rank-0 lock
    check_attention_for_training(model_args.attn_implementation, training_args.device)  # flex: no CPU backward
    check_output_sources(model_args, data_args, training_args)  # before the lock creates output_dir
    with run_folder_lock(training_args):
        if training_args.process_index == 0:  # the lock holder: nobody else can add results meanwhile
            check_output_dir(
                Path(training_args.output_dir),
                training_args.resume_from_checkpoint,
                training_args.overwrite_output_dir,
            )
        metrics = train_run(model_args, data_args, training_args)
        if training_args.process_index == 0:  # the rank that wrote trainer_state.json
            print_summary(Path(training_args.output_dir))
    return metrics


def print_recipe_help(prog: str, doc: str | None) -> NoReturn:
    """A recipe command's `--help`: its docstring, then every recipe key (the fields of the argument
    dataclasses, as HfArgumentParser lists them), each also accepted as a `--key value` flag."""
    print(doc)
    HfArgumentParser(ARGUMENT_CLASSES, prog=prog, usage=f"{prog} [RECIPE.yaml] [--key value ...]").print_help()  # type: ignore[arg-type]  # (DataClassType is a Protocol)
    raise SystemExit(0)


def print_summary(output_dir: Path) -> None:
    """The held-out metrics before and after training, as the run's trainer_state.json records them."""
    summary = run_summary(output_dir) or {"untrained": {}, "trained": {}}
    print(f"\nDraft checkpoint: {output_dir.resolve()}")
    print("Held-out teacher-forced metrics (eval anchors at every valid position):")
    print(f"  {'metric':<24}{'untrained':>12}{'trained':>12}")
    for key in SUMMARY_KEYS:
        if key in summary["trained"]:
            before = summary["untrained"].get(key, float("nan"))
            print(f"  {key[5:]:<24}{before:>12.4f}{summary['trained'][key]:>12.4f}")
    print("  tau_unary: acceptance length of the unary argmax; tau_walk: of the selector's own greedy walk.")

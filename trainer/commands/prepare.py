"""`dflash2 prepare RECIPE [--regenerate-only] [--key value ...]`: a recipe's datasets ahead of training.

Runs the target once to answer the prompts (`regenerate`, in process or through
`regenerate_endpoint`) and, with `offline: true`, to capture its hidden states into the cache;
`dflash2 train` with the same recipe then reuses both instead of recomputing them (e.g. a CPU or a
separate GPU job prepares, the training job only reads).

`--regenerate-only` stops after the answers. Through endpoints (`regenerate_endpoint`, and
`feature_endpoint` for the features) only the target's tokenizer and config are loaded, so a
machine without GPUs can drive a vLLM / SGLang fleet for days, resumably.
"""

from __future__ import annotations

import logging
import sys

import torch

from trainer.commands.train import print_recipe_help
from trainer.data.dataset import build_datasets, token_datasets
from trainer.data.online_features import streams_engine_features
from trainer.models.target import FrozenTarget, TargetTokenizer
from trainer.plan.fit_check import check_target_fits
from trainer.publishing.draft_gate import load_draft_config
from trainer.recipe_files import DEFAULT_RECIPE
from trainer.training.arguments import parse_arguments

REGENERATE_ONLY = "--regenerate-only"
REGENERATE_ONLY_HELP = f"  {REGENERATE_ONLY}  stop after the answers (the recipe must set regenerate: true)"


def runs_target_here(data_args, regenerate_only: bool) -> bool:
    """Whether a step runs the target in this process: regenerating without an endpoint, or
    capturing features without a feature_endpoint."""
    answers_here = data_args.regenerate and not data_args.regenerate_endpoint
    captures_here = not regenerate_only and data_args.offline and not data_args.feature_endpoint
    return bool(answers_here or captures_here)


def load_target(model_args, data_args, regenerate_only: bool) -> FrozenTarget | TargetTokenizer:
    """The target's weights only where a step runs it here; otherwise its tokenizer and config alone."""
    if not runs_target_here(data_args, regenerate_only):
        return TargetTokenizer.load(model_args.target, model_args.target_gguf_file)
    return FrozenTarget.load(
        model_args.target, model_args.target_gguf_file, dtype=getattr(torch, model_args.target_dtype)
    )


def main(argv: list[str] | None = None) -> None:
    """Answer the prompts and capture the features the recipe asks for, into its cache."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_recipe_help("dflash2 prepare", f"{__doc__}\n{REGENERATE_ONLY_HELP}\n")
    regenerate_only = REGENERATE_ONLY in argv
    argv = [flag for flag in argv if flag != REGENERATE_ONLY]
    model_args, data_args, training_args = parse_arguments(argv, DEFAULT_RECIPE)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if regenerate_only and not data_args.regenerate:
        raise ValueError(f"{REGENERATE_ONLY}: the recipe does not regenerate (regenerate: false)")
    # the draft's config (draft_config, or init_from's config.json) names the layers to capture: read
    # before the target runs, so a bad one stops here rather than after the answers
    config = None if regenerate_only else load_draft_config(model_args, building=False)
    if runs_target_here(data_args, regenerate_only):  # weights the planner says cannot fit are refused first
        check_target_fits(model_args, data_args, training_args)
    target = load_target(model_args, data_args, regenerate_only)
    if config is None:  # regenerate_only, the one case that reads no draft config
        train, evaluation = token_datasets(data_args, target)
        print(f"regenerated {len(train)} training and {len(evaluation) if evaluation else 0} evaluation samples")
        return
    if streams_engine_features(data_args):  # nothing is stored: the servers answer while training
        train, evaluation = token_datasets(data_args, target)
        print(
            f"prepared {len(train)} training and {len(evaluation) if evaluation else 0} evaluation samples; their "
            "features are streamed from feature_endpoint while training (offline: false)"
        )
        return
    distills = training_args.objective_config().distills  # distillation also stores final hidden states
    train, evaluation = build_datasets(data_args, target, config.target_layer_ids, final_hidden=distills)
    print(f"prepared {len(train)} training and {len(evaluation) if evaluation else 0} evaluation samples")

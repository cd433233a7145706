"""Build a recipe's datasets ahead of training: `python examples/prepare.py recipe.yaml [--key value ...]`.

Runs the target once to answer the prompts (`regenerate`) and, with `offline: true`, to capture its
hidden states into the cache; `train.py` with the same recipe then reuses both instead of
recomputing them (e.g. a CPU or a separate GPU job prepares, the training job only reads).
"""

from __future__ import annotations

import logging
import sys

import torch

from examples.train import DEFAULT_RECIPE, resolve_path
from modeling_dflash2 import DFlash2Config
from trainer.arguments import parse_arguments
from trainer.cli import run
from trainer.data import build_datasets
from trainer.target import FrozenTarget


def main(argv: list[str] | None = None) -> None:
    model_args, data_args, training_args = parse_arguments(sys.argv[1:] if argv is None else argv, DEFAULT_RECIPE)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    target = FrozenTarget.load(
        model_args.target, model_args.target_gguf_file, dtype=getattr(torch, model_args.target_dtype)
    )
    config = DFlash2Config.from_json_file(resolve_path(model_args.draft_config))
    distills = training_args.objective_config().distills  # distillation also stores final hidden states
    train, evaluation = build_datasets(data_args, target, config.target_layer_ids, final_hidden=distills)
    print(f"prepared {len(train)} training and {len(evaluation) if evaluation else 0} evaluation samples")


if __name__ == "__main__":
    run(main)

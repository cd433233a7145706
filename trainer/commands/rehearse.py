"""Run a recipe on this machine the way its GPU run will, before any GPU is rented.

dflash2 rehearse RECIPE [--ranks N] [--accelerate-config FILE] [--target DIR] [--output DIR]
    [--gpu-memory-gb G] [--timeout-s S]

The same target and draft architectures at a tiny width (random weights, same layer types, head
ratios and head sizes, vocabulary kept), the recipe's own dataset and chat template on its first
rows (a local stand-in when the Hub is unreachable), every other recipe key kept, bf16 and FSDP2 as
the accelerate config says, on N CPU ranks launched with `accelerate launch`: two optimizer steps, a
checkpoint, a resume from step 1, an export with its contract validation and a reload; plus the
config rules and the memory plan for the real sizes, and flex_attention's forward against sdpa.
Each check prints one line (ok, FAILED, or not checked here), then what only a GPU can show.
Exit status: 0 every check that can run here passed, 1 one failed, 2 bad input.

--target DIR overrides the recipe's target (a folder holding its config.json is enough, as for
`dflash2 plan`). --output DIR is the rehearsal's workspace (default: rehearsals/<recipe name> under
the recipe's cache); an earlier rehearsal there is replaced.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from trainer.commands.runner import command_parser
from trainer.rehearsal.run import DEFAULT_TIMEOUT_S, Rehearsal, say

USAGE = "dflash2 rehearse RECIPE [--ranks N] [--accelerate-config FILE] [--target DIR] [--output DIR]"


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("dflash2 rehearse", __doc__)
    parser.add_argument("recipe", help="the recipe .yaml to rehearse")
    parser.add_argument("--ranks", type=int, default=1, help="CPU ranks to launch (default 1)")
    parser.add_argument("--accelerate-config", default=None, help="the accelerate config the GPU run is launched with")
    parser.add_argument("--target", default=None, help="the target (a folder with its config.json is enough)")
    parser.add_argument("--output", default=None, help="the rehearsal's workspace (default: under the cache)")
    parser.add_argument(
        "--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU for the plan, GiB (default 80)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="deadline of each training launch (default 600)"
    )
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments, each refused in one line naming it."""
    args = _parser().parse_args(argv)
    if not args.recipe.endswith((".yaml", ".yml")):
        raise ValueError(f"usage: {USAGE} (the first argument must be a recipe .yaml, got {args.recipe!r})")
    if args.ranks < 1:
        raise ValueError(f"--ranks must be >= 1 (got {args.ranks})")
    if not args.timeout_s > 0:
        raise ValueError(f"--timeout-s must be > 0 seconds (got {args.timeout_s:g})")
    if not args.gpu_memory_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be > 0 (got {args.gpu_memory_gb:g})")
    return args


def main(argv: list[str] | None = None) -> int:
    """Rehearse the recipe; exit 1 when a check failed (bad input is a user error: 2)."""
    args = parse(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    rehearsal = Rehearsal(args)
    say(f"rehearse {args.recipe} on {args.ranks} CPU rank(s); workspace {rehearsal.workspace}")
    status = rehearsal.run()
    say(f"wall time {time.perf_counter() - started:.0f} s")
    if status:
        raise SystemExit(status)
    return status

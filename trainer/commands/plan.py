"""Per-rank memory of a training run, from the recipe and the two model configs alone.

`dflash2 plan RECIPE [--num-gpus N] [--gpu-memory-gb G] [--accelerate-config FILE] [--json]
[--key value ...]` reads the recipe (the `--key value` flags override it, as in `dflash2 train`),
the draft config (`draft_config`, or `init_from`'s config.json) and the target's config.json (a
directory holding it, a Hub id: only config.json is fetched, or the cached conversion of a GGUF
target). Both models are built on the meta device to count their parameters exactly; no weight is
loaded. It prints the memory of one rank by part, whether it fits, and the largest micro-batch that
does. docs/planning.md derives every formula; in short, per rank:

    per_rank = target_weights + draft_weights + draft_gradients + optimizer_states
               + activations + loss_head + other

Precision and draft sharding come from the recipe (`bf16`/`fp16`, `fsdp` + `fsdp_config`) or from
an accelerate config (`--accelerate-config`, what `accelerate launch --config_file` would apply:
`mixed_precision`, `distributed_type: FSDP`, `fsdp_config`, `num_processes`).
"""

from __future__ import annotations

import argparse
import json
import sys

from trainer.commands.runner import command_parser
from trainer.plan.facts import GIB, accelerate_world_size, read_accelerate_config
from trainer.plan.memory import MemoryPlan, plan_run
from trainer.training.arguments import parse_arguments

USAGE = "dflash2 plan RECIPE [--num-gpus N] [--gpu-memory-gb G] [--accelerate-config FILE] [--json] [--key value ...]"


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("dflash2 plan", __doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--num-gpus", type=int, default=None, help="ranks (default: the accelerate config's, or 1)")
    parser.add_argument(
        "--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GiB, 2^30 bytes (default 80)"
    )
    parser.add_argument("--accelerate-config", default=None, help="an accelerate config file the run is launched with")
    parser.add_argument("--json", action="store_true", help="print only the JSON plan")
    return parser


def main(argv: list[str] | None = None) -> MemoryPlan:
    """Plan the recipe's run and print the plan (a table, or with `--json` only the JSON object)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # anywhere, as in every other command
        print(__doc__)
        _parser().print_help()
        raise SystemExit(0)
    if not argv or not argv[0].endswith((".yaml", ".yml")):
        raise ValueError(f"usage: {USAGE} (the first argument must be a recipe .yaml)")
    options, overrides = _parser().parse_known_args(argv[1:])
    accelerate = read_accelerate_config(options.accelerate_config) if options.accelerate_config else None
    num_gpus = options.num_gpus if options.num_gpus is not None else accelerate_world_size(accelerate or {})
    model_args, data_args, training_args = parse_arguments([argv[0], *overrides])
    plan = plan_run(model_args, data_args, training_args, num_gpus, int(options.gpu_memory_gb * GIB), accelerate)
    print(json.dumps(plan.as_json(), indent=2) if options.json else plan.describe())
    return plan

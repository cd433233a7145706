"""How many ATen ops one training step launches, by phase (torch.profiler, CPU, one thread).

On a GPU every op is at least one kernel launch (~5-10 us of launch overhead each), so the count
bounds the step time from below whatever the shapes. Counted as the profiler's `aten::` events,
nested ones included (a composite op and the ops it dispatches to), over one step after a warm-up:
`draft_forward` is the draft's layers (and the batch preparation of `draft_objective`),
`objective` the LM head, losses and metrics (`trainer.objective.loss.OBJECTIVE_LABEL`), `backward`
everything `loss.backward()` runs.

python -m benchmarks.op_count [--setup smollm2|large|tiny] prints both counts as JSON.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import setups
from benchmarks.train_step import optimized_step
from modeling_dflash2 import DFlash2Config
from trainer.commands.runner import command_parser, run
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import OBJECTIVE_LABEL

STEP_LABEL = "benchmark::step"
BACKWARD_LABEL = "benchmark::backward"


def _inside(event, label: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == label:
            return True
        parent = parent.cpu_parent
    return False


def count_step_ops(setup: setups.StepSetup, device: str = "cpu", threads: int = 1) -> dict[str, int]:
    """{"total", "draft_forward", "objective", "backward"} aten op counts of one step at `setup`."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        draft = setups.make_draft(setup, device).train()
        batch = setups.synthetic_batch(setup, device)
        config = ObjectiveConfig(num_anchors=setup.anchors, chunk_blocks=setup.chunk_blocks)
        optimized_step(draft, batch, config)  # warm-up: lazy initialisation is not a per-step cost
        with profile(activities=[ProfilerActivity.CPU]) as profiler, record_function(STEP_LABEL):
            optimized_step(draft, batch, config, backward_label=BACKWARD_LABEL)
    finally:
        torch.set_num_threads(previous_threads)
    events = [event for event in profiler.events() if event.name.startswith("aten::")]
    backward = sum(_inside(event, BACKWARD_LABEL) for event in events)
    objective = sum(_inside(event, OBJECTIVE_LABEL) for event in events)
    return {
        "total": len(events),
        "draft_forward": len(events) - backward - objective,
        "objective": objective,
        "backward": backward,
    }


def v1_setup(setup: setups.StepSetup) -> setups.StepSetup:
    """The same shape as a DFlash v1 draft: no convolutions, no selector."""
    values = setup.config.to_dict()
    values["architectures"] = ["DFlashDraftModel"]
    keep = ("block_size", "mask_token_id", "target_layer_ids")
    values["dflash_config"] = {key: value for key, value in values["dflash_config"].items() if key in keep}
    return dataclasses.replace(setup, name=f"{setup.name} (DFlash v1)", config=DFlash2Config(**values))


def op_counts(setup: setups.StepSetup | None = None, device: str = "cpu") -> dict[str, dict[str, int]]:
    """DFlash2 and DFlash v1 counts at the same shape (default: the demo's SmolLM2 step)."""
    setup = setup or setups.smollm2_setup()
    return {"dflash2": count_step_ops(setup, device), "dflash_v1": count_step_ops(v1_setup(setup), device)}


SETUPS = {"smollm2": setups.smollm2_setup, "large": setups.large_setup, "tiny": setups.tiny_setup}


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    parser = command_parser("python -m benchmarks.op_count", __doc__)
    parser.add_argument("--setup", choices=tuple(SETUPS), default="smollm2")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    counts = op_counts(SETUPS[args.setup](), args.device)
    print(json.dumps(counts, indent=2))
    return counts


if __name__ == "__main__":
    run(main)

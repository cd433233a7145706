"""Test-only: the tiny recipe with online capture, trained twice at one seed on 2 CPU ranks (gloo):
`target_sharding: none`, then `fsdp`. Each rank writes `result_RANK.json` with, per mode, the log
history, its number of capture calls, and the bytes of the target's decoder-layer parameters it
holds after training and the final evaluation. One process group serves both runs (the first
run's trainer lets go of its DDP wrapper but leaves the group open), so the test pays for one launch.
Usage: torchrun --nproc_per_node 2 tests/support/distributed/target_sharding_cpu.py OUTPUT_ROOT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import trainer.training.run as train_script
from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.commands import train as train_command
from trainer.training.distributed import close_process_group
from trainer.training.trainer import DFlash2Trainer

TRAINERS: list[DFlash2Trainer] = []


class RecordedTrainer(DFlash2Trainer):
    """Kept for inspection after `main` returns; counts the target's capture calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        TRAINERS.append(self)
        self.captures = 0
        capture = self.target.capture

        def counted(*capture_args, **capture_kwargs):
            self.captures += 1
            return capture(*capture_args, **capture_kwargs)

        self.target.capture = counted


def release_keeping_the_group(trainer: DFlash2Trainer) -> None:
    """close_process_group without its last step: the second run needs the group."""
    trainer.accelerator.wait_for_everyone()
    trainer.model_wrapped = trainer.model
    trainer.accelerator.free_memory()


if __name__ == "__main__":
    root = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    if rank == 0:
        write_tiny_run(root, offline=False, max_steps=3, save_steps=100, spec_eval_prompts=0)
        (root / "ready").write_text("1")
    while not (root / "ready").exists():
        time.sleep(0.1)
    train_script.DFlash2Trainer = RecordedTrainer
    results = {}
    for mode in ("none", "fsdp"):
        train_script.close_process_group = release_keeping_the_group if mode == "none" else close_process_group
        output = root / f"output-{mode}"
        train_command.main([str(root / "recipe.yaml"), "--target_sharding", mode, "--output_dir", str(output)])
        trainer = TRAINERS.pop()
        local, whole = trainer.target.decoder_layer_bytes()
        results[mode] = {
            "log_history": trainer.state.log_history,
            "sharded": trainer.target.sharded,
            "captures": trainer.captures,
            "local_bytes": local,
            "whole_bytes": whole,
        }
        del trainer
    (root / f"result_{rank}.json").write_text(json.dumps(results))

"""Test-only: run DFlash2Trainer through accelerate's real FSDP2 path on CPU (gloo), 2 ranks.

accelerate enables FSDP only for GPU-like devices; the product's CPU FSDP2 mode
(`trainer.training.cpu_fsdp`, `DFLASH2_FSDP2_ON_CPU=1`) forces it. This exercises fully_shard
wrapping per decoder layer, the class swap, training, evaluation, cross-rank metrics and saving.
Usage: torchrun --nproc_per_node 2 tests/support/distributed/fsdp2_cpu.py OUTPUT_ROOT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.commands.train import main
from trainer.training.cpu_fsdp import FSDP2_ON_CPU_ENV
from trainer.training.trainer import DFlash2Trainer


class ForcedFSDP2Trainer(DFlash2Trainer):
    """DFlash2Trainer in the CPU FSDP2 mode (kept for the scripts that swap it in): the variable is
    set before the accelerator is created, as `dflash2 rehearse` sets it before launching."""

    def create_accelerator_and_postprocess(self) -> None:
        os.environ[FSDP2_ON_CPU_ENV] = "1"
        super().create_accelerator_and_postprocess()


if __name__ == "__main__":
    root = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    recipe = root / "recipe.yaml"
    if rank == 0:
        write_tiny_run(
            root,
            fsdp="full_shard",
            fsdp_config={
                "version": 2,
                "transformer_layer_cls_to_wrap": ["DFlash2DecoderLayer"],
                "state_dict_type": "SHARDED_STATE_DICT",
                "reshard_after_forward": True,
            },
        )
        (root / "ready").write_text("1")
    while not (root / "ready").exists():
        time.sleep(0.1)
    import trainer.training.run as train_script

    train_script.DFlash2Trainer = ForcedFSDP2Trainer
    metrics = main([str(recipe)])
    if rank == 0:
        (root / "metrics.json").write_text(json.dumps(metrics))

"""Test-only: run DFlash2Trainer through accelerate's real FSDP2 path on CPU (gloo), 2 ranks.

accelerate enables FSDP only for GPU-like devices, so this forces the accelerator state to FSDP
after creation. It exercises fully_shard wrapping per decoder layer, the
class swap, training, evaluation, cross-rank metrics and saving; not a supported setup.
Usage: torchrun --nproc_per_node 2 tests/distributed/fsdp2_cpu.py OUTPUT_ROOT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.tiny_setup import write_tiny_run
from trainer.training import trainer as trainer_module
from trainer.training.run import main


class ForcedFSDP2Trainer(trainer_module.DFlash2Trainer):
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.is_fsdp_enabled = True


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

"""Test-only: a bf16 FSDP2 run on 2 CPU ranks (gloo) that records, inside the draft's forward, the
objective's own float32 sums of every micro-batch, so the test can pool them by hand and compare
with what the trainer logged (tests/integration/test_pooling_precision.py).

The FSDP2 policy is accelerate's for `bf16: true` (parameters gathered in bf16: the draft's per-token
terms are bf16-derived); FSDP2 runs on the CPU ranks by the product's own switch, `DFLASH2_FSDP2_ON_CPU=1`
(`trainer.training.cpu_fsdp`).
Each rank writes `captures_<rank>.json`: per objective call its mode, the log it will land in (the
length of `log_history` when it ran), the dtype of the hidden states the objective saw, the float32
sums as the objective formed them, what came back out of the FSDP2-wrapped forward, and (training)
the step's global denominator.
Usage: torchrun --nproc_per_node 2 tests/support/distributed/pooling_bf16_cpu.py OUTPUT_ROOT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import trainer.objective.loss as loss_module
from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.commands.train import main
from trainer.training.cpu_fsdp import FSDP2_ON_CPU_ENV
from trainer.training.trainer import DFlash2Trainer

CAPTURES: list[dict[str, Any]] = []
CURRENT: dict[str, Any] = {}  # set by compute_loss for the objective call it makes
_dflash_loss = loss_module.dflash_loss


def _values(tensor: torch.Tensor) -> list[float]:
    return tensor.detach().double().reshape(-1).tolist()  # float32 -> float64 is exact


def recording_dflash_loss(draft, hidden, *args, **kwargs):
    """The objective as it runs inside the draft's (FSDP2-wrapped) forward, its sums recorded before
    anything outside the forward can touch them."""
    result = _dflash_loss(draft, hidden, *args, **kwargs)
    CAPTURES.append(
        {
            **CURRENT,
            "hidden_dtype": str(hidden.dtype),
            "dtypes": sorted({str(t.dtype) for pair in result.terms.values() for t in pair}),
            "terms": {name: [_values(n), _values(d)] for name, (n, d) in result.terms.items()},
            "numerator": _values(result.numerator)[0],
            "denominator": _values(result.denominator)[0],
        }
    )
    return result


class RecordingTrainer(DFlash2Trainer):
    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        CURRENT.clear()
        CURRENT.update(mode="train" if model.training else "eval", log_index=len(self.state.log_history))
        if "loss_denominator" in inputs:
            CURRENT["step_denominator"] = _values(inputs["loss_denominator"])[0]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _objective(self, model, draft, inputs):
        result = super()._objective(model, draft, inputs)
        from torch.distributed.fsdp import FSDPModule

        CAPTURES[-1]["sharded"] = isinstance(model, FSDPModule)  # FSDP2 really wraps the draft
        CAPTURES[-1]["returned"] = {
            "numerator": [str(result.numerator.dtype), _values(result.numerator)[0]],
            "denominator": [str(result.denominator.dtype), _values(result.denominator)[0]],
        }
        return result


if __name__ == "__main__":
    root = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    if rank == 0:
        write_tiny_run(
            root,
            bf16=True,
            fsdp="full_shard",
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["DFlash2DecoderLayer"]},
            gradient_accumulation_steps=2,
            max_steps=2,
            save_steps=100,
            eval_strategy="steps",
            eval_steps=2,
            kd_weight=0.5,
        )
        (root / "ready").write_text("1")
    while not (root / "ready").exists():
        time.sleep(0.1)
    import trainer.training.run as train_script

    os.environ[FSDP2_ON_CPU_ENV] = "1"
    loss_module.dflash_loss = recording_dflash_loss
    train_script.DFlash2Trainer = RecordingTrainer
    main([str(root / "recipe.yaml")])
    (root / f"captures_{rank}.json").write_text(json.dumps(CAPTURES))

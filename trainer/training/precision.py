"""Precision as recipe keys (`bf16`, `fp16`, `tf32`), as in HF, accepted on any machine and applied at launch.

transformers' `TrainingArguments.__post_init__` checks the device: `bf16: true` without a bf16 GPU
("Your setup doesn't support bf16/gpu") and `tf32: true` without an Ampere GPU are errors, so a
recipe meant for 8 GPUs could not even be parsed, planned or written on a CPU laptop. Here the two
moments are kept apart:

- Parsing (`post_init_without_device_checks`, from `DFlashTrainingArguments.__post_init__`): the
  three keys are held at their neutral values while transformers' checks run, then the user's values
  are put back and `mixed_precision` is derived from them as transformers derives it. Nothing about
  precision touches the device, and the arguments say what was asked for, so the planner
  (`trainer.plan.facts._precision`) plans `--bf16 true` exactly like an accelerate config's
  `mixed_precision: bf16`. The one check kept is transformers' "at most one of bf16 and fp16".
  What was asked is also kept in `args.requested_precision`.
- Launch (`apply_at_launch`, from `DFlash2Trainer.__init__` before accelerate is set up): what the
  device cannot run is cleared from the arguments, with one warning line naming what was requested
  and what runs instead: bf16 on a GPU without bf16 (pre-Ampere), tf32 on a GPU without TF32 or on
  CPU (an NVIDIA format), fp16 on CPU (accelerate 1.15 enables fp16 mixed precision only on
  accelerators: on CPU it would silently train in float32, though torch's CPU autocast has fp16).
  bf16 runs on CPU: accelerate's CPU autocast (`torch.autocast("cpu", torch.bfloat16)`), or under
  FSDP2 its bf16 `MixedPrecisionPolicy` (parameters gathered and gradients reduced in bf16); slower
  than float32 on most CPUs, but it is how a bf16 recipe is rehearsed before a GPU is rented.
  `tf32` is applied where it is available, as transformers would. From then on the arguments say
  what runs, so the recorded recipe and `training_args.bin` hold the run's real precision. A CUDA
  run left in float32 with no mixed precision from the recipe or from accelerate (`mixed_precision`)
  warns once, suggesting `bf16: true`.
  Other accelerators (XPU, MPS, ...) are left to transformers and accelerate.
- Once accelerate is set up (`leave_draft_outputs_uncast`, from `DFlash2Trainer.__init__`): accelerate's
  FSDP2 policy for bf16 casts every wrapped module's outputs to bf16 (`output_dtype`), the root's too,
  and the draft's root forward returns the objective's sums (`output_transform`); their cast is
  dropped, so the loss numerator, its denominator and every metric sum stay float32 (pooling is exact)
  while parameters and gradient reductions keep the policy's dtypes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers.utils.import_utils import enable_tf32, is_torch_bf16_gpu_available, is_torch_tf32_available

logger = logging.getLogger(__name__)

# The values under which TrainingArguments.__post_init__ checks nothing about the device.
NEUTRAL = {"bf16": False, "fp16": False, "tf32": None}
MIXED = ("bf16", "fp16")


def post_init_without_device_checks(args: Any, post_init: Callable[[], None]) -> None:
    """Run transformers' `__post_init__` with bf16/fp16/tf32 held neutral, then restore the user's values."""
    requested = {name: getattr(args, name) for name in NEUTRAL}
    if requested["bf16"] and requested["fp16"]:
        raise ValueError("bf16 and fp16 are both true: at most one of them can be")
    for name, neutral in NEUTRAL.items():
        setattr(args, name, neutral)
    try:
        post_init()
    finally:
        for name, value in requested.items():
            setattr(args, name, value)
    if args.fp16 or args.bf16:
        args.mixed_precision = "fp16" if args.fp16 else "bf16"
    args.requested_precision = requested


CPU_LIMITS = {
    "fp16": "accelerate runs fp16 mixed precision only on GPUs (on CPU it would silently train in float32); "
    "bf16 runs on CPU",
    "tf32": "TF32 is an NVIDIA GPU format (the run is on CPU)",
}


def _unsupported(name: str, device: torch.device) -> str | None:
    """Why `device` cannot run `name` (None: it can, or it is left to accelerate)."""
    if device.type == "cpu":
        return CPU_LIMITS.get(name)  # bf16: accelerate's CPU autocast, or its FSDP2 bf16 policy
    if device.type != "cuda":
        return None
    if name == "bf16" and not is_torch_bf16_gpu_available():
        return "this GPU has no bf16 (it needs Ampere or newer)"
    if name == "tf32" and not is_torch_tf32_available():
        return "this GPU has no TF32 (it needs Ampere or newer)"
    return None


def apply_at_launch(args: Any) -> None:
    """Clear what the device cannot run (one warning line), apply tf32, and warn on a plain-fp32 CUDA run."""
    device = args.device
    requested = getattr(args, "requested_precision", {})
    dropped = []
    mixed = args.mixed_precision if args.mixed_precision in MIXED else None
    if mixed is not None and (why := _unsupported(mixed, device)):
        source = "the recipe" if requested.get(mixed) else "accelerate's mixed_precision"
        dropped.append(f"{mixed} (from {source}) runs as float32: {why}")
        args.bf16 = args.fp16 = False
        args.mixed_precision = "no"
    if args.tf32 is not None:
        why = _unsupported("tf32", device) if args.tf32 else None
        if why:
            dropped.append(f"tf32 is off: {why}")
            args.tf32 = None
        elif device.type == "cuda" and is_torch_tf32_available():
            enable_tf32(bool(args.tf32))
    if dropped:
        logger.warning("precision: %s", "; ".join(dropped))
    elif device.type == "cuda" and args.mixed_precision not in MIXED:
        logger.warning(
            "precision: this CUDA run trains in float32 without mixed precision; set bf16: true in the recipe "
            "(or mixed_precision: bf16 in the accelerate config) to train faster in less memory"
        )


def leave_draft_outputs_uncast(fsdp_plugin: Any) -> None:
    """Drop the output cast (`output_dtype`) of an FSDP2 mixed-precision policy before the draft is
    wrapped: the draft's forward returns the objective, whose float32 sums a bf16 cast would round
    (`trainer.objective.metrics.check_pooled` refuses them). Parameters and reductions are unchanged;
    the decoder layers' outputs are bf16 anyway (they compute in `param_dtype`). No-op without FSDP2
    or without a policy."""
    if fsdp_plugin is None or getattr(fsdp_plugin, "fsdp_version", None) != 2:
        return
    policy = getattr(fsdp_plugin, "mixed_precision_policy", None)
    if policy is not None and getattr(policy, "output_dtype", None) is not None:
        fsdp_plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)
        logger.debug(
            "precision: FSDP2 output_dtype %s dropped: the draft's outputs (the objective's float32 sums) stay uncast",
            policy.output_dtype,
        )

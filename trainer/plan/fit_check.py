"""Fail before the work: `dflash2 train` and `dflash2 prepare` compare the planner's estimate with
this machine's memory before the target, the draft or any data is built, and a recipe that cannot
fit stops with the planner's own verdict in one line (exit 2) instead of growing until the kernel
kills it without a word (`num_anchors: 1000000000` did, at 23 GB).

One implementation: the numbers are `dflash2 plan`'s (`plan_run`, configs only, models built on the
meta device: milliseconds, and nothing grows with the recipe's sizes), for the device this process
runs on: a CUDA device's total memory (what `--gpu-memory-gb` means), or on CPU the memory
available now, shared by the ranks of this machine. `prepare` runs the target alone, on CPU: its
weights are checked (the capture's and the generation's working memory depend on the samples'
lengths, which the planner only bounds). The check refuses only what the planner shows cannot fit:
a run it cannot size (a GGUF target not converted yet, a config it cannot build on the meta device,
a device it has no model of, an unreadable memory size) is said in one log line and goes ahead,
and `DFLASH2_SKIP_MEMORY_CHECK=1` skips it for a run the planner overestimates.
"""

from __future__ import annotations

import logging
import os

import torch

from trainer.fileio import format_bytes
from trainer.models.config_bounds import InsufficientMemoryError, available_memory
from trainer.plan.facts import DEVICES, DTYPE_BYTES, launched_accelerate_config, load_target_config, target_facts
from trainer.plan.memory import MemoryPlan, plan_run

SKIP_VARIABLE = "DFLASH2_SKIP_MEMORY_CHECK"
logger = logging.getLogger(__name__)


class RecipeDoesNotFit(InsufficientMemoryError):
    """The planner's estimate of the recipe exceeds this machine's memory: a user error (exit 2)."""


def skipped() -> bool:
    return os.environ.get(SKIP_VARIABLE, "").strip().lower() in ("1", "true", "yes")


def cpu_share(local_ranks: int) -> tuple[int | None, str]:
    """(bytes, description): the memory available now, split between this machine's ranks."""
    available = available_memory()
    if available is None:
        return None, "CPU memory"
    share = f", split between its {local_ranks} ranks" if local_ranks > 1 else ""
    return available // local_ranks, f"{format_bytes(available)} of CPU memory available{share}"


def device_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes one rank may plan for, description) on `device`; None when unknown."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return properties.total_memory, f"{properties.name} with {format_bytes(properties.total_memory)}"
    if device.type == "cpu":
        return cpu_share(max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1))
    return None, f"a {device.type} device"


def check_run_fits(model_args, data_args, training_args) -> MemoryPlan | None:
    """Refuse the training run when the planner's per-rank estimate exceeds this rank's memory;
    the plan, or None when it could not be made (said in one log line on rank 0)."""
    if skipped():
        return None
    device = training_args.device
    memory, where = device_memory(device)
    try:
        if device.type not in DEVICES or memory is None:
            raise ValueError(f"the planner has no memory size for {where}")
        accelerate = launched_accelerate_config(os.environ)
        plan = plan_run(
            model_args, data_args, training_args, training_args.world_size, memory, accelerate, device=device.type
        )
    except Exception as error:  # an estimate that cannot be made must not stop a run
        if training_args.process_index == 0:
            logger.info("memory check skipped: the planner could not size this run (%s)", _short(error))
        return None
    if not plan.fits:
        raise RecipeDoesNotFit(
            f"this run does not fit in this machine's memory ({where}) by the planner's estimate: "
            f"{plan.verdict()}; lower per_device_train_batch_size, num_anchors or max_length "
            f"(`dflash2 plan RECIPE` shows every part), or set {SKIP_VARIABLE}=1 to run it anyway"
        )
    return plan


def check_target_fits(model_args, data_args, training_args) -> int | None:
    """Refuse a `prepare` whose target weights alone (the planner's parameter count, whole, in
    target_dtype: prepare runs the whole target, also for a run whose trainer streams its features)
    exceed the CPU memory available; the bytes, or None when they could not be sized."""
    if skipped():
        return None
    memory, where = cpu_share(1)
    try:
        if memory is None:
            raise ValueError(f"the planner has no memory size for {where}")
        if model_args.target_dtype not in DTYPE_BYTES:
            raise ValueError(f"target_dtype: {model_args.target_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        target = target_facts(load_target_config(model_args))
        # the whole target, in this one process: never the embedding and head a streamed run's trainer loads
        needed = target.parameters * DTYPE_BYTES[model_args.target_dtype]
    except Exception as error:  # an estimate that cannot be made must not stop a run
        logger.info("memory check skipped: the planner could not size the target (%s)", _short(error))
        return None
    if needed > memory:
        raise RecipeDoesNotFit(
            f"the target does not fit in this machine's memory ({where}) by the planner's estimate: its "
            f"{target.parameters:,} parameters in {model_args.target_dtype} need {format_bytes(needed)} "
            f"(target_weights), more than {format_bytes(memory)}; prepare on a larger machine or through "
            f"regenerate_endpoint / feature_endpoint, or set {SKIP_VARIABLE}=1 to run it anyway"
        )
    return needed


def _short(error: BaseException, limit: int = 200) -> str:
    """The reason on one short line (a planner error may quote a long config or path)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."

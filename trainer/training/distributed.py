"""Starting and ending a multi-process run: CPU ranks launched without `use_cpu`, and a clean end.

Launched as several processes (torchrun, `accelerate launch`) on a machine where accelerate finds
no GPU, a recipe without `use_cpu` made accelerate set every rank up as a single process: each
took the output_dir lock and trained alone. `adopt_cpu_ranks` sets such ranks up as CPU ranks over
gloo, as `use_cpu: true` would, and says so in one warning line.

Ending: every rank finishes, then the process group goes away.

gloo's worker threads can still hold finished collectives whose tensors need the GIL to be freed.
Left to interpreter shutdown, that aborts a rank after a successful run ("terminate called without an
active exception"); destroyed from DDP's C++ Reducer, which keeps the GIL while it joins those threads,
it deadlocks. So the DDP wrapper is freed first, while the world group still owns the process group,
and the group's last owner is the Python handle, whose destructor releases the GIL.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel

from trainer.training.watchdog import finish_watchdog

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.getLogger(__name__)

LEAKED_WRAPPER_WARNING = "a DistributedDataParallel wrapper is still referenced when the process group closes"


def launched_world_size() -> int:
    """How many processes the launcher started (WORLD_SIZE, set by torchrun and accelerate launch)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def adopt_cpu_ranks(training_args: Any) -> bool:
    """Set a multi-process launch that accelerate took for one process up as CPU ranks (gloo).

    accelerate picks a GPU-like backend when it finds a device and a CPU group only with `use_cpu`;
    with neither, each rank runs alone. That is redone here with `use_cpu` (HF and accelerate both
    read ACCELERATE_USE_CPU), keeping the process group accelerate already opened. True when the
    ranks were adopted; a launch that still does not come out as CPU ranks stops with one line.
    """
    world = launched_world_size()
    state = getattr(training_args, "distributed_state", None)
    if world <= 1 or state is None or state.distributed_type != DistributedType.NO:
        return False
    os.environ["ACCELERATE_USE_CPU"] = "true"
    training_args.use_cpu = True
    training_args.__dict__.pop("_setup_devices", None)  # HF's cached device set-up, redone with use_cpu
    device = training_args.device
    if (
        training_args.distributed_state.distributed_type != DistributedType.MULTI_CPU
        or training_args.world_size != world
    ):
        raise ValueError(
            f"{world} processes were launched without use_cpu and accelerate finds no GPU for them, and setting "
            f"them up as CPU ranks failed (accelerate: {training_args.distributed_state.distributed_type}, "
            f"{training_args.world_size} process(es), device {device}): set use_cpu: true in the recipe"
        )
    if training_args.process_index == 0:
        logger.warning(
            "%d processes were launched without use_cpu and accelerate finds no GPU: they train as %d CPU ranks "
            "(gloo), as use_cpu: true would; set use_cpu: true in the recipe to say so",
            world,
            world,
        )
    return True


def live_ddp_wrappers() -> int:
    """How many DistributedDataParallel objects the garbage collector can still reach.

    `type(obj)`, not isinstance: DDP is an ABC, whose instance check reads `obj.__class__`, and some
    tracked objects (torch.distributed.reduce_op) warn on attribute access.
    """
    return sum(issubclass(type(obj), DistributedDataParallel) for obj in gc.get_objects())


def close_process_group(trainer: Trainer) -> None:
    """Barrier, free the trainer's DDP wrapper and the accelerator's references, destroy the group.

    Call once, at the very end of a run: the trainer cannot train again afterwards. Without an
    initialised process group this does nothing. The rank watchdog (`trainer.training.watchdog`) guards the
    barrier and stands down after it: from then on ranks exit on their own.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    trainer.accelerator.wait_for_everyone()
    finish_watchdog()
    trainer.model_wrapped = trainer.model  # type: ignore[assignment]  # (set: the run trained)
    trainer.accelerator.free_memory()
    gc.collect()
    if live_ddp_wrappers():
        logger.warning("%s; the exit may hang or abort", LEAKED_WRAPPER_WARNING)
    torch.distributed.destroy_process_group()

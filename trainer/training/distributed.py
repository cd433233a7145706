"""Ending a multi-process run cleanly: every rank finishes, then the process group goes away.

gloo's worker threads can still hold finished collectives whose tensors need the GIL to be freed.
Left to interpreter shutdown, that aborts a rank after a successful run ("terminate called without an
active exception"); destroyed from DDP's C++ Reducer, which keeps the GIL while it joins those threads,
it deadlocks. So the DDP wrapper is freed first, while the world group still owns the process group,
and the group's last owner is the Python handle, whose destructor releases the GIL.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer.training.watchdog import finish_watchdog

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.getLogger(__name__)

LEAKED_WRAPPER_WARNING = "a DistributedDataParallel wrapper is still referenced when the process group closes"


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
    trainer.model_wrapped = trainer.model
    trainer.accelerator.free_memory()
    gc.collect()
    if live_ddp_wrappers():
        logger.warning("%s; the exit may hang or abort", LEAKED_WRAPPER_WARNING)
    torch.distributed.destroy_process_group()

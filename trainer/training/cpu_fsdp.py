"""FSDP2 on CPU ranks (gloo), so a GPU recipe's sharded training can be rehearsed before GPUs are rented.

accelerate runs FSDP only on accelerator devices: on CPU ranks (`use_cpu`) its state stays
`MULTI_CPU`, the FSDP plugin from the accelerate config (`distributed_type: FSDP`) or the recipe's
`fsdp` keys is dropped, and the draft trains under DistributedDataParallel, without a word. Yet
torch's FSDP2 (`fully_shard`) works on CPU tensors over gloo, so the whole FSDP2 path (per-layer
sharding, the mixed-precision policy, sharded checkpoints, resume, the full-state-dict export) can
run here when asked: `DFLASH2_FSDP2_ON_CPU=1` (what `dflash2 rehearse` sets).

Forcing must be consistent. accelerate keeps two shared states: `PartialState` (the process group)
and `AcceleratorState` (the plugins), and every `AcceleratorState()` built later copies
`PartialState`'s fields over its own. Forcing only `AcceleratorState` is undone by the next such
copy, and code that asks `PartialState` (resume: `load_fsdp_model` broadcasts from rank 0 only
when every rank agrees FSDP2 is on) sees MULTI_CPU on some paths and FSDP on others: ranks took
different branches and both hung. So `force_fsdp2` sets the FSDP type in both shared states and
gives `AcceleratorState` the plugin, with the mixed-precision policy set as accelerate's own GPU
path sets it; `DFlash2Trainer.create_accelerator_and_postprocess` then builds the Trainer's
accelerator on that state, so the Trainer sees FSDP exactly as on GPUs.

Without the variable, a CPU run that asks for FSDP says in one warning line that it trains as DDP
(or as one process) and how to rehearse FSDP2 instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

FSDP2_ON_CPU_ENV = "DFLASH2_FSDP2_ON_CPU"
TRUE_WORDS = ("1", "true", "yes", "on")
REHEARSE_HINT = f"`dflash2 rehearse RECIPE --ranks 2` rehearses FSDP2 on CPU ranks ({FSDP2_ON_CPU_ENV}=1)"


def fsdp2_on_cpu_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `DFLASH2_FSDP2_ON_CPU` asks for FSDP2 on CPU ranks."""
    environ = os.environ if environ is None else environ
    return environ.get(FSDP2_ON_CPU_ENV, "").strip().lower() in TRUE_WORDS


def fsdp_source(args: Any, environ: Mapping[str, str] | None = None) -> str | None:
    """Who asks this run for FSDP: the recipe's `fsdp` keys or the accelerate config
    (`accelerate launch` exports ACCELERATE_USE_FSDP); None when nobody does."""
    environ = os.environ if environ is None else environ
    if getattr(args, "fsdp_plugin_args", None) is not None:
        return "the recipe's fsdp keys"
    if environ.get("ACCELERATE_USE_FSDP", "").strip().lower() in TRUE_WORDS:
        return "the accelerate config"
    return None


def fsdp_plugin_for(args: Any) -> Any:
    """The FSDP plugin the Trainer's accelerator is given: from the recipe's keys, else from the
    environment `accelerate launch` sets (accelerate's own rule)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    if getattr(args, "fsdp_plugin_args", None) is not None:
        return FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    return FullyShardedDataParallelPlugin()


def should_force(args: Any, environ: dict[str, str] | None = None) -> bool:
    """FSDP2 is forced when asked for (the variable), FSDP is asked for, and the run is on CPU ranks
    with a process group (a single plain process has nothing to shard over)."""
    import torch

    return (
        fsdp2_on_cpu_requested(environ)
        and fsdp_source(args, environ) is not None
        and args.device.type == "cpu"
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    )


def fallback_warning(args: Any, environ: dict[str, str] | None = None) -> str | None:
    """The one line for a CPU run that asks for FSDP but will not shard; None when nothing falls back."""
    source = fsdp_source(args, environ)
    if source is None or args.device.type != "cpu" or should_force(args, environ):
        return None
    ranks = args.world_size
    runs_as = f"DDP on {ranks} CPU ranks" if ranks > 1 else "one process (FSDP needs a multi-process launch)"
    return f"FSDP (from {source}) does not run on CPU in accelerate: this run trains as {runs_as}; {REHEARSE_HINT}"


def force_fsdp2(accelerator_state: Any, plugin: Any) -> None:
    """Make accelerate's states say FSDP with `plugin`, as its GPU path would have set them.

    Refuses FSDP1: what is rehearsed here is the FSDP2 path the shipped accelerate config uses.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if plugin.fsdp_version != 2:
        raise ValueError(
            f"{FSDP2_ON_CPU_ENV}=1 rehearses FSDP2, but this run asks for FSDP version {plugin.fsdp_version} "
            "(fsdp_version in the accelerate config, or fsdp_config.version in the recipe): set it to 2"
        )
    mixed_precision = accelerator_state.mixed_precision
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    accelerator_state.fsdp_plugin = plugin
    accelerator_state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP

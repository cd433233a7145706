"""`torch_compile: true` for a draft: regional compilation of its decoder layers, in place.

A recipe's `torch_compile` (TrainingArguments' own flag) would make accelerate compile the whole
wrapped model, objective included: its data-dependent parts (the active blocks, the chunk loop)
break the graph, and an `OptimizedModule` wrapper prefixes every state-dict key. Compiling each
decoder layer in place (`nn.Module.compile`) instead gives one graph per layer (all layers share
it), leaves parameter names and checkpoints unchanged, works under FSDP2 (compile, then shard, as
torchtitan does), and keeps the fused LM head and the selector as they are. Shapes: the number of
block tokens is fixed by the recipe (num_anchors x block size); the packed context length varies,
so the first new length recompiles once with a dynamic size, and no later length does.
"""

from __future__ import annotations

import logging

from torch import nn

from modeling_dflash2 import DFlash2DecoderLayer

logger = logging.getLogger(__name__)


def compile_decoder_layers(model: nn.Module, backend: str | None = None, mode: str | None = None) -> int:
    """Compile every DFlash decoder layer of `model` (a draft, or a PEFT wrapper of one) in place;
    returns how many."""
    layers = [module for module in model.modules() if isinstance(module, DFlash2DecoderLayer)]
    if not layers:
        raise ValueError(f"torch_compile: {type(model).__name__} has no DFlash decoder layer to compile")
    options = {"backend": backend or "inductor", "dynamic": None}
    if mode is not None:
        options["mode"] = mode
    for layer in layers:
        layer.compile(**options)
    logger.info("torch_compile: compiled %d draft decoder layers in place (%s)", len(layers), options)
    return len(layers)

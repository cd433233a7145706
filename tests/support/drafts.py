"""Tiny DFlash2 configs and drafts (CPU, float32) shared by the tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel

FIXTURES = Path(__file__).parents[1] / "fixtures"


def tiny_dflash_config(**overrides: Any) -> dict[str, Any]:
    """A DFlash2 `dflash_config` dict for the tiny test configs."""
    values = {
        "block_size": 4,
        "mask_token_id": 3,
        "target_layer_ids": [1, 4],
        "conv_kernel_size": 2,
        "conv_group_size": 8,
        "selector_rank": 8,
        "selector_top_k": 5,
    }
    values.update(overrides)
    return values


def tiny_config_kwargs(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 50,
        "num_target_layers": 6,
        "is_causal": False,
        "layer_types": ["full_attention", "full_attention"],
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "dflash_config": tiny_dflash_config(),
    }
    values.update(overrides)
    return values


def objective_batch(seed: int = 0, batch: int = 2, length: int = 12, final_hidden: bool = False) -> tuple:
    """Random inputs of the objective at tiny_config's sizes: input_ids, loss_mask (the first 3
    positions and row 1's last 2 unsupervised), target features [b, S, 2H], embedding, head; with
    `final_hidden` also the target's final hidden states [b, S, H], last (drawn after the rest, so
    the others do not depend on it)."""
    sizes = tiny_config_kwargs()
    vocab, hidden = sizes["vocab_size"], sizes["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab, (batch, length), generator=generator)
    loss_mask = torch.ones(batch, length, dtype=torch.long)
    loss_mask[:, :3] = 0
    loss_mask[1, -2:] = 0
    target_hidden = torch.randn(batch, length, 2 * hidden, generator=generator)
    embedding = torch.randn(vocab, hidden, generator=generator)
    head = torch.randn(vocab, hidden, generator=generator) * 0.5
    batch_inputs = (input_ids, loss_mask, target_hidden, embedding, head)
    if final_hidden:
        batch_inputs += (torch.randn(batch, length, hidden, generator=generator),)
    return batch_inputs


def tiny_config(**overrides: Any) -> DFlash2Config:
    return DFlash2Config(**tiny_config_kwargs(**overrides))


def tiny_v1_config(**overrides: Any) -> DFlash2Config:
    values = tiny_config_kwargs(
        architectures=["DFlashDraftModel"],
        block_size=4,
        dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 4]},
    )
    values.update(overrides)
    return DFlash2Config(**values)


def randomize(model: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> torch.nn.Module:
    """Give every parameter random values, so identity convs and zero codebooks are not a crutch."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return model


def tiny_draft(seed: int = 0, randomized: bool = True, **overrides: Any) -> DFlash2DraftModel:
    torch.manual_seed(seed)
    model = DFlash2DraftModel(tiny_config(**overrides))
    return randomize(model, seed) if randomized else model


def tiny_v1_draft(seed: int = 0, **overrides: Any) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return randomize(DFlashDraftModel(tiny_v1_config(**overrides)), seed)


def draft_inputs(
    config: DFlash2Config, batch: int = 2, context: int = 6, blocks: int = 1, seed: int = 1
) -> dict[str, torch.Tensor]:
    """Inputs of one forward: context positions then `blocks` blocks placed right after it."""
    generator = torch.Generator().manual_seed(seed)
    block = config.block_size
    query = blocks * block
    width = len(config.target_layer_ids) * config.hidden_size
    return {
        "position_ids": torch.arange(context + query)[None].expand(batch, -1),
        "noise_embedding": torch.randn(batch, query, config.hidden_size, generator=generator),
        "target_hidden": torch.randn(batch, context, width, generator=generator),
    }


def rewrite_safetensors(directory: Path, edit) -> None:
    """Apply `edit(tensors)` to a saved checkpoint's model.safetensors (to build broken checkpoints)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


class AskedTheHub(Exception):
    """Raised by a stubbed Hub loader: proves a spec was taken for a Hub id, offline."""


def load_fixture_json(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())

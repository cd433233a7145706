"""Benchmark configurations and synthetic batches (random target features, embedding and head).

A benchmark step needs no target model: the draft sees random target features, embeds with a
random embedding and scores with a random LM head of the target's shape, which costs exactly what
the real ones cost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from trainer.objective.blocks import AnchorDraw, BlockBatch, build_blocks, sample_anchors

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StepSetup:
    """One training-step shape: the draft config plus batch rows, sequence length and anchors."""

    name: str
    config: DFlash2Config
    rows: int
    length: int
    anchors: int
    prompt_length: int
    chunk_blocks: int = 16

    def describe(self) -> str:
        c = self.config
        return (
            f"{self.name}: H={c.hidden_size}, L={c.num_hidden_layers}, V={c.vocab_size}, B={c.block_size}, "
            f"rows={self.rows}, S={self.length}, N={self.anchors}"
        )


def step_recipe_flags(
    directory: Path,
    *,
    length: int,
    rows: int,
    anchors: int,
    chunk_blocks: int,
    attention: str = "sdpa",
    offline: bool = True,
) -> list[str]:
    """A benchmark step as recipe flags: the target and draft config written in `directory`, fp32
    target and features (offline from disk, or captured online), the step's rows, length, anchors
    and LM-head chunking."""
    return [
        "--target", str(directory / "target"),
        "--draft_config", str(directory / "draft.json"),
        "--target_dtype", "float32",
        "--attn_implementation", attention,
        "--offline", "true" if offline else "false",
        "--offline_dtype", "float32",
        "--max_length", str(length),
        "--per_device_train_batch_size", str(rows),
        "--num_anchors", str(anchors),
        "--loss_chunk_blocks", str(chunk_blocks),
        "--output_dir", str(directory / "output"),
        "--report_to", "none",
    ]  # fmt: skip


def smollm2_setup(anchors: int = 16, rows: int = 4) -> StepSetup:
    """The default recipe's step: the SmolLM2-135M draft, batch 4, sequences of 160, 16 anchors."""
    config = DFlash2Config(**json.loads((REPO / "hub_configs" / "smollm2-135m-dflash2.json").read_text()))
    return StepSetup("smollm2-135m", config, rows=rows, length=160, anchors=anchors, prompt_length=40)


def large_setup(anchors: int = 128, rows: int = 1) -> StepSetup:
    """A Qwen3-class vocabulary with hidden 1024, block 16."""
    config = DFlash2Config(
        architectures=["DFlash2DraftModel"],
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_target_layers=28,
        is_causal=False,
        layer_types=["full_attention"],
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        dflash_config={
            "block_size": 16,
            "mask_token_id": 151669,
            "target_layer_ids": [1, 9, 17, 25],
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 256,
            "selector_top_k": 16,
        },
    )
    return StepSetup("large (Qwen3-class vocab)", config, rows=rows, length=512, anchors=anchors, prompt_length=64)


def tiny_setup() -> StepSetup:
    """For smoke tests of the benchmark code."""
    config = DFlash2Config(
        architectures=["DFlash2DraftModel"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=97,
        num_target_layers=4,
        is_causal=False,
        layer_types=["full_attention"],
        rope_parameters={"rope_theta": 1e4, "rope_type": "default"},
        dflash_config={
            "block_size": 4,
            "mask_token_id": 3,
            "target_layer_ids": [1, 2],
            "conv_kernel_size": 2,
            "conv_group_size": 8,
            "selector_rank": 8,
            "selector_top_k": 40,  # wide enough that random gold tokens are often candidates
        },
    )
    return StepSetup("tiny", config, rows=2, length=24, anchors=6, prompt_length=4, chunk_blocks=2)


@dataclass
class SyntheticBatch:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    target_hidden: torch.Tensor
    embedding: torch.Tensor
    head: torch.Tensor
    anchors: tuple[torch.Tensor, torch.Tensor]
    blocks: BlockBatch


def synthetic_batch(setup: StepSetup, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    config = setup.config
    generator = torch.Generator().manual_seed(seed)
    rows, length, hidden = setup.rows, setup.length, config.hidden_size
    input_ids = torch.randint(0, config.vocab_size, (rows, length), generator=generator)
    loss_mask = torch.zeros(rows, length, dtype=torch.long)
    loss_mask[:, setup.prompt_length :] = 1
    width = len(config.target_layer_ids) * hidden
    target_hidden = torch.randn(rows, length, width, generator=generator)
    embedding = torch.randn(config.vocab_size, hidden, generator=generator) * 0.02
    head = torch.randn(config.vocab_size, hidden, generator=generator) * 0.02
    input_ids, loss_mask = input_ids.to(device), loss_mask.to(device)
    anchors = sample_anchors(loss_mask, setup.anchors, AnchorDraw(seed, 0))
    return SyntheticBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        target_hidden=target_hidden.to(device, dtype),
        embedding=embedding.to(device, dtype),
        head=head.to(device, dtype),
        anchors=anchors,
        blocks=build_blocks(input_ids, loss_mask, *anchors, config.block_size, config.mask_token_id),
    )


def make_draft(setup: StepSetup, device: str = "cpu", seed: int = 0, attn_implementation: str = "sdpa"):
    torch.manual_seed(seed)
    config = setup.config
    config._attn_implementation = attn_implementation
    draft = (DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel)(config).to(device)
    if config.is_dflash2:
        with torch.no_grad():  # trained-like selector: a non-zero successor codebook
            draft.candidate_selector.successor_codebook.normal_(0.0, 0.02)
    return draft

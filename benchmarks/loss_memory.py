"""Peak memory of the loss head (LM head + losses + backward) as the number of anchors grows,
chunked (the trainer's objective) against unchunked (full logits, the naive reference).

On CPU each measurement runs in a fresh process and reads the peak resident set size before and
after the loss head (Linux `ru_maxrss`); on CUDA it reads the allocator's peak.
Usage (one measurement): python -m benchmarks.loss_memory SETUP ANCHORS chunked|unchunked [DEVICE]
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import setups
from benchmarks.naive import naive_loss
from trainer.blocks import AnchorDraw, build_blocks, sample_anchors
from trainer.objective import ObjectiveConfig, dflash_loss

SETUPS = {"smollm2": setups.smollm2_setup, "large": setups.large_setup, "tiny": setups.tiny_setup}


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(setup_name: str, anchors: int, mode: str, device: str = "cpu") -> dict:
    setup = SETUPS[setup_name]()
    config = setup.config
    block, hidden, vocab = config.block_size, config.hidden_size, config.vocab_size
    draft = setups.make_draft(setup, device)
    length = 2 * anchors + 2
    input_ids = torch.randint(0, vocab, (1, length), device=device)
    loss_mask = torch.ones_like(input_ids)
    anchor_ids = sample_anchors(loss_mask, anchors, AnchorDraw(0, 0))
    blocks = build_blocks(input_ids, loss_mask, *anchor_ids, block, config.mask_token_id)
    head = torch.randn(vocab, hidden, device=device) * 0.02
    hidden_states = torch.randn(1, anchors * block, hidden, device=device, requires_grad=True)
    objective = ObjectiveConfig(num_anchors=anchors, chunk_blocks=setup.chunk_blocks)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _peak_bytes()
    if mode == "chunked":
        loss = dflash_loss(draft, hidden_states, blocks, head, objective).loss
    else:
        loss = naive_loss(draft, hidden_states, blocks, head, objective, alpha=1.0)
    loss.backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _peak_bytes() - before
    logits_bytes = anchors * block * vocab * 4
    return {"anchors": anchors, "mode": mode, "peak_bytes": peak, "unchunked_logits_bytes": logits_bytes}


def sweep(setup_name: str, anchor_counts, device: str = "cpu") -> list[dict]:
    """Each point in its own process (CPU peak RSS never goes down within a process)."""
    results = []
    for anchors in anchor_counts:
        for mode in ("chunked", "unchunked"):
            if device.startswith("cuda"):
                results.append(measure(setup_name, anchors, mode, device))
                continue
            output = subprocess.run(
                [sys.executable, "-m", "benchmarks.loss_memory", setup_name, str(anchors), mode],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parents[1],
            ).stdout
            results.append(json.loads(output.strip().splitlines()[-1]))
    return results


if __name__ == "__main__":
    name, count, chosen = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    print(json.dumps(measure(name, count, chosen, sys.argv[4] if len(sys.argv) > 4 else "cpu")))

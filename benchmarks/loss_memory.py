"""Peak memory of the loss head (LM head + losses + backward) as the number of anchors grows,
chunked (the trainer's objective) against unchunked (full logits, the naive reference), each with
cross-entropy alone and with distillation from the target (`-kd`: kd_weight 0.5, whose teacher
logits come from the target's final hidden states over the context).

On CPU each measurement runs in a process of its own, forked from one that has done the imports
(a fresh process per point would import torch each time): freed heap memory is handed back to the
OS (`malloc_trim`), the kernel's peak-RSS mark is reset (`/proc/self/clear_refs`), and the peak
(`VmHWM`) after the loss head minus the resident size before it is the loss head's peak. On CUDA
it reads the allocator's peak.

Each measurement printed as one JSON line (what `sweep` runs, in a process of its own):
python -m benchmarks.loss_memory SETUP ANCHORS MODE [--then ANCHORS:MODE ...] [--device DEVICE]
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import setups
from benchmarks.naive import naive_loss
from trainer.commands.runner import command_parser, run
from trainer.objective.blocks import AnchorDraw, build_blocks, sample_anchors
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import dflash_loss

# glibc raises its mmap threshold after large frees and then serves big blocks from a heap it
# rarely returns, so RSS would track allocator history rather than live tensors; a fixed threshold
# keeps every large tensor in its own mapping, returned to the OS when freed.
MEASURING_ENVIRONMENT = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
MODES = ("chunked", "unchunked", "chunked-kd", "unchunked-kd")
SETUPS = {"smollm2": setups.smollm2_setup, "large": setups.large_setup, "tiny": setups.tiny_setup}


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _resident_before_measuring() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
    return _status_bytes("VmRSS")


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
    distills = mode.endswith("-kd")
    objective = ObjectiveConfig(
        num_anchors=anchors, chunk_blocks=setup.chunk_blocks, kd_weight=0.5 if distills else None
    )
    target_final_hidden = torch.randn(1, length, hidden, device=device) if distills else None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _resident_before_measuring()
    if mode.startswith("chunked"):
        loss = dflash_loss(draft, hidden_states, blocks, head, objective, target_final_hidden=target_final_hidden).loss
    else:
        loss = naive_loss(draft, hidden_states, blocks, head, objective, 1.0, target_final_hidden)
    loss.backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status_bytes("VmHWM") - before
    logits_bytes = anchors * block * vocab * 4
    return {"anchors": anchors, "mode": mode, "peak_bytes": peak, "unchunked_logits_bytes": logits_bytes}


def sweep(setup_name: str, anchor_counts, device: str = "cpu") -> list[dict]:
    """Every anchor count with every mode: on CPU in one process that forks one child per point
    (CPU peak RSS never goes down within a process), with the allocator settings above."""
    points = [(anchors, mode) for anchors in anchor_counts for mode in MODES]
    if device.startswith("cuda"):
        return [measure(setup_name, anchors, mode, device) for anchors, mode in points]
    (anchors, mode), *rest = points
    command = [sys.executable, "-m", "benchmarks.loss_memory", setup_name, str(anchors), mode, "--device", device]
    if rest:
        command += ["--then", *(f"{anchors}:{mode}" for anchors, mode in rest)]
    output = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        env=MEASURING_ENVIRONMENT,
    ).stdout
    return [json.loads(line) for line in output.strip().splitlines()[-len(points) :]]


def measured_in_a_child(setup_name: str, anchors: int, mode: str, device: str) -> dict:
    """`measure` in a child forked from this process: its peak is its own, whatever came before."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one measurement, its JSON through the pipe, no cleanup of the parent's state
        code = 1
        try:
            os.close(read_end)
            os.write(write_end, json.dumps(measure(setup_name, anchors, mode, device)).encode())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    exit_code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if exit_code != 0 or not text:
        raise RuntimeError(f"the measurement of {anchors} anchors, {mode}, failed (exit {exit_code})")
    return json.loads(text)


def point(text: str) -> tuple[int, str]:
    """`ANCHORS:MODE` of --then."""
    anchors, _, mode = text.partition(":")
    if not anchors.isdigit() or mode not in MODES:
        raise ValueError(f"--then: {text!r} is not ANCHORS:MODE with MODE one of {', '.join(MODES)}")
    return int(anchors), mode


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = command_parser("python -m benchmarks.loss_memory", __doc__)
    parser.add_argument("setup", choices=tuple(SETUPS))
    parser.add_argument("anchors", type=int)
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--then", nargs="+", default=[], metavar="ANCHORS:MODE", help="more points, after the first")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    points = [(args.anchors, args.mode), *(point(text) for text in args.then)]
    if any(anchors < 1 for anchors, _ in points):
        parser.error("anchors must be at least 1")
    results = []
    for anchors, mode in points:
        if args.device.startswith("cuda"):
            result = measure(args.setup, anchors, mode, args.device)
        else:
            result = measured_in_a_child(args.setup, anchors, mode, args.device)
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    run(main)

"""One training step (draft forward + objective + backward): throughput, GFLOP/s and MFU against the
matrix-multiply peak measured in the same process, and the speed-up over the naive reference."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import record_function

from benchmarks.flops import step_flops
from benchmarks.naive import naive_step
from benchmarks.setups import StepSetup, SyntheticBatch, make_draft, synthetic_batch
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import draft_objective


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(function: Callable[[], object], device: str, warmup: int = 1, repeats: int = 3) -> tuple[float, object]:
    """Median wall time of `repeats` calls after `warmup` calls, and the last result."""
    result = None
    for _ in range(warmup):
        result = function()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def optimized_step(
    draft, batch: SyntheticBatch, config: ObjectiveConfig, backward_label: str | None = None
) -> torch.Tensor:
    """The trainer's step: forward, objective, backward; returns the loss. `backward_label` names
    the backward pass for a profiler."""
    draft.zero_grad(set_to_none=True)
    result = draft_objective(
        draft,
        batch.input_ids,
        batch.loss_mask,
        batch.target_hidden,
        batch.embedding,
        batch.head,
        config,
        draw=None,
        anchors=batch.anchors,
    )
    with record_function(backward_label) if backward_label else contextlib.nullcontext():
        result.loss.backward()
    return result.loss.detach()


def matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.float32, sizes=(1024, 2048, 3072)) -> float:
    """Best torch.mm GFLOP/s over a few square sizes: the machine's achievable GEMM peak."""
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        seconds, _ = timed(lambda a=a, b=b: torch.mm(a, b), device, warmup=2, repeats=5)
        best = max(best, 2 * size**3 / seconds / 1e9)
    return best


def bench_train_step(
    setup: StepSetup,
    device: str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    with_naive: bool = True,
    repeats: int = 3,
    peak: float | None = None,
) -> dict:
    draft = make_draft(setup, device, attn_implementation=attn_implementation).train()
    batch = synthetic_batch(setup, device)
    config = ObjectiveConfig(num_anchors=setup.anchors, chunk_blocks=setup.chunk_blocks)
    autocast = (
        torch.autocast(device_type="cuda", dtype=compute_dtype)
        if device.startswith("cuda") and compute_dtype != torch.float32
        else contextlib.nullcontext()
    )

    def optimized():
        with autocast:
            return optimized_step(draft, batch, config)

    seconds, loss = timed(optimized, device, repeats=repeats)
    flops = step_flops(setup, batch)
    peak = peak if peak is not None else matmul_peak(device, compute_dtype)
    supervised = float(batch.blocks.weights.sum())
    report = {
        "setup": setup.describe(),
        "device": device,
        "dtype": str(compute_dtype).removeprefix("torch."),
        "seconds_per_step": seconds,
        "supervised_tokens_per_second": supervised / seconds,
        "model_gflop_per_step": flops.model / 1e9,
        "achieved_gflop_per_second": flops.model / seconds / 1e9,
        "hardware_gflop_per_second": flops.hardware / seconds / 1e9,
        "matmul_peak_gflop_per_second": peak,
        "mfu": flops.model / seconds / 1e9 / peak,
        "loss": float(loss),
    }
    if with_naive:
        tolerance = 1e-4 if compute_dtype == torch.float32 else 2e-2
        naive_seconds, naive_loss = timed(lambda: naive_step(draft, batch, config), device, warmup=0, repeats=1)
        report.update(
            naive_seconds_per_step=naive_seconds,
            speedup_over_naive=naive_seconds / seconds,
            naive_loss=float(naive_loss),
            losses_agree=abs(float(naive_loss) - float(loss)) <= tolerance * max(1.0, abs(float(loss))),
        )
    return report

"""Where a training step spends its time: torch.profiler over one optimized and one naive step.

The GEMM share says how far any implementation can get ahead of another that does the same
matrix products: python -m benchmarks.profile_step [smollm2|large]
"""

from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from benchmarks import setups
from benchmarks.naive import naive_step
from benchmarks.train_step import optimized_step
from trainer.objective.config import ObjectiveConfig

SETUPS = {"smollm2": setups.smollm2_setup, "large": setups.large_setup}
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")


def _self_times(events) -> dict[str, float]:
    return {event.key: event.self_cpu_time_total for event in events}


def profile_steps(setup: setups.StepSetup, rows: int = 15) -> dict:
    draft = setups.make_draft(setup).train()
    batch = setups.synthetic_batch(setup)
    config = ObjectiveConfig(num_anchors=setup.anchors, chunk_blocks=setup.chunk_blocks)

    def naive():
        draft.zero_grad(set_to_none=True)
        naive_step(draft, batch, config)

    report = {}
    for name, step in (("optimized", lambda: optimized_step(draft, batch, config)), ("naive", naive)):
        step()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            step()
        events = profiler.key_averages()
        times = _self_times(events)
        total = sum(times.values())
        gemm = sum(t for key, t in times.items() if key in GEMM_OPS)
        report[name] = {
            "total_ms": total / 1e3,
            "gemm_ms": gemm / 1e3,
            "gemm_share": gemm / total,
            "table": events.table(sort_by="self_cpu_time_total", row_limit=rows),
        }
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("setup", nargs="?", choices=sorted(SETUPS), default="smollm2", help="the step shape")
    args = parser.parse_args(argv)
    for name, part in profile_steps(SETUPS[args.setup]()).items():
        print(f"== {name}: {part['total_ms']:.0f} ms, GEMM {part['gemm_ms']:.0f} ms ({part['gemm_share']:.0%})")
        print(part["table"])


if __name__ == "__main__":
    main()

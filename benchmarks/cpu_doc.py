"""benchmarks/results/cpu.json (`make bench`) -> the generated sections of docs/performance.md.

Whether each of the performance targets was reached is computed from the JSON, not written down.
"""

from __future__ import annotations

from typing import Any

from benchmarks.doc_parts import MIB, NOT_MEASURED, table


def render_cpu_machine(cpu: dict[str, Any]) -> str:
    machine = cpu["machine"]
    peaks = [cpu["matmul_peak_gflop_per_second"], *(s["matmul_peak_gflop_per_second"] for s in cpu["train_step"])]
    return (
        f"Measured by `make bench` on {machine['threads']} threads ({machine['device']}), torch {machine['torch']}, "
        f"transformers {machine['transformers']}, {cpu['train_step'][0]['dtype']} (`benchmarks/results/cpu.json`). "
        f"MFU is always taken against the fp32 `torch.mm` peak measured in the same process "
        f"({min(peaks):.0f}–{max(peaks):.0f} GFLOP/s in this run; it varies between runs on this shared machine)."
    )


def render_train_step(cpu: dict[str, Any]) -> str:
    rows = []
    for step in cpu["train_step"]:
        rows.append(
            [
                step["setup"],
                f"{step['seconds_per_step']:.3g}",
                f"{step['supervised_tokens_per_second']:.0f}",
                f"{step['achieved_gflop_per_second']:.1f}",
                f"**{step['mfu']:.0%}**",
                None if step.get("naive_seconds_per_step") is None else f"{step['naive_seconds_per_step']:.3g}",
                None if step.get("speedup_over_naive") is None else f"{step['speedup_over_naive']:.1f}×",
                "yes" if step.get("losses_agree") else "no",
            ]
        )
    header = ["step", "s/step", "supervised tok/s", "GFLOP/s", "MFU", "naive s/step", "speed-up over naive"]
    lines = table([*header, "same loss"], rows)
    notes = [f"{step['setup'].split(':', 1)[0]}: {step['note']}" for step in cpu["train_step"] if step.get("note")]
    if notes:
        lines += ["", "(" + "; ".join(notes) + ".)"]
    return "\n".join(lines)


def render_op_counts(cpu: dict[str, Any]) -> str:
    counts = cpu["op_counts"]
    rows = [
        [label, f"{c['draft_forward']:,}", f"{c['objective']:,}", f"{c['backward']:,}", f"**{c['total']:,}**"]
        for label, c in (("DFlash2 (selector on)", counts["dflash2"]), ("DFlash v1, same shape", counts["dflash_v1"]))
    ]
    header = ["aten ops per step", "draft forward", "objective (LM head, losses, metrics)", "backward", "total"]
    return "\n".join(table(header, rows))


def render_compile(cpu: dict[str, Any]) -> str:
    c = cpu.get("compile")
    if not c:
        return f"`torch_compile: true`: {NOT_MEASURED}."
    lengths = c["lengths"]
    return (
        f"`torch_compile: true` (each draft decoder layer compiled in place, inductor): eager "
        f"{c['eager_seconds_per_step']:.3f} s/step, compiled {c['compiled_seconds_per_step']:.3f} s/step "
        f"({c['speedup']:.2f}×) on this CPU, first step {c['first_compiled_step_seconds']:.1f} s, "
        f"{c['recompilations']} recompilations over {len(lengths)} batches of lengths {min(lengths)}–{max(lengths)}, "
        f"largest loss difference {c['max_loss_difference']:.1g}."
    )


def render_capture(cpu: dict[str, Any]) -> str:
    small, large = cpu["capture"]["smollm2_135m"], cpu["capture"]["qwen3_8b_flops"]
    run_layers = max(small["layer_ids"]) + 1
    identical = "bit-identical features" if small["bit_identical"] else "features NOT identical"
    return (
        f"Context capture on SmolLM2-135M-Instruct ({small['tokens'][0]} × {small['tokens'][1]} tokens, layers "
        f"{small['layer_ids']} of {small['target_layers']}): full depth {small['seconds_full_depth']:.3f} s, truncated "
        f"after layer {max(small['layer_ids'])} {small['seconds_truncated']:.3f} s "
        f"({small['truncated_over_full']:.2f}; "
        f"{run_layers} of {small['target_layers']} layers run), {identical}. Qwen3-8B at {large['sequence_length']} "
        f"tokens, layers up to {max(large['layer_ids'])} of {large['shape']['layers']}: "
        f"{large['flops_per_token_full_depth_with_head'] / 1e9:.2f} → {large['flops_per_token_truncated'] / 1e9:.2f} "
        f"GFLOP per token, {large['saving_fraction']:.1%} saved."
    )


def render_planner(cpu: dict[str, Any]) -> str:
    rows = [
        [
            row["shape"],
            row["precision"],
            str(row["rows"]),
            str(row["max_length"]),
            str(row["num_anchors"]),
            str(row["block_size"]),
            f"{row['predicted_bytes'] / MIB:.1f}",
            f"{row['measured_bytes'] / MIB:.1f}",
            f"{row['ratio']:.2f}",
        ]
        for row in cpu["planner_vs_measured"]
    ]
    header = ["shape", "precision", "b", "S", "N", "B", "predicted MiB", "measured MiB", "ratio"]
    return "\n".join(table(header, rows))


def render_spec_decode(cpu: dict[str, Any]) -> str:
    spec = cpu["spec_decode"]
    labels = {"trained/selector": "selector walk", "trained/unary": "unary argmax"}
    paths = "; ".join(
        f"{labels.get(name, name)} τ {path['mean_tau']:.2f}, {path['tokens_per_second']:.1f} tokens/s "
        f"({path['speedup']:.2f}×)"
        for name, path in spec["paths"].items()
    )
    return (
        f"Speculative decoding with SmolLM2-135M-Instruct and the demo's trained draft on {spec['prompts']} fixed "
        f"prompts (`benchmarks/spec_decode.py`, {spec['max_new_tokens']} new tokens, "
        f"{'greedy' if spec['temperature'] == 0 else 'sampled'}; these prompts are outside the chitchat distribution "
        f"the draft was trained on): target alone {spec['target_tokens_per_second']:.1f} tokens/s; {paths}."
    )


def _memory(cpu: dict[str, Any]) -> dict[int, dict[str, dict[str, int]]]:
    by_anchor: dict[int, dict[str, dict[str, int]]] = {}
    for point in cpu["loss_head_memory"]:
        by_anchor.setdefault(point["anchors"], {})[point["mode"]] = point
    return dict(sorted(by_anchor.items()))


def render_loss_memory(cpu: dict[str, Any]) -> str:
    memory = _memory(cpu)
    modes = ("chunked", "unchunked", "chunked-kd", "unchunked-kd")
    rows = [
        [
            str(anchors),
            *(f"{points[m]['peak_bytes'] / MIB:.0f} MB" for m in modes),
            f"{points['chunked']['unchunked_logits_bytes'] / MIB:.0f} MB",
        ]
        for anchors, points in memory.items()
    ]
    header = [
        "anchors",
        "chunked peak",
        "unchunked peak",
        "chunked + KD peak",
        "unchunked + KD peak",
        "unchunked logits",
    ]
    first, last = memory[min(memory)], memory[max(memory)]

    def growth(mode: str) -> float:
        return (last[mode]["peak_bytes"] - first[mode]["peak_bytes"]) / MIB

    return "\n".join(
        [
            *table(header, rows),
            "",
            f"With distillation (`kd_weight 0.5`, teacher logits from the target's final hidden states) the chunked "
            f"loss head grows by {growth('chunked-kd'):.0f} MB from {min(memory)} to {max(memory)} anchors, the "
            f"full-logits reference by {growth('unchunked-kd'):.0f} MB.",
        ]
    )


MFU_TARGET, MEMORY_TARGET, SPEEDUP_TARGET, MEMORY_TARGET_ANCHORS = 0.55, 1 / 8, 5.0, 512


def reached(flag: bool) -> str:
    return "reached" if flag else "**not reached**"


def render_targets(cpu: dict[str, Any]) -> str:
    """The three targets against this run's figures; reached or not is computed."""
    smollm2 = cpu["train_step"][0]
    memory = _memory(cpu)
    first, last = memory[min(memory)], memory[max(memory)]
    grown = (last["chunked"]["peak_bytes"] - first["chunked"]["peak_bytes"]) / MIB
    at = memory.get(MEMORY_TARGET_ANCHORS)
    fraction = at["chunked"]["peak_bytes"] / at["chunked"]["unchunked_logits_bytes"] if at else None
    speedups = [step["speedup_over_naive"] for step in cpu["train_step"] if "speedup_over_naive" in step]
    return (
        f"Against the targets: MFU ≥ {MFU_TARGET:.0%} at the SmolLM2 draft config, "
        f"{reached(smollm2['mfu'] >= MFU_TARGET)} "
        f"({smollm2['mfu']:.0%}); loss-head memory flat in the anchors (the only growth, {grown:.0f} MB from "
        f"{min(memory)} to {max(memory)} anchors, is [N·B, H] copies of the hidden states and their gradient and the "
        f"selector's [N·B, K, r] codebook rows; the [rows, V] part is one chunk whatever N) and ≤ 1/8 of the unchunked "
        f"logits at {MEMORY_TARGET_ANCHORS} anchors, "
        + (f"{reached(fraction <= MEMORY_TARGET)} ({fraction:.2f})" if fraction is not None else NOT_MEASURED)
        + f"; ≥ {SPEEDUP_TARGET:.0f}× the naive reference, "
        f"{reached(bool(speedups) and min(speedups) >= SPEEDUP_TARGET)} ("
        + " and ".join(f"{s:.1f}×" for s in speedups)
        + ")."
    )

"""benchmarks/results/cpu.json (`make bench`) -> the generated sections of docs/performance.md;
the packing section from benchmarks/results/packing.json (`make bench-packing`), its own file so
it is refreshed without rerunning the whole of `make bench`.

Whether each of the performance targets was reached is computed from the JSON, not written down.
"""

from __future__ import annotations

from typing import Any

from benchmarks.doc_parts import MIB, NOT_MEASURED, ratio_phrase, table


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


PACKED_PADDING_TARGET = 0.05
ORDER_LABELS = {
    "padded": "random order, padded",
    "grouped": "`group_by_length`",
    "packed": "`packing: true`",
}


def dense_ratio(training: dict[str, Any], first: str, second: str) -> float:
    """How many times `first`'s dense draft attention pairs per supervised token `second`'s are."""
    pairs = {name: training[name]["draft_attention_pairs_per_supervised_token"]["dense"] for name in (first, second)}
    return pairs[first] / pairs[second]


def render_packing(result: dict[str, Any]) -> str:
    """benchmarks/results/packing.json (`make bench-packing`): the three orders side by side."""
    lengths, settings, training = result["lengths"], result["settings"], result["training"]
    padded_rate = result["supervised_tokens_per_second"]["padded"]
    rows = [
        [
            ORDER_LABELS[name],
            str(result["micro_batches"][name]),
            f"{result['padding_fraction'][name]:.1%}",
            f"{result['target_gflop_per_supervised_token'][name]:.1f}",
            f"{training[name]['seconds_per_step']:.2f}",
            f"{training[name]['supervised_tokens_per_micro_batch']:.0f} "
            f"({training[name]['supervised_tokens_per_micro_batch_all']:.0f})",
            f"{result['supervised_tokens_per_second'][name]:.0f}",
            f"{result['supervised_tokens_per_second'][name] / padded_rate:.2f}×",
            f"{training[name]['blocks_per_supervised_token']:.3f}",
            f"{training[name]['draft_attention_pairs_per_supervised_token']['dense']:.0f} "
            f"({training[name]['draft_attention_pairs_per_supervised_token']['visible']:.0f})",
        ]
        for name in ("padded", "grouped", "packed")
    ]
    header = [
        "order",
        f"micro-batches at {settings['max_length']}",
        "padding",
        "Qwen3-8B capture GFLOP / supervised token",
        "CPU s/step",
        "CPU supervised tokens / micro-batch, drawn (all)",
        "CPU supervised tok/s",
        "vs padded",
        "CPU blocks / supervised token",
        "CPU draft attention pairs / supervised token, dense (visible)",
    ]
    flops, check = settings["target_flops"], result["packed_vs_separate"]
    rates = result["supervised_tokens_per_second"]
    packed = result["padding_fraction"]["packed"]
    return "\n".join(
        [
            f"{lengths['count']} samples of PyPI `chitchat-dataset` ({lengths['conversations_sampled']} of its "
            f"{lengths['conversations_in_dataset']:,} conversations drawn with seed {settings['seed']}, SmolLM2-135M-"
            f"Instruct's chat template and tokenizer, truncated to {lengths['truncated_to']} tokens, those without two "
            f"adjacent assistant tokens dropped): median {lengths['median']:.0f} tokens, p90 {lengths['p90']:.0f}, "
            f"p99 {lengths['p99']:.0f}, max {lengths['max']}, mean {lengths['mean']:.0f}; micro-batches of "
            f"{settings['micro_batch']} at max_length {settings['max_length']} (the Qwen3-8B recipe). GFLOP: "
            f"Qwen3-8B decoder layers 0–{flops['layers_run'] - 1} (the capture for target_layer_ids "
            f"{flops['layer_ids']}), per-document attention for packed rows. CPU columns: real training steps on "
            f"{settings['threads']} threads, SmolLM2-135M-Instruct capturing for the demo draft (its objective "
            f"and AdamW), each order planned over the {training['samples']} samples cut to "
            f"{settings['train_max_length']} tokens and {settings['train_steps']} of its micro-batches drawn at "
            f"random and trained on after {settings['warmup_steps']} untimed (`python -m benchmarks.packing`, "
            f"{result['seconds']:.0f} s in all).",
            "",
            *table(header, rows),
            "",
            f"Packed padding ≤ {PACKED_PADDING_TARGET:.0%}: {reached(packed <= PACKED_PADDING_TARGET)} "
            f"({packed:.1%}). On this CPU packed training ran {rates['packed'] / rates['padded']:.2f}× the padded "
            f"order's supervised tokens/s and {rates['packed'] / rates['grouped']:.2f}× the grouped order's "
            f"({ratio_phrase(rates['packed'], rates['grouped'])} it; {settings['train_steps']} drawn micro-batches "
            "an order, so this ratio carries the draw's noise as well as the machine's). "
            "Every order trains about as many blocks per supervised token (each document its own anchors); what "
            "a packed row costs more per position on this CPU is its dense masks. The draft's scores every query "
            "against every key of the row, and a packed row holds several documents' blocks and context: "
            f"{dense_ratio(training, 'packed', 'grouped'):.1f}× the grouped order's attention pairs per supervised "
            "token for the same visible pairs. The target's capture runs sdpa with an explicit block-diagonal "
            "mask instead of its plain causal path. flex_attention's block masks (the GPU recipes') skip the "
            "other documents' and blocks' keys. "
            f"The same {check['anchors']} anchors in three documents of "
            f"{', '.join(str(n) for n in check['document_lengths'])} tokens packed in one row and run alone "
            f"(SmolLM2 target and draft, float32): largest per-anchor loss difference "
            f"{check['max_abs_loss_diff']:.1g}.",
        ]
    )

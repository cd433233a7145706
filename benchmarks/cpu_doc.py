"""benchmarks/results/cpu.json (`make bench`) -> the generated sections of docs/performance.md;
the packing section from benchmarks/results/packing.json (`make bench-packing`), its own file so
it is refreshed without rerunning the whole of `make bench`.

The sentences are benchmarks/templates/cpu.md; this module computes what fills them. Whether each
of the performance targets was reached is computed from the JSON, not written down.
"""

from __future__ import annotations

from typing import Any

from benchmarks import doc_parts
from benchmarks.doc_parts import MIB, ratio_phrase, table_rows

TEMPLATE = "cpu"


def render(part: str, values: dict[str, Any] | None = None) -> str:
    return doc_parts.render(TEMPLATE, part, values)


def render_cpu_machine(cpu: dict[str, Any]) -> str:
    peaks = [cpu["matmul_peak_gflop_per_second"], *(s["matmul_peak_gflop_per_second"] for s in cpu["train_step"])]
    values = {"machine": cpu["machine"], "dtype": cpu["train_step"][0]["dtype"]}
    return render("machine", values | {"low_peak": min(peaks), "high_peak": max(peaks)})


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
                render("same-loss" if step.get("losses_agree") else "different-loss"),
            ]
        )
    text = render("train-step", {"rows": table_rows(rows)})
    notes = [f"{step['setup'].split(':', 1)[0]}: {step['note']}" for step in cpu["train_step"] if step.get("note")]
    if notes:
        text += "\n\n" + render("train-step-notes", {"notes": "; ".join(notes)})
    return text


def render_op_counts(cpu: dict[str, Any]) -> str:
    return render("op-counts", cpu["op_counts"])


def render_compile(cpu: dict[str, Any]) -> str:
    c = cpu.get("compile")
    if not c:
        return render("compile-missing")
    lengths = c["lengths"]
    return render("compile", {"c": c, "batches": len(lengths), "shortest": min(lengths), "longest": max(lengths)})


def render_capture(cpu: dict[str, Any]) -> str:
    small, large = cpu["capture"]["smollm2_135m"], cpu["capture"]["qwen3_8b_flops"]
    values = {
        "small": small,
        "large": large,
        "deepest": max(small["layer_ids"]),
        "layers_run": max(small["layer_ids"]) + 1,
        "identical": render("identical" if small["bit_identical"] else "not-identical"),
        "large_deepest": max(large["layer_ids"]),
        "full_gflop": large["flops_per_token_full_depth_with_head"] / 1e9,
        "truncated_gflop": large["flops_per_token_truncated"] / 1e9,
    }
    return render("capture", values)


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
    return render("planner", {"rows": table_rows(rows)})


SPEC_DECODE_LABELS = {"trained/selector": "selector walk", "trained/unary": "unary argmax"}


def render_spec_decode(cpu: dict[str, Any]) -> str:
    spec = cpu["spec_decode"]
    paths = "; ".join(
        render("spec-decode-path", {"label": SPEC_DECODE_LABELS.get(name, name), "path": path})
        for name, path in spec["paths"].items()
    )
    sampling = render("greedy" if spec["temperature"] == 0 else "sampled")
    return render("spec-decode", {"spec": spec, "sampling": sampling, "paths": paths})


def _memory(cpu: dict[str, Any]) -> dict[int, dict[str, dict[str, int]]]:
    by_anchor: dict[int, dict[str, dict[str, int]]] = {}
    for point in cpu["loss_head_memory"]:
        by_anchor.setdefault(point["anchors"], {})[point["mode"]] = point
    return dict(sorted(by_anchor.items()))


def _growth(memory: dict[int, dict[str, dict[str, int]]], mode: str) -> float:
    """MiB the peak of `mode` grows from the fewest anchors measured to the most."""
    return (memory[max(memory)][mode]["peak_bytes"] - memory[min(memory)][mode]["peak_bytes"]) / MIB


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
    values = {
        "rows": table_rows(rows),
        "kd_growth": _growth(memory, "chunked-kd"),
        "unchunked_kd_growth": _growth(memory, "unchunked-kd"),
        "fewest": min(memory),
        "most": max(memory),
    }
    return render("loss-memory", values)


MFU_TARGET, MEMORY_TARGET, SPEEDUP_TARGET, MEMORY_TARGET_ANCHORS = 0.55, 1 / 8, 5.0, 512


def reached(flag: bool) -> str:
    return render("reached" if flag else "not-reached")


def render_targets(cpu: dict[str, Any]) -> str:
    """The three targets against this run's figures; reached or not is computed."""
    smollm2 = cpu["train_step"][0]
    memory = _memory(cpu)
    at = memory.get(MEMORY_TARGET_ANCHORS)
    fraction = at["chunked"]["peak_bytes"] / at["chunked"]["unchunked_logits_bytes"] if at else None
    speedups = [step["speedup_over_naive"] for step in cpu["train_step"] if "speedup_over_naive" in step]
    values = {
        "mfu_target": MFU_TARGET,
        "mfu_reached": reached(smollm2["mfu"] >= MFU_TARGET),
        "mfu": smollm2["mfu"],
        "grown": _growth(memory, "chunked"),
        "fewest": min(memory),
        "most": max(memory),
        "memory_anchors": MEMORY_TARGET_ANCHORS,
        "memory": None
        if fraction is None
        else render("target-memory", {"reached": reached(fraction <= MEMORY_TARGET), "fraction": fraction}),
        "speedup_target": SPEEDUP_TARGET,
        "speedup_reached": reached(bool(speedups) and min(speedups) >= SPEEDUP_TARGET),
        "speedups": " and ".join(f"{s:.1f}×" for s in speedups),
    }
    return render("targets", values)


PACKED_PADDING_TARGET = 0.05
ORDERS = ("padded", "grouped", "packed")


def dense_ratio(training: dict[str, Any], first: str, second: str) -> float:
    """How many times `first`'s dense draft attention pairs per supervised token `second`'s are."""
    pairs = {name: training[name]["draft_attention_pairs_per_supervised_token"]["dense"] for name in (first, second)}
    return pairs[first] / pairs[second]


def render_packing(result: dict[str, Any]) -> str:
    """benchmarks/results/packing.json (`make bench-packing`): the three orders side by side."""
    settings, training = result["settings"], result["training"]
    rates = result["supervised_tokens_per_second"]
    rows = [
        [
            render(f"order-{name}"),
            str(result["micro_batches"][name]),
            f"{result['padding_fraction'][name]:.1%}",
            f"{result['target_gflop_per_supervised_token'][name]:.1f}",
            f"{training[name]['seconds_per_step']:.2f}",
            f"{training[name]['supervised_tokens_per_micro_batch']:.0f} "
            f"({training[name]['supervised_tokens_per_micro_batch_all']:.0f})",
            f"{rates[name]:.0f}",
            f"{rates[name] / rates['padded']:.2f}×",
            f"{training[name]['blocks_per_supervised_token']:.3f}",
            f"{training[name]['draft_attention_pairs_per_supervised_token']['dense']:.0f} "
            f"({training[name]['draft_attention_pairs_per_supervised_token']['visible']:.0f})",
        ]
        for name in ORDERS
    ]
    check, packed = result["packed_vs_separate"], result["padding_fraction"]["packed"]
    values = {
        "lengths": result["lengths"],
        "settings": settings,
        "flops": settings["target_flops"],
        "last_layer": settings["target_flops"]["layers_run"] - 1,
        "samples": training["samples"],
        "seconds": result["seconds"],
        "rows": table_rows(rows),
        "padding_target": PACKED_PADDING_TARGET,
        "padding_reached": reached(packed <= PACKED_PADDING_TARGET),
        "packed_padding": packed,
        "over_padded": rates["packed"] / rates["padded"],
        "over_grouped": rates["packed"] / rates["grouped"],
        "direction": ratio_phrase(rates["packed"], rates["grouped"]),
        "pairs_over_grouped": dense_ratio(training, "packed", "grouped"),
        "check": check,
        "document_lengths": ", ".join(str(n) for n in check["document_lengths"]),
    }
    return render("packing", values)

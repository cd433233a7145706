"""benchmarks/results/long_context.json -> its section of docs/results.md (the long-context markers).

The sentences are benchmarks/templates/long_context.md. Every number comes from the JSON
(`python -m benchmarks.long_context` writes it); the comparisons (which draft is ahead at the
longest context, whether τ rose or fell from the shortest to the longest) are computed here, never
written by hand. `python -m benchmarks.results_doc` calls `render`.
"""

from __future__ import annotations

from statistics import mean
from typing import Any

from benchmarks import doc_parts
from benchmarks.doc_parts import duration, number, ratio_phrase, table_rows

TEMPLATE = "long_context"
NAME = "long-context"
DRAFTS = ("short", "packed", "sliding")  # each one's description is its part of the template


def part(name: str, values: dict[str, Any] | None = None) -> str:
    return doc_parts.render(TEMPLATE, name, values)


def seed_taus(result: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """τ per draft and context length: one value per seed (each averaged over the decoded paths)."""
    lengths = result["evaluation"]["lengths"]
    taus: dict[str, dict[str, list[float]]] = {}
    for draft in DRAFTS:
        per_length = {}
        for length, entry in lengths.items():
            by_seed: dict[str, list[float]] = {}
            for name, summary in entry["paths"].items():
                run = name.split("/", 1)[0]
                if run.split("-seed")[0] == draft:
                    by_seed.setdefault(run, []).append(summary["mean_tau"])
            if by_seed:
                per_length[length] = [mean(values) for values in by_seed.values()]
        if per_length:
            taus[draft] = per_length
    return taus


def tau_by_draft(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Mean τ per draft (averaged over seeds and decoded paths) and context length."""
    return {
        draft: {length: mean(values) for length, values in per_length.items()}
        for draft, per_length in seed_taus(result).items()
    }


def tau_cell(values: list[float]) -> str:
    """The mean over seeds, and their range when there are several."""
    if len(values) == 1:
        return number(values[0], 3)
    return f"{number(mean(values), 3)} ({number(min(values), 3)}–{number(max(values), 3)})"


def acceptance_at(result: dict[str, Any], length: str) -> dict[str, list[float]]:
    """Per-position acceptance per draft at one length (averaged over seeds and paths)."""
    entry = result["evaluation"]["lengths"][length]
    out: dict[str, list[float]] = {}
    for draft in DRAFTS:
        rows = [s["per_position_acceptance"] for name, s in entry["paths"].items() if name.split("-seed")[0] == draft]
        if rows:
            out[draft] = [mean(column) for column in zip(*rows, strict=True)]
    return out


def _trend(first: float, last: float) -> str:
    return part("rises" if last > first else "falls" if last < first else "stays")


def comparisons(result: dict[str, Any], taus: dict[str, dict[str, float]], shortest: str, longest: str) -> list[str]:
    """One line per draft (τ from the shortest context to the longest), then the drafts against
    each other at the longest context and the figures' resolution."""
    lines = []
    for draft, per_length in taus.items():
        first, last = per_length[shortest], per_length[longest]
        values = {"draft": draft, "trend": _trend(first, last), "first": first, "last": last}
        lines.append(part("trend", values | {"shortest": shortest, "longest": longest}))
    if {"short", "packed"} <= taus.keys():
        packed, short = taus["packed"][longest], taus["short"][longest]
        values = {"longest": longest, "packed": packed, "short": short, "direction": ratio_phrase(packed, short)}
        lines.append(part("packed-against-short", values))
    if {"sliding", "packed"} <= taus.keys():
        sliding, packed = taus["sliding"][longest], taus["packed"][longest]
        values = {"longest": longest, "sliding": sliding, "packed": packed, "direction": ratio_phrase(sliding, packed)}
        lines.append(part("sliding-against-packed", values))
    evaluation = result["evaluation"]
    steps = [s["steps"] for e in evaluation["lengths"].values() for s in e["paths"].values() if s.get("steps")]
    if steps:
        values = {
            "prompts": evaluation["prompts_per_length"],
            "low": min(steps),
            "high": max(steps),
            "step": 1 / max(steps),
            "seeds": len(result["seeds"]),
        }
        lines.append(part("resolution", values))
    return lines


def acceptance_table(result: dict[str, Any], longest: str) -> str:
    acceptance = acceptance_at(result, longest)
    if not acceptance:
        return ""
    width = max(len(row) for row in acceptance.values())
    values = {
        "longest": longest,
        "positions": " | ".join(str(k) for k in range(1, width + 1)),
        "aligns": "|".join(["---:"] * width),
        "rows": table_rows([[draft, *(number(value) for value in row)] for draft, row in acceptance.items()]),
    }
    return part("acceptance", values)


def render(result: dict[str, Any]) -> str:
    budget, evaluation = result["budget"], result["evaluation"]
    taus, per_seed = tau_by_draft(result), seed_taus(result)
    lengths = [str(length) for length in evaluation["context_lengths"]]
    shortest, longest = lengths[0], lengths[-1]
    steps = {run["draft"]: run.get("optimizer_steps") for run in result["runs"]}
    train_seconds = {run["draft"]: run.get("seconds") for run in result["runs"]}
    measured = {
        "date": result["date"],
        "commit": result["commit"],
        "dirty": " " + part("dirty") if result.get("dirty") else "",
        "machine": result["machine"],
        "seconds": duration(result["seconds"]),
        "eval_seconds": duration(result["evaluation_seconds"]),
        "command": result["command"].strip(),
    }
    budget_values = {
        "budget": budget,
        "seeds": len(result["seeds"]),
        "seed_list": ", ".join(map(str, result["seeds"])),
        "steps": {draft: steps.get(draft) for draft in DRAFTS},
        "long_min": min(result["long_sample_tokens"]),
        "long_max": max(result["long_sample_tokens"]),
        "window": result["sliding_window"],
    }
    paths = sorted({name.split("/", 1)[1] for e in evaluation["lengths"].values() for name in e["paths"]})
    decoding = {
        "evaluation": evaluation,
        "text": evaluation["long_text"],
        "genres": ", ".join(evaluation["long_text"]["genres"]),
        "paths": ", ".join(paths),
    }
    rows = [
        [part("draft", {"draft": draft, "description": part(draft)}), number(train_seconds.get(draft), 0)]
        + [tau_cell(per_seed[draft][length]) if length in per_seed[draft] else "–" for length in lengths]
        for draft in taus
    ]
    several = len(result["seeds"]) > 1
    values = {
        "measured": part("measured", measured),
        "budget": part("budget", budget_values),
        "decoding": part("decoding", decoding),
        "length_headers": " | ".join(part("length-header", {"length": length}) for length in lengths),
        "length_aligns": "|".join(["---:"] * len(lengths)),
        "rows": table_rows(rows),
        "seeds_note": part("seeds-note", {"seeds": len(result["seeds"])}) if several else "",
        "comparisons": "\n".join(comparisons(result, taus, shortest, longest)),
        "note": part("note", {"note": result["note"]}) if result.get("note") else "",
        "acceptance": acceptance_table(result, longest),
    }
    return part("long-context", values)

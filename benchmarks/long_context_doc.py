"""benchmarks/results/long_context.json -> its section of docs/results.md (the long-context markers).

Every number comes from the JSON (`python -m benchmarks.long_context` writes it); the comparisons
(which draft is ahead at the longest context, whether τ rose or fell from the shortest to the
longest) are computed here, never written by hand. `python -m benchmarks.results_doc` calls
`render`.
"""

from __future__ import annotations

from statistics import mean
from typing import Any

from benchmarks.doc_parts import duration, fill, number, ratio_phrase, table

NAME = "long-context"
DESCRIPTIONS = {
    "short": "demo recipe: short samples, max_length 160",
    "packed": "long-context samples packed in 4,096-token rows",
    "sliding": "packed, every draft layer sliding",
}


def seed_taus(result: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """τ per draft and context length: one value per seed (each averaged over the decoded paths)."""
    lengths = result["evaluation"]["lengths"]
    taus: dict[str, dict[str, list[float]]] = {}
    for draft in DESCRIPTIONS:
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
    for draft in DESCRIPTIONS:
        rows = [s["per_position_acceptance"] for name, s in entry["paths"].items() if name.split("-seed")[0] == draft]
        if rows:
            out[draft] = [mean(column) for column in zip(*rows, strict=True)]
    return out


def _trend(first: float, last: float) -> str:
    return "rises" if last > first else "falls" if last < first else "stays"


def render(result: dict[str, Any]) -> str:
    budget, evaluation = result["budget"], result["evaluation"]
    taus, per_seed = tau_by_draft(result), seed_taus(result)
    lengths = [str(length) for length in evaluation["context_lengths"]]
    shortest, longest = lengths[0], lengths[-1]
    machine = result["machine"]
    steps = {run["draft"]: run.get("optimizer_steps") for run in result["runs"]}
    train_seconds = {run["draft"]: run.get("seconds") for run in result["runs"]}
    lines = [
        fill(
            "Measured on {date} at commit {commit}{dirty} on {cores} CPU cores (torch {torch}, {dtype}); "
            "{seconds} in all, {eval_seconds} of them decoding. Repeat with `{command}` "
            "(or `make bench-long-context`).",
            {
                "date": result["date"],
                "commit": result["commit"],
                "dirty": " (with uncommitted changes)" if result.get("dirty") else "",
                "cores": machine["cores"],
                "torch": machine["torch"],
                "dtype": machine["dtype"],
                "seconds": duration(result["seconds"]),
                "eval_seconds": duration(result["evaluation_seconds"]),
                "command": result["command"].strip(),
            },
        ),
        "",
        fill(
            "Budget, equal for the three drafts: the same {conversations} chitchat conversations with the target's own "
            "answers, {epochs} epochs, {anchors} anchors per conversation (packing gives each document its own), the "
            "demo recipe's objective and schedule; {seeds} training seed(s) ({seed_list}). Optimizer steps: short "
            "{short_steps} (4 conversations a step), packed {packed_steps} and sliding {sliding_steps} (one "
            "{row}-token row a step). The long samples are {long_min}–{long_max} tokens (a passage of other plays "
            "before the question); the sliding draft's window is {window} tokens.",
            {
                "conversations": budget["conversations"],
                "epochs": budget["epochs"],
                "anchors": budget["anchors_per_conversation"],
                "seeds": len(result["seeds"]),
                "seed_list": ", ".join(map(str, result["seeds"])),
                "short_steps": steps.get("short"),
                "packed_steps": steps.get("packed"),
                "sliding_steps": steps.get("sliding"),
                "row": budget["packed_row_tokens"],
                "long_min": min(result["long_sample_tokens"]),
                "long_max": max(result["long_sample_tokens"]),
                "window": result["sliding_window"],
            },
        ),
        "",
        fill(
            "Decoding: {prompts} prompt(s) per length, each a passage of {package} {version} ({genres}) then a "
            "held-out chitchat question, filled to the length minus {new} new tokens; greedy; path(s): {paths}.",
            {
                "prompts": evaluation["prompts_per_length"],
                "package": evaluation["long_text"]["package"],
                "version": evaluation["long_text"]["version"],
                "genres": ", ".join(evaluation["long_text"]["genres"]),
                "new": evaluation["max_new_tokens"],
                "paths": ", ".join(
                    sorted({name.split("/", 1)[1] for e in evaluation["lengths"].values() for name in e["paths"]})
                ),
            },
        ),
        "",
        *table(
            ["draft", "training seconds", *(f"τ at {length}" for length in lengths)],
            [
                [f"{draft} ({DESCRIPTIONS[draft]})", number(train_seconds.get(draft), 0)]
                + [tau_cell(per_seed[draft][length]) if length in per_seed[draft] else "–" for length in lengths]
                for draft in taus
            ],
            ["---", "---:", *["---:"] * len(lengths)],
        ),
        "",
    ]
    if len(result["seeds"]) > 1:
        lines += [f"Each τ is the mean over the {len(result['seeds'])} seeds (their lowest–highest in brackets).", ""]
    for draft, per_length in taus.items():
        first, last = per_length[shortest], per_length[longest]
        lines.append(
            f"- {draft}: τ {_trend(first, last)} from {first:.3f} at {shortest} tokens to {last:.3f} at {longest}."
        )
    if {"short", "packed"} <= taus.keys():
        packed, short = taus["packed"][longest], taus["short"][longest]
        lines.append(
            f"- At {longest} tokens packed's τ ({packed:.3f}) is {ratio_phrase(packed, short)} short's ({short:.3f})."
        )
    if {"sliding", "packed"} <= taus.keys():
        sliding, packed = taus["sliding"][longest], taus["packed"][longest]
        lines.append(
            f"- At {longest} tokens sliding's τ ({sliding:.3f}) is {ratio_phrase(sliding, packed)} "
            f"packed's ({packed:.3f})."
        )
    steps = [s["steps"] for e in evaluation["lengths"].values() for s in e["paths"].values() if s.get("steps")]
    if steps:
        lines.append(
            fill(
                "- Resolution: each τ above is {prompts} prompt(s) of {low}–{high} verification steps, so one more "
                "accepted token moves it by about {step:.3f}; differences of a few such steps, with {seeds} seed(s), "
                "do not rank the drafts.",
                {
                    "prompts": evaluation["prompts_per_length"],
                    "low": min(steps),
                    "high": max(steps),
                    "step": 1 / max(steps) if len(steps) else 0.0,
                    "seeds": len(result["seeds"]),
                },
            )
        )
    if result.get("note"):
        lines += ["", f"Note: {result['note']}"]
    acceptance = acceptance_at(result, longest)
    if acceptance:
        width = max(len(row) for row in acceptance.values())
        lines += [
            "",
            f"Per-position acceptance at {longest} tokens (P(draft position k accepted)):",
            "",
            *table(
                ["draft", *(str(k) for k in range(1, width + 1))],
                [[draft, *(number(value) for value in row)] for draft, row in acceptance.items()],
                ["---", *["---:"] * width],
            ),
        ]
    return "\n".join(lines)

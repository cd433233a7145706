"""benchmarks/results/demo.json and compare.json -> their sections of docs/results.md.

The sentences are benchmarks/templates/demo.md; this module computes what fills them, including
every comparison (which path is ahead, whether the gap splits one way or another), from the same
figures the sentences quote.
"""

from __future__ import annotations

from typing import Any

from benchmarks import doc_parts
from benchmarks.doc_parts import duration, number, ratio_phrase, table_rows

TEMPLATE = "demo"
PATH_LABELS = {
    "untrained/unary": "untrained draft, unary",
    "untrained/selector": "untrained draft, selector walk",
    "trained/selector": "trained draft, selector walk",
    "trained/unary": "trained draft, unary argmax",
}
BENCHMARK_LABELS = {"heldout": "held-out chat", "humaneval": "HumanEval"}
GAP_PATHS = ("selector", "unary")
# the τ rows of the τ-gap table, (a) to (d): the key each is read from
TAU_GAP_ROWS = (
    ("a", "real_tau"),
    ("b", "teacher_forced_tau_at_real_anchors"),
    ("c", "teacher_forced_tau_all_anchors"),
    ("d", "training_eval"),
)


def render(part: str, values: dict[str, Any] | None = None) -> str:
    return doc_parts.render(TEMPLATE, part, values)


def objective_phrase(kd_weight: float | None) -> str:
    if not kd_weight:
        return render("objective-ce")
    if kd_weight == 0.5:
        return render("objective-half")
    if kd_weight == 1:
        return render("objective-kd")
    return render("objective-mix", {"ce": 1 - kd_weight, "kd": kd_weight})


def sampling(temperature: float) -> str:
    return render("greedy") if temperature == 0 else render("temperature", {"temperature": temperature})


def dirty(result: dict[str, Any]) -> str:
    return " " + render("dirty") if result.get("dirty") else ""


def provenance(demo: dict[str, Any]) -> str:
    machine = demo["machine"]
    where = render("machine", {**machine, "device": "" if machine["device"] == "cpu" else f", {machine['device']}"})
    values = {"date": demo["date"], "commit": demo["commit"], "dirty": dirty(demo), "where": where}
    if demo["ran_commands"]:
        cache = render("cache-empty" if demo["cache"] == "empty" else "cache-reused")
        return render("provenance-ran", values | {"cache": cache})
    return render("provenance-collected", values)


def command_label(command: str) -> str:
    """A timed command as a reader would type it: the virtualenv's path and `python` dropped
    (`.venv/bin/python -m benchmarks.x` -> `-m benchmarks.x`, `.venv/bin/dflash2 x` -> `dflash2 x`)."""
    program, _, rest = command.partition(" ")
    program = program.rsplit("/", 1)[-1]
    return rest if program.startswith("python") and rest else f"{program} {rest}".strip()


def command_rows(demo: dict[str, Any]) -> list[str]:
    commands = demo.get("commands")
    if not commands:
        return render("commands-missing").splitlines()
    rows = [[f"`{command_label(entry['command'])}`", duration(entry["seconds"])] for entry in commands]
    total = duration(sum(entry["seconds"] for entry in commands))
    return render("commands", {"rows": table_rows(rows), "total": total}).splitlines()


def training_sentence(demo: dict[str, Any]) -> str:
    training = demo["training"]
    evaluations = training["evaluations"]
    values = {
        "runtime": duration(training["train_runtime_seconds"]),
        "steps": training["steps"],
        "per_step": number(training["seconds_per_step"]),
        "evaluations": len(evaluations),
        "eval_seconds": number(sum(e["seconds"] for e in evaluations) / len(evaluations), 0) if evaluations else None,
        "batch": training["batch_size"],
        "anchors": training["num_anchors"],
        "samples": training["train_samples"],
        "objective": objective_phrase(training["kd_weight"]),
        "kd": "null" if training["kd_weight"] is None else training["kd_weight"],  # a recipe value, never unmeasured
    }
    return render("training", values)


TEACHER_FORCED_DIGITS = {"loss": 2, "accuracy": 3, "tau_unary": 2, "tau_walk": 2, "tau_oracle": 2, "coverage": 3}


def teacher_forced_table(demo: dict[str, Any]) -> list[str]:
    forced = demo["teacher_forced"]

    def formatted(figures: dict[str, float]) -> dict[str, str | None]:
        return {key: number(figures.get(key), digits) for key, digits in TEACHER_FORCED_DIGITS.items()}

    values = {
        "objective": objective_phrase(demo["training"]["kd_weight"]),
        "untrained": formatted(forced.get("untrained", {})),
        "trained": formatted(forced.get("trained", {})),
    }
    return render("teacher-forced", values).splitlines()


def speculative_rows(report: dict[str, Any], benchmark: str | None = None) -> list[list[str | None]]:
    """Target alone, then each path: (benchmark,) label, mean τ, tokens/s, speed-up (, acceptance)."""
    prefix = [BENCHMARK_LABELS.get(benchmark, benchmark)] if benchmark else []
    target = [*prefix, render("target-alone"), "1.000", f"{report['target_tokens_per_second']:.1f}", "1.00×"]
    rows = [target + ([""] if benchmark else [])]
    for name, path in report["paths"].items():
        row = [
            *prefix,
            PATH_LABELS.get(name, name),
            f"{path['mean_tau']:.3f}",
            f"{path['tokens_per_second']:.1f}",
            f"{path['speedup']:.2f}×",
        ]
        if benchmark:
            row.append(" / ".join(f"{p:.2f}" for p in path["per_position_acceptance"][:3]))
        rows.append(row)
    return rows


def lossless_sentence(reports: list[dict[str, Any]]) -> str:
    differing = [
        f"{BENCHMARK_LABELS.get(report['benchmark'], report['benchmark'])} {name}"
        for report in reports
        for name, path in report["paths"].items()
        if not path["matches_target"]
    ]
    if not differing:
        return render("lossless")
    return render("not-lossless", {"paths": ", ".join(differing)})


def spec_tau_sentence(demo: dict[str, Any]) -> str:
    history = demo["training"]["eval_spec_tau"]
    if not history:
        return render("no-spec-tau")
    steps = [str(entry["step"]) for entry in history]
    values = {
        "prompts": demo["training"]["spec_eval_prompts"],
        "taus": " → ".join(f"{entry['tau']:.2f}" for entry in history),
        "steps": ", ".join(steps[:-1]) + f" and {steps[-1]}" if len(steps) > 1 else steps[0],
    }
    return render("spec-tau", values)


def _gap_value(gap: dict[str, Any], path: str, key: str) -> float | None:
    entry = gap["paths"].get(path)
    if entry is None:
        return None
    if key == "training_eval":
        return (gap.get("training_eval") or {}).get(entry["mode"])
    return entry[key]


def steps_of(entry: dict[str, Any], kind: str = "steps") -> str:
    """How many of a path's steps (or whole blocks) teacher-forced and real acceptance agree on."""
    return render("steps-of", {"same": entry[f"same_{kind}"], "steps": entry[kind]})


def tau_gap_table(gap: dict[str, Any] | None) -> list[str]:
    if gap is None:
        return render("tau-gap-missing").splitlines()
    values: dict[str, dict[str, str | None]] = {
        key: {path: number(_gap_value(gap, path, key), 3) for path in GAP_PATHS} for _, key in TAU_GAP_ROWS
    }
    cut = "teacher_forced_tau_at_real_anchors_cut_like_decoding"
    values["teacher_forced_tau_at_real_anchors"] = {
        path: None if cell is None else f"{cell} ({gap['paths'][path][cut]:.3f})"
        for path, cell in values["teacher_forced_tau_at_real_anchors"].items()
    }
    values["same"] = {path: steps_of(gap["paths"][path]) if path in gap["paths"] else None for path in GAP_PATHS}
    return render("tau-gap", values).splitlines()


def agreement_sentence(gap: dict[str, Any]) -> str:
    """Whether teacher-forced and real acceptance agree at the visited anchors, computed."""
    paths = "; ".join(render("agreement-path", {"path": path, "entry": entry}) for path, entry in gap["paths"].items())
    entries = gap["paths"].values()
    differing = sum(entry["steps"] - entry["same_steps"] for entry in entries)
    if not differing:
        tail = render("agreement-every-step")
    elif all(entry["same_whole_steps"] == entry["whole_steps"] for entry in entries):
        tail = render("agreement-whole-blocks", {"differing": differing})
    else:
        tail = render("agreement-not-whole-blocks")
    return render("agreement", {"paths": paths, "tail": tail})


def decomposition_sentence(gap: dict[str, Any]) -> str:
    """The (d) − (a) gap split into anchor selection, (c) − (a), and prompts, (d) − (c)."""
    pieces = []
    for path in GAP_PATHS:
        a, c, d = (
            _gap_value(gap, path, key) for key in ("real_tau", "teacher_forced_tau_all_anchors", "training_eval")
        )
        if None in (a, c, d):
            continue
        pieces.append((path, c - a, d - c))
    if not pieces:
        return ""
    values = {
        "names": " / ".join(path for path, _, _ in pieces),
        "selection": " / ".join(f"{s:.2f}" for _, s, _ in pieces),
        "prompts": " / ".join(f"{p:.2f}" for _, _, p in pieces),
    }
    return render("decomposition", values)


def columns_sentence(gap: dict[str, Any]) -> str:
    """Which τ rows the selector walk is above the unary argmax in, computed."""
    above = []
    for letter, key in TAU_GAP_ROWS:
        walk, unary = _gap_value(gap, "selector", key), _gap_value(gap, "unary", key)
        if walk is not None and unary is not None and walk > unary:
            above.append(f"({letter})")
    if len(above) == len(TAU_GAP_ROWS):
        return render("columns-all")
    if not above:
        return render("columns-none")
    return render("columns-some", {"rows": ", ".join(above)})


def all_prompts_sentence(gap: dict[str, Any] | None) -> str:
    if gap is None:
        return render("all-prompts-missing")

    def across(key: str) -> str:
        return " / ".join(number(_gap_value(gap, p, key), 3) or doc_parts.NOT_MEASURED for p in gap["paths"])

    values = {
        "prompts": gap["prompts"],
        "tokens": gap["max_new_tokens"],
        "c": across("teacher_forced_tau_all_anchors"),
        "d": across("training_eval"),
        "a": " / ".join(f"{e['real_tau']:.3f}" for e in gap["paths"].values()),
        "same": " / ".join(steps_of(e) for e in gap["paths"].values()),
        "whole": " / ".join(steps_of(e, "whole_steps") for e in gap["paths"].values()),
        "names": " / ".join(gap["paths"]),
    }
    return render("all-prompts", values)


def cost_sentence(demo: dict[str, Any]) -> str:
    """A step's cost in target steps, read off the untrained draft (τ 1: all cost, no gain)."""
    heldout = demo["speculative"]["heldout"] or {}
    untrained = heldout.get("paths", {}).get("untrained/unary")
    if not untrained or not untrained["speedup"]:
        return ""
    faster = [
        render(
            "faster-path",
            {
                "benchmark": BENCHMARK_LABELS.get(report["benchmark"], report["benchmark"]),
                "label": PATH_LABELS.get(name, name),
                "speedup": path["speedup"],
            },
        )
        for report in demo["speculative"].values()
        if report
        for name, path in report["paths"].items()
        if path["speedup"] > 1
    ]
    verdict = render("faster", {"paths": ", ".join(faster)}) if faster else render("none-faster")
    values = {
        "verdict": verdict,
        "cores": demo["machine"]["cores"],
        "block": demo["training"]["block_size"],
        "cost": 1 / untrained["speedup"],
        "untrained": untrained,
    }
    return render("cost", values)


def real_against_forced(demo: dict[str, Any]) -> str:
    """Real τ of the served path against the teacher-forced walk, the direction computed."""
    heldout = demo["speculative"]["heldout"] or {}
    real = heldout.get("paths", {}).get("trained/selector", {}).get("mean_tau")
    forced = demo["teacher_forced"].get("trained", {}).get("tau_walk")
    if real is None or forced is None:
        return ""
    return render("real-against-forced", {"real": real, "forced": forced, "direction": ratio_phrase(real, forced)})


def speculative_table(heldout: dict[str, Any] | None) -> str:
    if not heldout:
        return ""
    values = {
        "prompts": heldout["prompts"],
        "tokens": heldout["max_new_tokens"],
        "sampling": sampling(heldout["temperature"]),
        "rows": table_rows(speculative_rows(heldout)),
    }
    return render("speculative", values)


def render_demo(demo: dict[str, Any]) -> str:
    """The demo section of docs/results.md: provenance, timings, training, the three tables, τ-gap."""
    heldout, gap = demo["speculative"]["heldout"], demo["tau_gap"]
    decoding = [lossless_sentence([heldout]) if heldout else "", spec_tau_sentence(demo), render("bonus-token")]
    size = " " + render("tau-gap-size", {"prompts": gap["prompts"], "tokens": gap["max_new_tokens"]}) if gap else ""
    intro = [real_against_forced(demo), render("tau-gap-intro", {"size": size})]
    sentences = [agreement_sentence(gap), decomposition_sentence(gap), columns_sentence(gap)] if gap else []
    values = {
        "provenance": provenance(demo),
        "commands": "\n".join(command_rows(demo)),
        "training": training_sentence(demo),
        "teacher_forced": "\n".join(teacher_forced_table(demo)),
        "speculative": speculative_table(heldout),
        "decoding": " ".join(s for s in decoding if s),
        "tau_gap_intro": " ".join(s for s in intro if s),
        "tau_gap_table": "\n".join(tau_gap_table(gap)),
        "tau_gap_sentences": " ".join(s for s in sentences if s),
        "all_prompts": all_prompts_sentence(demo.get("tau_gap_all_prompts")),
        "cost": cost_sentence(demo),
    }
    return render("demo", values)


def render_acceptance(demo: dict[str, Any]) -> str:
    """The acceptance table of both benchmarks and the sentences read off it."""
    reports = [report for report in demo["speculative"].values() if report]
    if not reports:
        return render("acceptance-missing")
    intro = {
        "cores": demo["machine"]["cores"],
        "dtype": demo["machine"]["dtype"],
        "sampling": sampling(reports[0]["temperature"]),
        "tokens": " / ".join(sorted({str(r["max_new_tokens"]) for r in reports})),
        "prompts": " / ".join(sorted({str(r["prompts"]) for r in reports})),
        "lossless": lossless_sentence(reports),
    }
    values = {
        "intro": render("acceptance-intro", intro),
        "rows": table_rows([row for report in reports for row in speculative_rows(report, report["benchmark"])]),
        "code": "",
        "in_domain": "",
    }
    heldout, humaneval = demo["speculative"].get("heldout"), demo["speculative"].get("humaneval")
    if humaneval and "trained/selector" in humaneval["paths"]:
        code = {
            "code_tau": humaneval["paths"]["trained/selector"]["mean_tau"],
            "steps": demo["training"]["steps"],
            "samples": demo["training"]["train_samples"],
        }
        values["code"] = render("code", code)
    if heldout and {"trained/selector", "trained/unary"} <= set(heldout["paths"]):
        walk, unary = (heldout["paths"][name]["mean_tau"] for name in ("trained/selector", "trained/unary"))
        in_domain = {"direction": ratio_phrase(walk, unary), "difference": abs(walk - unary), "walk": walk}
        values["in_domain"] = render("in-domain", in_domain | {"unary": unary})
    return render("acceptance", values)


def comparison_module() -> Any:
    """The module that writes comparison.json, whose table and verdict are rendered with its own code:
    benchmarks/compare.py (behind `make compare`)."""
    from benchmarks import compare

    return compare


def render_compare(comparison: dict[str, Any]) -> str:
    """The comparison's own table and verdict from its comparison.json, and each recipe's τ and cost
    against the default recipe, computed."""
    compare_recipes = comparison_module()
    recipes = comparison["recipes"]
    default_name = compare_recipes.DEFAULT_RECIPE
    default = recipes.get(default_name)
    facts = []
    if default:
        key = compare_recipes.DECIDING_FIGURE
        for recipe, row in recipes.items():
            if recipe == default_name:
                continue
            tau = row[key]["mean"] - default[key]["mean"]
            flops = ""
            if "gflop_per_step" in row and "gflop_per_step" in default:
                flops = render("compare-flops", {"flops": row["gflop_per_step"] / default["gflop_per_step"] - 1})
            fact = {"recipe": recipe, "tau": row[key]["mean"], "difference": tau, "default": default_name}
            facts.append(render("compare-fact", fact | {"relative": tau / default[key]["mean"], "flops": flops}))
    values = {
        "table": compare_recipes.render_table(recipes).rstrip("\n"),
        "verdict": compare_recipes.verdict(recipes).rstrip("\n"),
        "facts": "\n".join(facts),
    }
    return render("compare", values)

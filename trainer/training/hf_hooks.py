"""The private transformers `Trainer` internals `DFlash2Trainer` relies on, in one place.

DFlash2Trainer overrides what HF documents for overriding (`compute_loss`, `get_batch_samples`,
`prediction_step`, `log`, `train`, `save_model`, `save_state`, `push_to_hub`,
`create_accelerator_and_postprocess`) and hands the rest to callbacks (`trainer.training.callbacks`).
Four jobs have no public hook and hang on private methods instead: staged checkpoints
(`_get_output_dir`, `_save_checkpoint`), draft-only pushes (`_push_from_checkpoint`), the non-finite
step check (`_get_grad_norm`) and regional compilation (`_build_accelerator_args`); the
Arrow-length sampler (`_get_train_sampler`)
is HF's sampler hook, private by name. Each is listed here with the call DFlash2Trainer makes (its
arguments are bound against the method's signature by `hook_problems`, run when a trainer is built,
so a renamed method or parameter is one clear error instead of a silently skipped hook), what it
is relied on for and why no public hook or callback does it (`why_private`). tests/unit/training/test_hf_hooks.py
runs a real tiny `Trainer` to check that transformers still calls each one as relied on (when,
with what, and what it does with the result).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import transformers
from transformers import Trainer


@dataclass(frozen=True)
class Hook:
    """A private Trainer method DFlash2Trainer overrides or calls, with a call of the shape it makes."""

    name: str
    relied_on_for: str
    why_private: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


HOOKS = (
    Hook(
        "_get_output_dir",
        "HF's _save_checkpoint takes its run folder from it (_get_output_dir(trial=trial)): overridden to return "
        "the staging folder while a checkpoint is saved, so checkpoint-N appears only when complete",
        "no callback runs before HF writes a checkpoint, and this is where HF reads the folder it writes into",
        kwargs={"trial": None},
    ),
    Hook(
        "_save_checkpoint",
        "writes <_get_output_dir()>/checkpoint-<global_step> (save_model(..., _internal_call=True), optimizer, "
        "scheduler, RNG, trainer_state.json) and calls _push_from_checkpoint; wrapped to stage and publish it",
        "on_save runs after the files are written under their final name; staging must wrap the write itself",
        args=(None, None),
    ),
    Hook(
        "_push_from_checkpoint",
        "called by _save_checkpoint when push_to_hub: overridden to do nothing (pushes are exports, never raw "
        "checkpoints)",
        "with push_to_hub HF uploads the raw checkpoint from inside _save_checkpoint; no argument turns that "
        "off while keeping push_to_hub",
        args=("checkpoint-1",),
    ),
    Hook(
        "_build_accelerator_args",
        "the Accelerator's arguments, as a dict with dynamo_plugin: replaced when the draft's layers are already "
        "compiled in place",
        "TrainingArguments cannot keep torch_compile for the layers yet stop accelerate compiling the whole model",
        kwargs={"gradient_accumulation_plugin": None},
    ),
    Hook(
        "_get_grad_norm",
        "called once per optimizer step, before optimizer.step, with the (clipped) norm as grad_norm: where the "
        "non-finite step check runs and a skipped step drops its gradients",
        "on_pre_optimizer_step runs at the same point but is not given the norm; recomputing it would be a "
        "second pass and collective per step",
        args=(None,),
        kwargs={"grad_norm": None},
    ),
    Hook(
        "_get_train_sampler",
        "returns the training sampler: for train_sampling_strategy group_by_length, overridden to hand HF's "
        "LengthGroupedSampler the lengths read from the Arrow column (HF would read every sample, features "
        "included)",
        "HF's sampler hook (get_train_dataloader calls it); only its name is private",
        args=(None,),
    ),
    Hook(
        "_prepare_inputs",
        "moves an evaluation batch to the device in prediction_step",
        "called, not overridden: HF's own prediction_step prepares its inputs the same way",
        args=({},),
    ),
    Hook(
        "save_model",
        "its private _internal_call=True marks a save from inside _save_checkpoint or push_to_hub (no push)",
        "HF's own saves pass it; it is the only way to tell them from a user's save (which may push)",
        args=("folder",),
        kwargs={"_internal_call": True},
    ),
)
# Attributes DFlash2Trainer reads: set by Trainer.__init__ (is_fsdp_enabled) or read by its training loop
# (loss_is_scaled_for_ga: the loss is already scaled for gradient accumulation, so HF must not divide it).
ATTRIBUTES = ("loss_is_scaled_for_ga",)
INSTANCE_ATTRIBUTES = ("is_fsdp_enabled",)


def hook_problems(trainer_class: type = Trainer) -> list[str]:
    """Each hook missing from `trainer_class`, or no longer accepting the call DFlash2Trainer makes."""
    problems = []
    for hook in HOOKS:
        method = getattr(trainer_class, hook.name, None)
        if not callable(method):
            problems.append(f"Trainer.{hook.name} is gone")
            continue
        try:
            inspect.signature(method).bind(None, *hook.args, **hook.kwargs)
        except TypeError as error:
            problems.append(f"Trainer.{hook.name}{inspect.signature(method)} no longer takes our call ({error})")
    problems += [f"Trainer.{name} is gone" for name in ATTRIBUTES if not hasattr(trainer_class, name)]
    return problems


def check_hooks(trainer_class: type = Trainer) -> None:
    """One error naming every hook this transformers version no longer offers as relied on."""
    problems = hook_problems(trainer_class)
    if problems:
        raise RuntimeError(
            f"DFlash2Trainer relies on transformers Trainer internals that transformers {transformers.__version__} "
            f"changed (trainer/training/hf_hooks.py): {'; '.join(problems)}"
        )

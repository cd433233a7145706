"""Resume refuses a changed run: the checkpoint's recorded recipe against the new one, before any weights load.

Every checkpoint holds `dflash2_recipe.json` (`Checkpointing.recipe_record`): the model, data and
training arguments, plus `resume_identity` (this module's `run_identity`): the effective draft
config, the target's fingerprint, a dataset fingerprint and the world size. On resume the new
run's record is compared with it field by field. Fields of these classes are refused, all in one
line `field old → new`, unless the recipe lists them in `resume_allow_changes`:

- model: every key of the effective draft config (`block_size`, `target_layer_ids`, widths,
  depths, `selector_top_k`, `selector_rank`, ...), `lora_*`, the `target` (its fingerprint: the
  source's content, never its path, its config and a few sampled rows of its embedding and LM
  head) and `target_dtype`;
- data: the `dataset` fingerprint (sample count and sampled rows of the tokenised training set)
  and the settings that change what is trained on (`max_length`, `packing`, `num_train_samples`,
  `num_eval_samples`, the generation settings, columns, split, `system_prompt`, ...);
- objective: every `ObjectiveConfig` field (`num_anchors`, `loss_type`, `gamma`, `kd_*`,
  `dpace_*`, `selector_*`);
- optimization: optimizer and its hyper-parameters, `learning_rate`, schedule and warmup,
  `max_grad_norm`, batch size, gradient accumulation, `world_size`, `seed` and `data_seed`.

Everything else (logging_*, eval_*, save_*, max_steps, report_to, output and logging dirs,
dataloader settings, spec_eval_*, push_to_hub / hub_*, cache_dir, paths whose content is
fingerprinted, ...) may change silently. An allowed `learning_rate` change takes effect
(`apply_learning_rate`): the scheduler's state would otherwise bring the old one back. A
schedule change (type, warmup) takes effect by itself: HF rebuilds the schedule from the new
arguments and restores only its step and base rates from the checkpoint.

A recorded recipe that is not a record this project wrote (`{}`, a list, a section or identity
value of the wrong type, no training arguments) would compare nothing and pass: it is a damaged
checkpoint (`recipe_problems`), skipped by `--resume_from_checkpoint true` and refused when named.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from trainer.fileio import DamagedFileError, read_json
from trainer.models.target import config_identity
from trainer.objective.config import ObjectiveConfig
from trainer.publishing.export import RECIPE_FILE

logger = logging.getLogger(__name__)

IDENTITY_KEY = "resume_identity"
DATASET_SAMPLE_ROWS = 64
TARGET_SAMPLE_ROWS = 8
# Draft config keys that say nothing about the model (bookkeeping and output switches).
DRAFT_CONFIG_IGNORED = frozenset(
    {
        "transformers_version",
        "architectures",
        "auto_map",
        "dtype",
        "torch_dtype",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "use_cache",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
    }
)
MODEL_FIELDS = ("target_dtype", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
DATA_FIELDS = (
    "dataset_split",
    "messages_column",
    "prompt_column",
    "regenerate",
    "num_train_samples",
    "num_eval_samples",
    "max_length",
    "packing",
    "max_new_tokens",
    "max_prompt_length",
    "generation_temperature",
    "generation_top_p",
    "regenerate_model",
    "system_prompt",
    "enable_thinking",
    "thinking_share",
)
# The objective's own fields (`ObjectiveConfig`, named alike in the recipe), but the loss head's
# chunking, which changes memory and not what is computed.
OBJECTIVE_FIELDS = tuple(field.name for field in fields(ObjectiveConfig) if field.name != "chunk_blocks")
OPTIMIZATION_FIELDS = (
    "optim",
    "optim_args",
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_ratio",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "data_seed",
)
IDENTITY_FIELDS = ("target", "dataset", "world_size")
RECIPE_FORMAT = "dflash2-hub recipe"
RECIPE_SECTIONS = ("model_arguments", "data_arguments", "training_arguments", IDENTITY_KEY)
# Target fingerprints from content (never the path) carry this prefix; an older record's (20 hex
# digits, no prefix) depended on the target's path and is not compared (it would refuse a moved target).
TARGET_SCHEME = "v2-"


# ---------------------------------------------------------------------------------------------
# What a run records about itself
# ---------------------------------------------------------------------------------------------


def draft_config_view(config: Any) -> dict[str, Any]:
    """The draft config's model-defining keys, with `dflash_config` flattened (`block_size`, ...)."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key == "dflash_config" and isinstance(value, dict):
            flat.update(value)
        elif not key.startswith("_") and key not in DRAFT_CONFIG_IGNORED:
            flat[key] = value
    return json.loads(json.dumps(flat, default=str))


def _sampled_rows(weight: torch.Tensor, count: int) -> bytes:
    """A few evenly spaced rows, as float32 bytes: exact and device-independent, unlike a sum."""
    rows = weight.shape[0]
    index = torch.linspace(0, rows - 1, steps=min(count, rows)).round().long().to(weight.device)
    return weight.detach().index_select(0, index).float().cpu().contiguous().numpy().tobytes()


def target_fingerprint(target: Any) -> str:
    """The target's identity: its source fingerprint (from its files' content), its config without
    where it was loaded from, and sampled embedding / head rows (a few kilobytes read, so another
    checkpoint of the same shapes is caught cheaply); the same bytes anywhere give the same value."""
    hasher = hashlib.sha256(str(target.fingerprint()).encode())
    hasher.update(json.dumps(config_identity(target.model.config), sort_keys=True, default=str).encode())
    hasher.update(_sampled_rows(target.embedding_weight, TARGET_SAMPLE_ROWS))
    hasher.update(_sampled_rows(target.lm_head.weight, TARGET_SAMPLE_ROWS))
    return TARGET_SCHEME + hasher.hexdigest()[:20]


def dataset_fingerprint(dataset: Any) -> str | None:
    """The training set's identity: its sample count and up to 64 evenly spaced samples' token ids
    and loss masks. Cheap at any size (no pass over the data) and stable across processes, unlike
    `datasets`' in-memory fingerprints; it catches another dataset, another tokenizer or template,
    another `max_length` or sample count, not a single edited token between sampled rows."""
    if dataset is None:
        return None
    tokens = getattr(dataset, "tokens", dataset)  # OfflineDataset: the token samples it joins features to
    try:
        size = len(tokens)
    except TypeError:  # an iterable dataset has no rows to sample
        return None
    hasher = hashlib.sha256(f"{size}|".encode())
    steps = min(size, DATASET_SAMPLE_ROWS)
    for index in sorted({round(i * (size - 1) / max(steps - 1, 1)) for i in range(steps)}):
        row = tokens[index]
        for column in ("input_ids", "loss_mask"):
            values = row.get(column) if isinstance(row, dict) else None
            if values is not None:
                hasher.update(torch.as_tensor(values, dtype=torch.int64).numpy().tobytes() + b"|")
    return hasher.hexdigest()[:20]


def run_identity(draft_config: Any, target: Any, dataset: Any, world_size: int) -> dict[str, Any]:
    """What `recipe_record` adds so that a resume can tell whether the model, target or data changed."""
    return {
        "draft_config": draft_config_view(draft_config),
        "target": target_fingerprint(target),
        "dataset": dataset_fingerprint(dataset),
        "world_size": world_size,
    }


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _path_dependent_target(identity: dict[str, Any]) -> bool:
    """Whether a recorded target fingerprint predates content fingerprints (it hashed the path)."""
    value = identity.get("target")
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{20}", value) is not None


def _compare(old: dict[str, Any], new: dict[str, Any], names: Iterable[str]) -> list[tuple[str, Any, Any]]:
    """(name, old, new) for each of `names` both records hold with different values."""
    return [(name, old[name], new[name]) for name in names if name in old and name in new and old[name] != new[name]]


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every refused-class field whose recorded value differs, in the order of the module docstring.
    A section or field the older record lacks is not compared (nothing to compare with)."""

    def section(record: dict[str, Any], key: str) -> dict[str, Any]:
        value = record.get(key)
        return value if isinstance(value, dict) else {}

    old_identity, new_identity = section(old, IDENTITY_KEY), section(new, IDENTITY_KEY)
    old_draft, new_draft = section(old_identity, "draft_config"), section(new_identity, "draft_config")
    changes = _compare(old_draft, new_draft, new_draft)
    changes += _compare(section(old, "model_arguments"), section(new, "model_arguments"), MODEL_FIELDS)
    if not _path_dependent_target(old_identity):
        changes += _compare(old_identity, new_identity, ("target",))
    changes += _compare(old_identity, new_identity, ("dataset",))
    changes += _compare(section(old, "data_arguments"), section(new, "data_arguments"), DATA_FIELDS)
    old_training, new_training = section(old, "training_arguments"), section(new, "training_arguments")
    changes += _compare(old_training, new_training, OBJECTIVE_FIELDS + OPTIMIZATION_FIELDS)
    changes += _compare(old_identity, new_identity, ("world_size",))
    return changes


def _short(value: Any, limit: int = 40) -> str:
    shown = json.dumps(value, default=str)
    return shown if len(shown) <= limit else shown[:limit] + "…"


def _json_kind(value: Any) -> str:
    return type(value).__name__.replace("dict", "object").replace("NoneType", "null")


def recipe_problems(record: Any) -> list[str]:
    """Why `record` cannot be a recipe record this project wrote (empty when it can be): every
    run records its training arguments (with `learning_rate`), each section is an object, and the
    resume identity's values have their types. Without this, `{}` or a list would compare nothing."""
    if not isinstance(record, dict):
        return [f"it holds a JSON {_json_kind(record)}, not a recipe record (an object)"]
    problems = []
    if "format" in record and record["format"] != RECIPE_FORMAT:
        problems.append(f"format is {_short(record['format'])}, not {RECIPE_FORMAT!r}")
    for key in RECIPE_SECTIONS:
        if key in record and not isinstance(record[key], dict):
            problems.append(f"{key} is a JSON {_json_kind(record[key])}, not an object")
    training = record.get("training_arguments")
    if isinstance(training, dict | type(None)) and "learning_rate" not in (training or {}):
        problems.append("it records no training_arguments with a learning_rate (every run records them)")
    elif isinstance(training, dict) and (
        isinstance(training["learning_rate"], bool) or not isinstance(training["learning_rate"], int | float)
    ):
        problems.append(f"training_arguments.learning_rate is {_short(training['learning_rate'])}, not a number")
    identity = record.get(IDENTITY_KEY)
    if isinstance(identity, dict):
        expected = {"draft_config": (dict,), "target": (str,), "dataset": (str, type(None)), "world_size": (int,)}
        for key, kinds in expected.items():
            value = identity.get(key)
            if key in identity and (not isinstance(value, kinds) or isinstance(value, bool)):
                problems.append(f"{IDENTITY_KEY}.{key} is {_short(value)}, a JSON {_json_kind(value)}")
        world_size = identity.get("world_size")
        if type(world_size) is int and world_size < 1:
            problems.append(f"{IDENTITY_KEY}.world_size is {world_size}, not a count of ranks")
    return problems


def recorded_recipe_problems(checkpoint: Path) -> list[str]:
    """`recipe_problems` of a checkpoint's `dflash2_recipe.json`, each naming the file (none when
    the file is absent: a checkpoint written before recipes were recorded)."""
    path = Path(checkpoint) / RECIPE_FILE
    if not path.is_file():
        return []
    try:
        record = read_json(path)
    except DamagedFileError as error:
        return [f"{RECIPE_FILE} {error.reason}"]
    except OSError as error:
        return [f"{RECIPE_FILE} cannot be read ({error.strerror or error})"]
    return [f"{RECIPE_FILE} is damaged: {problem}" for problem in recipe_problems(record)]


def read_recorded_recipe(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's recorded recipe, or None (with a warning) for a checkpoint written before
    recipes were recorded; an unreadable or damaged one (`recipe_problems`) is refused in one line
    naming the file: a damaged checkpoint, never a pass."""
    path = Path(checkpoint) / RECIPE_FILE
    if not path.is_file():
        logger.warning(
            "%s has no %s (written before dflash2-hub recorded recipes): resuming without checking that the "
            "draft config, target, data, objective and optimization are unchanged.",
            checkpoint,
            RECIPE_FILE,
        )
        return None
    record = read_json(path, "recorded recipe")
    problems = recipe_problems(record)
    if problems:
        raise DamagedFileError(
            path,
            "recorded recipe",
            f"is damaged ({'; '.join(problems)}): the checkpoint cannot be checked against this run; resume from "
            "an earlier checkpoint or train into a new output_dir",
        )
    return record


def check_unchanged(checkpoint: Path, new: dict[str, Any], allowed: Sequence[str] = ()) -> list[str]:
    """Refuse (ValueError, one line) a resume whose run changed a refused-class field not in
    `allowed`; returns the names of the allowed fields that did change (logged)."""
    old = read_recorded_recipe(checkpoint)
    if old is None:
        return []
    if _path_dependent_target(old.get(IDENTITY_KEY) or {}):
        logger.warning(
            "%s recorded its target by a fingerprint of its path (before dflash2-hub fingerprinted content): "
            "the target is not compared on this resume.",
            checkpoint,
        )
    changes = changed_fields(old, new)
    refused = [(name, before, after) for name, before, after in changes if name not in allowed]
    if refused:
        listed = ", ".join(f"{name} {_show(before)} → {_show(after)}" for name, before, after in refused)
        names = ", ".join(name for name, _, _ in refused)
        raise ValueError(
            f"resume from {checkpoint} refused: the run changed {listed} (set resume_allow_changes: [{names}] "
            "to resume anyway, or train into a new output_dir)"
        )
    for name, before, after in changes:
        logger.warning("Resuming from %s with %s changed (allowed): %s → %s", checkpoint, name, before, after)
    return [name for name, _, _ in changes]


def apply_learning_rate(optimizer: Any, scheduler: Any, learning_rate: float) -> None:
    """Make a changed learning rate take effect after the optimizer and scheduler states were
    loaded (they carry the old one): the scheduler's base rates and every group's current rate."""
    schedule = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper, if any
    if not isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
        raise ValueError(
            f"learning_rate changed on resume, but the {type(schedule).__name__} schedule keeps its own rates: "
            "it cannot take effect; resume with the old learning_rate or train into a new output_dir"
        )
    groups = optimizer.param_groups
    schedule.base_lrs = [learning_rate for _ in groups]
    for group, factor in zip(groups, schedule.lr_lambdas, strict=True):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * factor(schedule.last_epoch)
    schedule._last_lr = [group["lr"] for group in groups]

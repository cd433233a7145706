"""Argument dataclasses of `dflash2 train` (also `accelerate launch -m trainer train`) and YAML recipes.

A recipe is a flat YAML mapping whose keys are fields of `ModelArguments`, `DataArguments` and
`DFlashTrainingArguments` (a `transformers.TrainingArguments`); `--key value` flags after the
recipe path override it. Every value is converted to its field's type and checked against its declared
range (`RULES`) or refused naming the key as written (`trainer.recipe_types`): YAML alone reads `1e-3` as a
string and `"false"` stays a (truthy) string. A URL with credentials (`http://user:password@host`) is refused before
anything is recorded or logged: the endpoint's key goes in the environment (`DFLASH2_ENDPOINT_API_KEY`).
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser, TrainingArguments

from trainer.objective.config import OBJECTIVE_RULES, ObjectiveConfig, recipe_key
from trainer.publishing.hub_ids import check_hub_id, check_hub_id_if_remote
from trainer.recipe_files import read_recipe
from trainer.recipe_types import (
    Rule,
    above,
    at_least,
    between,
    check_fields,
    check_rule,
    convert,
    field_choices,
    field_types,
    one_of,
    quote,
    refuse_credentials,
)
from trainer.training.precision import post_init_without_device_checks

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelArguments:
    target: str = field(
        metadata={"help": "Target model: local dir, Hub id, a dir holding `target_gguf_file`, or pypi:<distribution>."}
    )
    draft_config: str | None = field(
        default=None, metadata={"help": "Draft config JSON (see hub_configs/); optional with a DFlash2 init_from."}
    )
    target_gguf_file: str | None = field(default=None, metadata={"help": "GGUF file name inside `target`."})
    target_hub_id: str | None = field(
        default=None, metadata={"help": "The target's Hub id, recorded as base_model in the exported model card."}
    )
    target_dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16 | float16"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa | eager | flex_attention"})
    target_sharding: str = field(
        default="none",
        metadata={
            "help": "none: every rank holds the whole frozen target; fsdp: FSDP2 shards its decoder layers "
            "across ranks (embedding and LM head stay whole on every rank).",
            "choices": ["none", "fsdp"],
        },
    )
    init_from: str | None = field(
        default=None, metadata={"help": "Warm start: a z-lab DFlash2 or DFlash v1 draft, or a dflash2-hub checkpoint."}
    )
    init_allow_block_size_change: bool = field(
        default=False, metadata={"help": "Allow init_from to have a different block size than the draft config."}
    )
    lora_r: int = field(default=0, metadata={"help": "LoRA rank on the draft's linear layers (0 = full fine-tuning)."})
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    def __post_init__(self):
        """Hub ids are refused where they are accepted: they land in the model card, its commands and URLs."""
        check_fields(self, RULES)
        if self.target_hub_id is not None:
            check_hub_id(self.target_hub_id, "target_hub_id")
        check_hub_id_if_remote(self.target, "target")
        check_hub_id_if_remote(self.init_from, "init_from")


@dataclass
class DataArguments:
    dataset: str = field(
        default="chitchat",
        metadata={"help": "'chitchat' (PyPI chitchat-dataset prompts), or a dataset dir / JSON(L) / Hub id."},
    )
    dataset_split: str = "train"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    regenerate: bool = field(
        default=True,
        metadata={"help": "Answer the prompts with the target (on-policy data) instead of using given responses."},
    )
    num_train_samples: int | None = None
    num_eval_samples: int = 0
    max_length: int = 2048
    packing: bool = field(
        default=False,
        metadata={
            "help": "Lay whole samples end to end in rows of up to max_length tokens, each document with its own "
            "positions, masks and anchors (docs/objective.md §10): no compute on padding."
        },
    )
    max_new_tokens: int = 256
    max_prompt_length: int = field(default=1024, metadata={"help": "Longer prompts are skipped (count logged)."})
    generation_temperature: float = 0.0
    generation_top_p: float = 1.0
    generation_batch_size: int = 16
    regenerate_endpoint: str | None = field(
        default=None,
        metadata={"help": "OpenAI-compatible base URL (vLLM / SGLang, e.g. http://host:8000/v1) that answers instead."},
    )
    regenerate_model: str | None = field(
        default=None, metadata={"help": "The target's served model name; unset: the one model the endpoint serves."}
    )
    regenerate_concurrency: int = field(default=64, metadata={"help": "Requests in flight to the endpoint."})
    regenerate_timeout: float = field(default=600.0, metadata={"help": "Seconds one endpoint request may take."})
    regenerate_max_retries: int = field(
        default=8, metadata={"help": "Retries of a request the endpoint fails (429, 5xx, timeouts), with backoff."}
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes for tokenising and filtering (datasets' num_proc); unset: one."}
    )
    system_prompt: str | None = None
    enable_thinking: bool | None = None
    thinking_share: float | None = field(
        default=None,
        metadata={
            "help": "Mix thinking on and off: this share of the conversations (0 to 1, chosen by a hash of each "
            "conversation) is rendered and answered with the template's thinking on, the others off; each sample "
            "records its switch (`enable_thinking` column). Instead of enable_thinking; a chat dataset's own "
            "`enable_thinking` column wins per row."
        },
    )
    offline: bool = field(
        default=False, metadata={"help": "Capture target hidden states once into a cache and train from disk."}
    )
    offline_dtype: str = "float32"
    feature_endpoint: list[str] | None = field(
        default=None,
        metadata={
            "help": "vLLM base URL(s) (http://host:8000/v1; a list: one per engine replica) serving the target "
            "with extract_hidden_states: the features come from them, streamed while training (offline: false; "
            "the training processes then load only the target's embedding and LM head) or stored first "
            "(offline: true). docs/your-own-target.md."
        },
    )
    feature_model: str | None = field(
        default=None, metadata={"help": "The target's served model name there; unset: the one model it serves."}
    )
    feature_concurrency: int = field(default=16, metadata={"help": "Feature requests in flight per server."})
    feature_prefetch: int = field(
        default=4,
        metadata={
            "help": "Streamed engine features (offline: false): micro-batches asked ahead of the one training, "
            "one data-loader process each; the server files on disk are bounded by this window."
        },
    )
    feature_timeout: float = field(default=600.0, metadata={"help": "Seconds one feature request may take."})
    feature_max_retries: int = field(default=8, metadata={"help": "Retries of a failed feature request."})
    feature_file_timeout: float = field(
        default=120.0, metadata={"help": "Seconds a finished request's hidden-state file may take to appear."}
    )
    feature_storage_path: list[str] | None = field(
        default=None,
        metadata={
            "help": "Required with feature_endpoint: the folder the server writes hidden-state files to (its "
            "shared_storage_path), as seen here (a list: one per endpoint, or one shared by all); files a reply "
            "names elsewhere are refused, never read or removed."
        },
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Cache root (default: $DFLASH2_CACHE or ~/.cache)."})


def _objective_arguments() -> type:
    """ObjectiveConfig's fields under their recipe keys, with the same defaults and help: the training
    arguments inherit them, so an objective knob is declared once, in `ObjectiveConfig`."""
    hints = typing.get_type_hints(ObjectiveConfig)
    declared = [
        (recipe_key(knob), hints[knob.name], field(default=knob.default, metadata={"help": knob.metadata["help"]}))
        for knob in fields(ObjectiveConfig)
    ]
    arguments = make_dataclass("ObjectiveArguments", declared)
    arguments.__module__ = __name__
    arguments.__doc__ = "The objective's knobs as recipe keys (derived from ObjectiveConfig; validated there)."
    return arguments


# made at import from the objective's fields, so mypy cannot see them: Any
ObjectiveArguments: Any = _objective_arguments()


@dataclass
class DFlashTrainingArguments(ObjectiveArguments, TrainingArguments):
    eval_num_anchors: int | None = field(
        default=None,
        metadata={"help": "Evaluation anchors per sequence, taken in order; unset: every valid position."},
    )
    spec_eval_prompts: int = field(
        default=0, metadata={"help": "Held-out prompts decoded for real at each evaluation (eval_spec_tau); 0 = off."}
    )
    spec_eval_max_new_tokens: int = 32
    skip_nonfinite_steps: int = field(
        default=0,
        metadata={
            "help": "Optimizer steps with a non-finite loss or gradient norm to skip (logged; the weights and "
            "optimizer state stay as they were) before the run stops; 0: the first one stops the run."
        },
    )
    resume_allow_changes: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Fields a resumed run may change although they change the model, data, objective or "
            "optimization (e.g. [learning_rate]); any other such change is refused (trainer.training.resume_check)."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace an earlier run's results in output_dir (its checkpoints, final draft, recipe, state, "
            "logs, reports) when training starts; without it such a folder is refused unless resumed "
            "(trainer.training.output_dir)."
        },
    )
    rank_stall_timeout: float = field(
        default=300.0,
        metadata={
            "help": "Seconds without a heartbeat from another rank's process (stopped, hung host, lost network) "
            "before the job stops with one line naming it (trainer.training.watchdog). The heartbeat is a thread, so a "
            "rank's long solo work (a checkpoint write, a first-step torch.compile) does not pause it; the "
            "margin covers a process starved by swapping or a long call holding the GIL. 0: off."
        },
    )
    remove_unused_columns: bool = field(default=False, metadata={"help": "Must stay False: batches carry masks."})

    def __post_init__(self):
        check_fields(self, RULES)  # before transformers derives values from them (eval_steps, warmup)
        post_init_without_device_checks(self, super().__post_init__)  # precision is applied at launch
        if self.remove_unused_columns:
            raise ValueError("remove_unused_columns must be False: the collator's loss_mask is not a forward argument.")
        if self.hub_model_id is not None:
            check_hub_id(self.hub_model_id, "hub_model_id")
        self.objective_config()  # validate early

    def objective_config(self) -> ObjectiveConfig:
        """The objective from its recipe keys (every ObjectiveConfig field; validated there)."""
        return ObjectiveConfig(**{knob.name: getattr(self, recipe_key(knob)) for knob in fields(ObjectiveConfig)})


ARGUMENT_CLASSES = (ModelArguments, DataArguments, DFlashTrainingArguments)
# Every numeric, dtype and mode field's range, by field name: checked where a recipe or flag value is read (naming
# the key the user wrote) and in ModelArguments' and DFlashTrainingArguments' __post_init__ (DataArguments built in
# code are checked against their dataset by trainer.data.dataset). Every int/float field this project declares has one
# (tests/unit/training/test_reliability_recipe.py); the TrainingArguments fields recipes use are listed too.
RULES: dict[str, Rule] = {
    # ModelArguments
    "target_dtype": one_of(*DTYPES),
    "attn_implementation": one_of("sdpa", "eager", "flex_attention"),
    "lora_r": at_least(0, "(0: full fine-tuning)"),
    "lora_alpha": above(0),
    "lora_dropout": between(0, 1, high_open=True),
    # DataArguments
    "num_train_samples": at_least(1),
    "num_eval_samples": at_least(0),
    "max_length": at_least(1),
    "max_new_tokens": at_least(1),
    "max_prompt_length": at_least(1),
    "thinking_share": between(0, 1),
    "generation_temperature": at_least(0, "(0: greedy)"),
    "generation_top_p": between(0, 1, low_open=True),
    "generation_batch_size": at_least(1),
    "regenerate_concurrency": at_least(1),
    "regenerate_timeout": above(0, "seconds"),
    "regenerate_max_retries": at_least(0),
    "dataset_num_proc": at_least(1),
    "offline_dtype": one_of(*DTYPES),
    "feature_concurrency": at_least(1),
    "feature_prefetch": at_least(1),
    "feature_timeout": above(0, "seconds"),
    "feature_max_retries": at_least(0),
    "feature_file_timeout": above(0, "seconds"),
    # the objective's knobs, under their recipe keys
    **{
        recipe_key(knob): OBJECTIVE_RULES[knob.name] for knob in fields(ObjectiveConfig) if knob.name in OBJECTIVE_RULES
    },
    # DFlashTrainingArguments
    "eval_num_anchors": at_least(1),
    "spec_eval_prompts": at_least(0, "(0: off)"),
    "spec_eval_max_new_tokens": at_least(1),
    "skip_nonfinite_steps": at_least(0),
    "rank_stall_timeout": at_least(0, "seconds (0: off)"),
    # TrainingArguments
    "per_device_train_batch_size": at_least(1),
    "per_device_eval_batch_size": at_least(1),
    "gradient_accumulation_steps": at_least(1),
    "eval_accumulation_steps": at_least(1),
    "num_train_epochs": above(0),
    "max_steps": at_least(-1, "(-1: num_train_epochs decides)"),
    "learning_rate": at_least(0),
    "warmup_steps": at_least(0, "(below 1: a share of the steps)"),
    "weight_decay": at_least(0),
    "adam_beta1": between(0, 1, high_open=True),
    "adam_beta2": between(0, 1, high_open=True),
    "adam_epsilon": at_least(0),
    "max_grad_norm": at_least(0, "(0: no clipping)"),
    "label_smoothing_factor": between(0, 1, high_open=True),
    "logging_steps": above(0, "(below 1: a share of the steps)"),
    "eval_steps": above(0, "(below 1: a share of the steps)"),
    "save_steps": above(0, "(below 1: a share of the steps)"),
    "eval_delay": at_least(0),
    "save_total_limit": at_least(0, "(0: keep every checkpoint)"),
    "seed": between(0, 2**32 - 1),
    "data_seed": between(0, 2**32 - 1),
    "dataloader_num_workers": at_least(0),
    "dataloader_prefetch_factor": at_least(1),
    "torch_empty_cache_steps": at_least(1),
    "ddp_timeout": at_least(1, "seconds"),
    "ddp_bucket_cap_mb": at_least(1),
}
NULL_WORDS = frozenset({"null", "Null", "NULL", "~"})
# Fields TrainingArguments declares `str | None` but also takes true for: resume_from_checkpoint (Trainer.train and
# DFlash2Trainer: the newest checkpoint in output_dir) and fsdp (its help asks for `--fsdp` / `fsdp=True`).
TYPE_OVERRIDES = {"resume_from_checkpoint": str | bool | None, "fsdp": str | bool | None}
# The endpoint's names for the generation settings, which are one setting whichever way the target
# answers (in process or through regenerate_endpoint): read as the field they name.
KEY_ALIASES = {
    "regenerate_max_tokens": "max_new_tokens",
    "regenerate_temperature": "generation_temperature",
    "regenerate_top_p": "generation_top_p",
}


def _canonical(values: dict[str, Any], source: str) -> dict[str, tuple[str, Any]]:
    """Each field's (key as written, value), with KEY_ALIASES read as the fields they name; both spellings at once
    are refused. The written key is kept so that errors name what the user wrote."""
    resolved: dict[str, tuple[str, Any]] = {}
    for key, value in values.items():
        name = KEY_ALIASES.get(key, key)
        if name in resolved:
            first, second = (key, resolved[name][0]) if key in KEY_ALIASES else (resolved[name][0], key)
            raise ValueError(f"{source} sets both {first} and {second}, which are the same setting: keep one")
        resolved[name] = (key, value)
    return resolved


def _overrides(flags: list[str]) -> dict[str, Any]:
    """`--key value` (read as YAML), `--key=value`, `--key v1 v2` (a list) and a bare `--flag` (true)."""
    values: dict[str, Any] = {}
    index = 0
    while index < len(flags):
        if not flags[index].startswith("--"):
            raise ValueError(f"expected --key, got {quote(flags[index])}")
        key, equals, text = flags[index][2:].partition("=")
        index += 1
        texts = [text] if equals else []
        while not equals and index < len(flags) and not flags[index].startswith("--"):
            texts.append(flags[index])
            index += 1
        values[key.replace("-", "_")] = _flag_values(texts)
    return values


def _flag_values(texts: list[str]) -> Any:
    """No text is a bare `--flag` (true), one is a value, more are a list (HfArgumentParser's `nargs="+"`)."""
    if not texts:
        return True
    values = [_flag_value(text) for text in texts]
    return values[0] if len(values) == 1 else values


def _flag_value(text: str) -> Any:
    """A flag's text read as a YAML scalar or flow collection (`1e-4`, `null`, `[a, b]`); text that YAML would make
    a mapping, a comment or an error of (`--system_prompt "Note: be brief"`) is kept as it is."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if value is None and text.strip() not in NULL_WORDS:
        return text
    if isinstance(value, (dict, list)) and not text.lstrip().startswith(("{", "[")):
        return text
    return value


def _negations(flags: dict[str, Any], hints: dict[str, Any]) -> dict[str, Any]:
    """HfArgumentParser's bare `--no_<field>` (listed by --help) sets the field to false."""
    resolved: dict[str, Any] = {}
    for key, value in flags.items():
        negated = key.startswith("no_") and key not in hints and key[3:] in hints and value is True
        resolved[key[3:] if negated else key] = False if negated else value
    return resolved


def _typed(values: dict[str, tuple[str, Any]], hints: dict[str, Any], source: str, prefix: str) -> dict[str, Any]:
    """Every value converted to its field's type and checked against its rule (`RULES`), named by the key as written;
    unknown keys refused (with the nearest field name), and so is a URL with credentials, before any of it is
    echoed."""
    for key, value in values.values():
        refuse_credentials(value, f"{source} {prefix}{_written(key)}")
    unknown = [key for name, (key, _) in values.items() if name not in hints]
    if unknown:
        raise ValueError(
            "; ".join(f"unknown {source} {prefix}{_written(key)}{_did_you_mean(key, hints, prefix)}" for key in unknown)
        )
    choices = field_choices(ARGUMENT_CLASSES)
    typed = {}
    for name, (key, value) in values.items():
        typed[name] = convert(value, hints[name], f"{source} {prefix}{key}", choices.get(name, ()))
        check_rule(typed[name], key, RULES.get(name))
    return typed


def _written(key: Any) -> str:
    """A key as an error names it: a short prefix, without a URL's credentials."""
    return quote(str(key))[1:-1]


def _did_you_mean(key: Any, hints: dict[str, Any], prefix: str) -> str:
    close = difflib.get_close_matches(str(key), list(hints), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _build(values: dict[str, Any]) -> tuple[Any, ...]:
    """The three dataclasses from typed values; a missing required field is a ValueError, not a TypeError."""
    missing = [
        f.name
        for cls in ARGUMENT_CLASSES
        for f in fields(cls)
        if f.init and f.default is MISSING and f.default_factory is MISSING and f.name not in values
    ]
    if missing:
        raise ValueError(f"missing required argument(s): {', '.join(missing)}")
    return tuple(
        cls(**{f.name: values[f.name] for f in fields(cls) if f.init and f.name in values}) for cls in ARGUMENT_CLASSES
    )


def parse_arguments(argv: list[str], default_recipe: Path | None = None):
    """(model, data, training) arguments from a YAML recipe (+ `--key value` overrides), or from flags alone.

    Both go through the same conversion of every value to its field's type and range check
    (`trainer.recipe_types`), named by the key the user wrote.
    """
    if not argv and default_recipe is not None:
        argv = [str(default_recipe)]
    if "-h" in argv or "--help" in argv:
        HfArgumentParser(ARGUMENT_CLASSES).print_help()  # type: ignore[arg-type]  # (DataClassType is a Protocol)
        raise SystemExit(0)
    recipe: dict[str, Any] = {}
    if argv and argv[0].endswith((".yaml", ".yml")):
        recipe, argv = read_recipe(argv[0]), argv[1:]
    hints = field_types(ARGUMENT_CLASSES) | TYPE_OVERRIDES
    values = _typed(_canonical(recipe, "the recipe"), hints, "recipe field", "")
    flags = _canonical(_negations(_overrides(argv), hints), "the command line")
    values.update(_typed(flags, hints, "argument", "--"))
    return _build(values)

"""Argument dataclasses of `examples/train.py` and YAML recipes.

A recipe is a flat YAML mapping whose keys are fields of `ModelArguments`, `DataArguments` and
`DFlashTrainingArguments` (a `transformers.TrainingArguments`); `--key value` flags after the
recipe path override it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser, TrainingArguments

from trainer.objective import ObjectiveConfig


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
    max_new_tokens: int = 256
    max_prompt_length: int = field(default=1024, metadata={"help": "Longer prompts are skipped (count logged)."})
    generation_temperature: float = 0.0
    generation_top_p: float = 1.0
    generation_batch_size: int = 16
    system_prompt: str | None = None
    enable_thinking: bool | None = None
    offline: bool = field(
        default=False, metadata={"help": "Capture target hidden states once into a cache and train from disk."}
    )
    offline_dtype: str = "float32"
    cache_dir: str | None = field(default=None, metadata={"help": "Cache root (default: $DFLASH2_CACHE or ~/.cache)."})


@dataclass
class DFlashTrainingArguments(TrainingArguments):
    num_anchors: int = field(default=512, metadata={"help": "Anchor (block) slots per sequence."})
    eval_num_anchors: int | None = field(
        default=None,
        metadata={"help": "Evaluation anchors per sequence, taken in order; unset: every valid position."},
    )
    loss_type: str = field(default="ce", metadata={"help": "ce | dpace"})
    gamma: float | None = field(default=None, metadata={"help": "Decay; unset: 7 for B=16, 4 for B=8; 0: off."})
    dpace_alpha: float = 0.5
    dpace_weighting: str = "full"
    loss_chunk_blocks: int = field(
        default=16, metadata={"help": "Blocks per LM-head chunk: one chunk of logits is the loss head's peak memory."}
    )
    selector_alpha: float = 1.0
    selector_warmup_ratio: float = 0.0
    selector_ramp_ratio: float = 0.0
    selector_gold: str = field(default="skip", metadata={"help": "skip | insert"})
    selector_stop_gradient: bool = False
    spec_eval_prompts: int = field(
        default=0, metadata={"help": "Held-out prompts decoded for real at each evaluation (eval_spec_tau); 0 = off."}
    )
    spec_eval_max_new_tokens: int = 32
    remove_unused_columns: bool = field(default=False, metadata={"help": "Must stay False: batches carry masks."})

    def __post_init__(self):
        super().__post_init__()
        if self.remove_unused_columns:
            raise ValueError("remove_unused_columns must be False: the collator's loss_mask is not a forward argument.")
        self.objective_config()  # validate early

    def objective_config(self) -> ObjectiveConfig:
        return ObjectiveConfig(
            num_anchors=self.num_anchors,
            loss_type=self.loss_type,
            gamma=self.gamma,
            dpace_alpha=self.dpace_alpha,
            dpace_weighting=self.dpace_weighting,
            chunk_blocks=self.loss_chunk_blocks,
            selector_alpha=self.selector_alpha,
            selector_warmup_ratio=self.selector_warmup_ratio,
            selector_ramp_ratio=self.selector_ramp_ratio,
            selector_gold=self.selector_gold,
            selector_stop_gradient=self.selector_stop_gradient,
        )


ARGUMENT_CLASSES = (ModelArguments, DataArguments, DFlashTrainingArguments)


def _overrides(flags: list[str]) -> dict[str, Any]:
    """`--key value` pairs (values read as YAML scalars) and bare `--flag` as true."""
    values: dict[str, Any] = {}
    index = 0
    while index < len(flags):
        key = flags[index]
        if not key.startswith("--"):
            raise ValueError(f"expected --key after the recipe, got {key!r}")
        key = key[2:].replace("-", "_")
        if index + 1 < len(flags) and not flags[index + 1].startswith("--"):
            values[key] = yaml.safe_load(flags[index + 1])
            index += 2
        else:
            values[key] = True
            index += 1
    return values


def parse_arguments(argv: list[str], default_recipe: Path | None = None):
    """(model, data, training) arguments from a YAML recipe (+ overrides), or from flags alone."""
    parser = HfArgumentParser(ARGUMENT_CLASSES)
    if not argv and default_recipe is not None:
        argv = [str(default_recipe)]
    if argv and argv[0].endswith((".yaml", ".yml")):
        recipe = yaml.safe_load(Path(argv[0]).read_text()) or {}
        if not isinstance(recipe, dict):
            raise ValueError(f"recipe {argv[0]} must be a YAML mapping of argument names to values")
        recipe.update(_overrides(argv[1:]))
        return parser.parse_dict(recipe, allow_extra_keys=False)
    return parser.parse_args_into_dataclasses(args=argv)

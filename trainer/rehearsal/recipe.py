"""The rehearsal's recipe and accelerate config: the user's, with only what must change on this
machine changed, each change said as `changed: key old -> new (why)`.

Every key not named here is kept as written (bf16, target_dtype, target_sharding, packing,
activation checkpointing, torch_compile, loss_chunk_blocks, dataloader workers, ...); a gradient
accumulation over 2 micro-batches is lowered to 2, which accumulates all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REHEARSAL_STEPS = 2
MAX_LENGTH = 128
ANCHOR_SLOTS = 64
MAX_NEW_TOKENS = 16
MICRO_BATCH = 1
ACCUMULATION = 2
EVAL_SAMPLES = 2
# report_to integrations that write only local files; the others need an account or a network
LOCAL_REPORTERS = ("tensorboard", "none")


@dataclass
class Rewrite:
    """A recipe mapping being rewritten, and the change lines said so far."""

    values: dict[str, Any]
    changes: list[str] = field(default_factory=list)

    def set(self, key: str, new: Any, why: str) -> None:
        """Set `key` (None: remove it), recording the change when the value differs."""
        old = self.values.get(key)
        if old == new:
            return
        self.changes.append(f"changed: {key} {_shown(old)} -> {_shown(new)} ({why})")
        if new is None:
            self.values.pop(key, None)
        else:
            self.values[key] = new

    def clip(self, key: str, limit: int, default: Any, why: str) -> None:
        """Lower `key` to `limit` when the recipe's value (or the default) is larger."""
        value = self.values.get(key, default)
        if value is None or value > limit:
            self.set(key, limit, why)


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


def train_samples(world: int, micro_batch: int, accumulation: int) -> int:
    """Samples for the rehearsal's optimizer steps on every rank (fewer would be read again: the
    steps are counted by max_steps, not epochs)."""
    return max(4, REHEARSAL_STEPS * world * micro_batch * accumulation)


def rewrite_recipe(
    recipe: dict[str, Any],
    *,
    world: int,
    workspace: Path,
    target: str,
    draft_config: str,
    dataset: str,
    dataset_note: str,
    keep_endpoint: bool,
) -> Rewrite:
    """The rehearsal recipe (`workspace` holds what it names) with every change said."""
    rewrite = Rewrite(dict(recipe))
    rewrite.set("target", target, "a tiny random target of the same architecture")
    rewrite.set("target_gguf_file", None, "the tiny target is a safetensors folder")
    rewrite.set("draft_config", draft_config, "the same draft config at the tiny width")
    if rewrite.values.get("init_from"):
        rewrite.set("init_from", None, "the warm-start weights are the real width's; the tiny draft starts fresh")
        rewrite.set("lora_r", None, "LoRA adapts the warm-started draft, which the tiny run does not load")
    rewrite.set("dataset", dataset, dataset_note)
    micro = min(int(rewrite.values.get("per_device_train_batch_size", 8)), MICRO_BATCH)
    # two micro-batches a step accumulate as eight do; each more is a forward and backward (and, with
    # activation checkpointing, a second forward) of every step, the first launch's and the resumed one's
    rewrite.clip(
        "gradient_accumulation_steps",
        ACCUMULATION,
        1,
        f"{ACCUMULATION} micro-batches a step accumulate as more do; each more costs a forward and backward on a CPU",
    )
    accumulation = int(rewrite.values.get("gradient_accumulation_steps", 1))
    rewrite.clip("num_train_samples", train_samples(world, micro, accumulation), None, "enough for two steps")
    if int(rewrite.values.get("num_eval_samples", 0)) > EVAL_SAMPLES:
        rewrite.set("num_eval_samples", EVAL_SAMPLES, "a few held out: the evaluation path runs, briefly")
    rewrite.clip("max_length", MAX_LENGTH, 2048, "short rows: seconds per step on a CPU")
    rewrite.clip("max_new_tokens", MAX_NEW_TOKENS, 256, "short answers from the tiny target")
    prompt = MAX_LENGTH - MAX_NEW_TOKENS
    rewrite.clip("max_prompt_length", prompt, 1024, "a prompt longer than the short rows leaves no answer in them")
    # every anchor slot is computed (a block of logits over the whole vocabulary, used or not), while a
    # regenerated answer of MAX_NEW_TOKENS has at most that many anchors
    why = "every slot costs a block of logits over the whole vocabulary, and short answers have fewer anchors"
    rewrite.clip("num_anchors", ANCHOR_SLOTS, 512, f"{why}; the memory plan counts the recipe's own")
    if rewrite.values.get("eval_num_anchors") is not None:
        rewrite.clip("eval_num_anchors", ANCHOR_SLOTS, ANCHOR_SLOTS, why)
    if not keep_endpoint and rewrite.values.get("regenerate_endpoint"):
        rewrite.set("regenerate_endpoint", None, "the endpoint does not answer from here: the tiny target answers")
        rewrite.set("regenerate_model", None, "goes with regenerate_endpoint")
    if rewrite.values.get("feature_endpoint"):
        rewrite.set("feature_endpoint", None, "the endpoint serves the real target: the tiny one captures features")
        for key in ("feature_model", "feature_storage_path"):
            rewrite.set(key, None, "goes with feature_endpoint")
    if rewrite.values.get("attn_implementation") == "flex_attention":
        rewrite.set(
            "attn_implementation",
            "sdpa",
            "torch has no CPU backward for flex_attention; its forward is checked against sdpa below",
        )
    rewrite.set("output_dir", str(workspace / "run"), "the rehearsal's own folder")
    rewrite.set("cache_dir", str(workspace / "cache"), "the rehearsal's own cache")
    rewrite.set("overwrite_output_dir", None, "the rehearsal's folder is new")
    rewrite.set("resume_from_checkpoint", None, "the rehearsal resumes by itself, from its step-1 checkpoint")
    rewrite.set("max_steps", REHEARSAL_STEPS, "two optimizer steps")
    rewrite.clip("per_device_train_batch_size", MICRO_BATCH, 8, "small steps on a CPU")
    rewrite.set("save_strategy", "steps", "a checkpoint after each step")
    rewrite.set("save_steps", 1, "a checkpoint after each step, to resume from step 1")
    limit = rewrite.values.get("save_total_limit")
    if limit is not None and 0 < int(limit) < REHEARSAL_STEPS:
        rewrite.set("save_total_limit", REHEARSAL_STEPS, "the step-1 checkpoint is kept to resume from")
    rewrite.set("logging_steps", 1, "the loss of every step")
    reporters = rewrite.values.get("report_to")
    if reporters is not None:
        listed = [reporters] if isinstance(reporters, str) else list(reporters)
        local = [name for name in listed if name in LOCAL_REPORTERS]
        if local != listed:
            rewrite.set("report_to", local, "the other integrations need an account or a network")
    rewrite.set("push_to_hub", None, "a rehearsal publishes nothing")
    rewrite.set("use_cpu", True, "this machine's CPUs")
    return rewrite


def rewrite_accelerate(config: dict[str, Any] | None, ranks: int) -> tuple[dict[str, Any], list[str]]:
    """The accelerate config for N CPU ranks: the given one with num_processes and use_cpu changed."""
    values = dict(config or {"distributed_type": "MULTI_CPU" if ranks > 1 else "NO", "mixed_precision": "no"})
    changes = []
    for key, new, why in (
        ("num_processes", ranks, "--ranks"),
        ("use_cpu", True, "this machine's CPUs"),
        ("num_machines", 1, "one machine"),
        ("machine_rank", 0, "one machine"),
    ):
        if values.get(key) != new:
            if config is not None:
                changes.append(f"changed: accelerate {key} {_shown(values.get(key))} -> {new} ({why})")
            values[key] = new
    if values.get("distributed_type") in ("MULTI_GPU", "MULTI_NPU", "MULTI_XPU") or (
        ranks > 1 and values.get("distributed_type") == "NO"
    ):
        changes.append(
            f"changed: accelerate distributed_type {values.get('distributed_type')} -> MULTI_CPU (CPU ranks)"
        )
        values["distributed_type"] = "MULTI_CPU"
    values.pop("gpu_ids", None)
    return values, changes


def write_yaml(values: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path

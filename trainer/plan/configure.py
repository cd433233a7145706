"""The draft config (and starter recipe) `dflash2 configure` writes for any Hugging Face causal LM:
every value the draft shares with its target read from the target's text config, every choice
made with its reason, the result checked by `DFlash2Config` and the exporter's config rules.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml
from transformers import AutoTokenizer, BatchEncoding, PretrainedConfig, PreTrainedTokenizerBase

from modeling_dflash2 import DFlash2Config
from trainer.models.target import TargetSource
from trainer.plan.anchors import anchors_for_supervised
from trainer.plan.facts import packed_block_slots
from trainer.publishing.contract import TargetDimensions, config_violations

logger = logging.getLogger(__name__)

# Attention shapes the servers' draft kernels and z-lab's released Qwen3.5-3.8 drafts use when the
# target's own attention is not a plain GQA layer the draft can copy (see `attention_shape`).
FALLBACK_ATTENTION = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
MOE_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
SCALED_ROPE_NOTE = (
    "the target scales RoPE ({kind}); the draft records rope_type default with the same base: the "
    "draft's modeling code, training and both servers then all apply the same unscaled rotation"
)


@dataclass
class Choice:
    """A value this tool picked, and the sentence that says why (printed and logged)."""

    value: Any
    reason: str


@dataclass
class DraftPlan:
    """Everything the config is made of, with the reasons for the values that were chosen."""

    config: dict[str, Any]
    reasons: list[str] = field(default_factory=list)


def target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published rule: one layer in the middle for one draft layer, else evenly spread from
    layer 1 to layer L - 3 (rounded to the nearest layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + index * span / (num_draft_layers - 1)) for index in range(num_draft_layers)]


def mlp_width(text_config: PretrainedConfig) -> Choice:
    """The draft's dense SwiGLU width. A dense target's own width; for a mixture-of-experts target
    the width a token actually passes through, experts-per-token x expert width, so the draft's
    MLP costs what one token's active experts cost."""
    experts = next((getattr(text_config, key) for key in MOE_EXPERT_COUNT_KEYS if getattr(text_config, key, None)), 0)
    if not experts:
        return Choice(text_config.intermediate_size, "the target's intermediate_size (dense MLP)")
    per_token = getattr(text_config, "num_experts_per_tok", None) or getattr(text_config, "experts_per_token", None)
    expert_width = getattr(text_config, "moe_intermediate_size", None) or text_config.intermediate_size
    if not per_token:
        raise ValueError("the target has experts but no num_experts_per_tok; pass --intermediate-size")
    width = per_token * expert_width
    return Choice(
        width,
        f"mixture of experts ({experts} experts, {per_token} per token, width {expert_width}): the draft's "
        f"dense MLP is as wide as one token's active experts, {per_token} x {expert_width} = {width}",
    )


def attention_shape(text_config: PretrainedConfig) -> Choice:
    """The target's own heads, KV heads and head_dim when its attention is a plain GQA layer with
    head_dim <= 128 (every layer full or sliding attention); otherwise 32 / 8 x 128, the shape of
    z-lab's drafts for targets with gated, partially rotated or linear attention (Qwen3.5-3.8)."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    partial = (getattr(text_config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    plain = layer_types <= {"full_attention", "sliding_attention"} and partial == 1.0
    if plain and head_dim <= 128:
        shape = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}
        return Choice(shape, f"the target's attention shape, {heads} / {kv_heads} x {head_dim}")
    why = []
    if not plain:
        why.append(f"layer types {sorted(layer_types)}" + (f", partial rotary {partial}" if partial != 1.0 else ""))
    if head_dim > 128:
        why.append(f"head_dim {head_dim} > 128")
    return Choice(
        dict(FALLBACK_ATTENTION),
        f"the target's attention is not a plain GQA layer ({'; '.join(why)}): the draft uses 32 / 8 x 128, "
        "as z-lab's drafts for such targets do",
    )


def rope_base(text_config: PretrainedConfig) -> Choice:
    """The target's RoPE base; a scaled type is recorded as default with that base (and said)."""
    parameters = getattr(text_config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta", getattr(text_config, "rope_theta", None))
    if theta is None:
        raise ValueError("the target's config has no rope_theta (nor rope_parameters.rope_theta)")
    kind = parameters.get("rope_type", "default")
    if kind != "default":
        return Choice(float(theta), SCALED_ROPE_NOTE.format(kind=kind))
    return Choice(float(theta), "the target's RoPE base")


def dflash2_sizes(hidden_size: int) -> Choice:
    """Selector rank = the largest power of two <= H / 8, at most 256; top-K = rank / 8, at most
    16; conv kernel 2 with groups of 16 channels (the largest power of two <= 16 dividing H).
    This reproduces every released DFlash2 config (H 576: 64 / 8; H >= 2048: 256 / 16)."""
    rank = min(256, 2 ** int(math.log2(max(hidden_size // 8, 1))))
    group = next(size for size in (16, 8, 4, 2, 1) if hidden_size % size == 0)
    sizes = {
        "conv_kernel_size": 2,
        "conv_group_size": group,
        "selector_rank": rank,
        "selector_top_k": min(16, max(2, rank // 8)),
    }
    return Choice(sizes, f"DFlash2 sizes for hidden size {hidden_size}: {sizes}")


def choose_mask_token(tokenizer: PreTrainedTokenizerBase, vocab_rows: int) -> Choice:
    """A token id the target never reads nor writes in chat, for the draft's mask slots.

    1. An embedding row past the tokenizer's vocabulary (the padding rows of the target's
       embedding): no text encodes to it, so the target never emits it (Qwen3's 151669).
    2. Else a special token named as reserved / unused / mask.
    3. Else the last special token that is not BOS, EOS, PAD or UNK and that the chat template
       never writes (SmolLM2's pretraining markers, e.g. `<empty_output>`).
    """
    if vocab_rows > len(tokenizer):
        return Choice(
            len(tokenizer),
            f"embedding row {len(tokenizer)} lies past the tokenizer's {len(tokenizer)} tokens "
            f"(the embedding has {vocab_rows} rows): no text encodes to it",
        )
    chat_ids = _chat_template_ids(tokenizer)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    roles = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    candidates = [
        (token_id, added.content)
        for token_id, added in sorted(tokenizer.added_tokens_decoder.items())
        if added.special
        and token_id < vocab_rows
        and token_id not in roles
        and token_id not in chat_ids
        and added.content not in template
    ]
    if not candidates:
        raise ValueError(
            "no token qualifies as the mask token (no embedding row past the tokenizer, and every special "
            "token is BOS/EOS/PAD/UNK or written by the chat template); pass --mask-token-id with a token "
            "id the target never produces"
        )
    named = [(i, text) for i, text in candidates if any(w in text.lower() for w in ("reserved", "unused", "mask"))]
    if named:
        token_id, text = named[0]
        return Choice(token_id, f"{text!r} (id {token_id}) is a reserved special token the chat template never writes")
    token_id, text = candidates[-1]
    return Choice(
        token_id,
        f"{text!r} (id {token_id}) is the last special token that is not BOS/EOS/PAD/UNK and that the chat "
        f"template never writes ({len(candidates)} such tokens): a pretraining marker a chat never produces",
    )


def _chat_template_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids the chat template writes around a system, user and assistant turn."""
    if not tokenizer.chat_template:
        return set()
    conversation = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    ids: set[int] = set()
    for messages, prompt in ((conversation, False), (conversation[:2], True), (conversation[1:2], True)):
        # return_dict=True (tokenizing, the default) gives a BatchEncoding: transformers types all the forms
        encoded = cast(
            BatchEncoding, tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=True)
        )
        ids.update(encoded["input_ids"])
    return ids


def draft_config(
    text_config: PretrainedConfig,
    num_draft_layers: int,
    block_size: int,
    mask_token: Choice,
    sizes: dict[str, int] | None = None,
    layer_ids: Sequence[int] | None = None,
    sliding_window: int | None = None,
) -> DraftPlan:
    """The draft's config.json as a dict, in the layout of `hub_configs/`."""
    if num_draft_layers < 1:
        raise ValueError(f"--num-draft-layers must be >= 1 (got {num_draft_layers})")
    depth = text_config.num_hidden_layers
    attention, width, rope = attention_shape(text_config), mlp_width(text_config), rope_base(text_config)
    default_sizes = dflash2_sizes(text_config.hidden_size)
    chosen_ids = list(layer_ids) if layer_ids else target_layer_ids(depth, num_draft_layers)
    layer_type = "sliding_attention" if sliding_window else "full_attention"
    config: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": text_config.hidden_size,
        "intermediate_size": width.value,
        "num_hidden_layers": num_draft_layers,
        **attention.value,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        # GGUF stores eps as float32 (1e-05 reads back as 9.9999997e-06): keep 7 significant digits
        "rms_norm_eps": float(f"{text_config.rms_norm_eps:.7g}"),
        "vocab_size": text_config.vocab_size,
        "max_position_embeddings": text_config.max_position_embeddings,
        "rope_parameters": {"rope_theta": rope.value, "rope_type": "default"},
        "layer_types": [layer_type] * num_draft_layers,
        "use_sliding_window": bool(sliding_window),
    }
    if sliding_window:
        config.update(sliding_window=sliding_window, max_window_layers=num_draft_layers)
    config.update(
        is_causal=False,
        num_target_layers=depth,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(text_config, key, None)
        if isinstance(value, int):
            config[key] = value
    config["dtype"] = "bfloat16"
    config["dflash_config"] = {
        "block_size": block_size,
        "mask_token_id": mask_token.value,
        "target_layer_ids": chosen_ids,
        **default_sizes.value,
        **(sizes or {}),
    }
    layers_reason = "given" if layer_ids else f"the published rule for {num_draft_layers} draft layers of {depth}"
    reasons = [
        f"attention: {attention.reason}",
        f"intermediate_size {width.value}: {width.reason}",
        f"rope_theta {rope.value:g}: {rope.reason}",
        f"mask_token_id {mask_token.value}: {mask_token.reason}",
        f"target_layer_ids {chosen_ids}: {layers_reason}",
        f"layer types: {layer_type}" + (f" (window {sliding_window})" if sliding_window else " (the default)"),
        default_sizes.reason + (f", overridden by {sizes}" if sizes else ""),
    ]
    return DraftPlan(config, reasons)


def check_draft_config(config: dict[str, Any], text_config: PretrainedConfig, name: str) -> None:
    """Refuse a config that `DFlash2Config` or the exporter's config rules would refuse."""
    DFlash2Config(**config).dflash_settings  # noqa: B018  (validates every DFlash field)
    dimensions = TargetDimensions(name, text_config.hidden_size, text_config.vocab_size, text_config.num_hidden_layers)
    failures = config_violations(config, dimensions)
    if failures:
        raise ValueError("the generated config breaks the contract: " + "; ".join(failures))


def load_tokenizer(source: TargetSource) -> PreTrainedTokenizerBase:
    path = Path(source.name_or_path)
    if path.is_dir() and not any(path.glob("tokenizer*")) and not source.gguf_file:
        raise ValueError(f"{path} holds no tokenizer to choose a mask token from; pass --mask-token-id")
    return AutoTokenizer.from_pretrained(source.name_or_path, **source.load_kwargs)


# Comment lines written above a recipe key, saying why the starter recipes set it.
CPU_PACKING_NOTE = (
    "# packing: false: a trial of minutes on a CPU. Packed, each {max_length}-token row could get up to\n"
    "# {slots} block slots (dflash2 plan budgets that worst case) instead of these {num_anchors}: about\n"
    "# {ratio:.0f}x the draft's work a row.\n"
)
GPU_PACKING_NOTE = (
    "# packing: true: whole samples end to end up to max_length, so the target computes nothing on\n"
    "# padding; each document keeps its own positions, masks and num_anchors anchors. dflash2 plan budgets\n"
    "# a packed row's worst case, rows full of short documents with an anchor on every valid position:\n"
    "# {slots} block slots per {max_length}-token row ({num_anchors} unpacked).\n"
)
GPU_BATCH_NOTE = (
    "# Sized with dflash2 plan for the Qwen3-8B B=16 draft on 8 x 80 GB (FSDP2, bf16): packed, micro-batch 2\n"
    "# needs 183 GiB a rank and micro-batch 1 97 GiB, so activation checkpointing is on and micro-batch\n"
    "# 1 x 8 accumulation keeps 8 rows a step (53 GiB a rank, 42 of them the flex masks' build over a\n"
    "# worst-case packed row's [T, K] grid). Re-plan for another draft.\n"
    "# (fsdp_activation_checkpointing: true in the accelerate config instead spares backward an all-gather.)\n"
)


LONG_CONTEXT_NOTE = (
    "# Context {max_length} tokens: long documents with a question (LongAlign-10k, 8K-64K tokens), answered\n"
    "# by the target itself in up to {answer} tokens; longer prompts are skipped. packing: false: each\n"
    "# packed document gets its own anchor quota, so a packed {max_length}-token row's worst case is\n"
    "# {slots} block slots, far past one GPU; long samples fill the rows themselves.\n"
)
LONG_ANCHORS_NOTE = (
    "# One anchor slot per 6 supervised tokens (the 4K recipes' 512 for 3,072-token answers): {answer}-token\n"
    '# answers -> {num_anchors} (docs/planning.md, "Anchors at long context").\n'
)
LONG_BATCH_NOTE = (
    "# Micro-batch 1 with activation checkpointing and flex_attention; run dflash2 plan for this draft to\n"
    "# see what the context costs term by term and the largest micro-batch that fits.\n"
)
REFERENCE_CONTEXT = 4096  # the starter recipes' context without --context-length
LONG_DATASET = {"dataset": "THUDM/LongAlign-10k", "dataset_split": "train", "messages_column": "messages"}
STEP_TOKENS = 8 * 8 * REFERENCE_CONTEXT  # 8 ranks x 8 rows x 4,096 tokens a step: kept at any context


def answer_budget(context_length: int) -> int:
    """Answer tokens of a starter recipe at `context_length`: the 4K recipes' 3,072, or a quarter
    of a longer context (room for a thinking model's answer; the rest is the prompt's)."""
    return max(3072, context_length // 4)


def check_context_length(context_length: int, text_config: PretrainedConfig) -> None:
    """One line naming the flag for a context the target cannot attend over."""
    limit = getattr(text_config, "max_position_embeddings", None)
    if context_length < 256:
        raise ValueError(f"--context-length must be >= 256 tokens (got {context_length})")
    if limit is not None and context_length > limit:
        raise ValueError(
            f"--context-length {context_length} is above the target's max_position_embeddings {limit}: "
            "the target cannot attend over that context"
        )


def _commented(text: str, notes: dict[str, str]) -> str:
    """`text` (a YAML mapping dumped one key a line) with each note written above its key's line."""
    lines = text.splitlines(keepends=True)
    for key, note in notes.items():
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
        lines.insert(index, note)
    return "".join(lines)


def starter_recipe(
    target: str, config_path: Path, size: str, gguf_file: str | None = None, context_length: int | None = None
) -> str:
    """A recipe `dflash2 train` accepts: `cpu` trains on packaged chat prompts in minutes, `gpu`
    on UltraChat for an 8-GPU FSDP2 node (launch line in its header), packed, at the micro-batch
    the planner fits for the Qwen3-8B draft on 80 GB GPUs. `context_length` trains at that many
    tokens: `max_length`, the prompt and answer budgets and `num_anchors` (one per 6 answer
    tokens) follow it; a GPU recipe past 4,096 tokens takes long documents (LongAlign-10k),
    unpacked, with activation checkpointing, micro-batch 1 and as many tokens a step as at 4K."""
    output = f"outputs/{config_path.stem}"
    common: dict[str, Any] = {"target": target, "draft_config": str(config_path)}
    if gguf_file:
        common["target_gguf_file"] = gguf_file
    if size == "cpu":
        header = "# CPU trial: dflash2 train {recipe}\n"
        body = {
            **common,
            "dataset": "chitchat",
            "regenerate": True,
            "num_train_samples": 256,
            "num_eval_samples": 32,
            "max_new_tokens": 48,
            "max_prompt_length": 96,
            "max_length": 160,
            "packing": False,
            "offline": True,
            "output_dir": output,
            "max_steps": 300,
            "per_device_train_batch_size": 4,
            "learning_rate": 0.001,
            "lr_scheduler_type": "cosine",
            "warmup_steps": 0.05,
            "num_anchors": 16,
            "eval_strategy": "steps",
            "eval_steps": 150,
            "save_steps": 150,
            "logging_steps": 10,
            "seed": 0,
        }
    else:
        header = (
            "# 8-GPU node, FSDP2 + bf16 from the accelerate config:\n"
            "#   accelerate launch --config_file examples/accelerate/fsdp2.yaml -m trainer train {recipe}\n"
            "# Size it first: dflash2 plan {recipe} --accelerate-config examples/accelerate/fsdp2.yaml\n"
        )
        body = {
            **common,
            "target_dtype": "bfloat16",
            "target_sharding": "fsdp",
            "attn_implementation": "flex_attention",
            "dataset": "HuggingFaceH4/ultrachat_200k",
            "dataset_split": "train_sft",
            "messages_column": "messages",
            "regenerate": True,
            "num_train_samples": 100000,
            "num_eval_samples": 256,
            "max_prompt_length": 1024,
            "max_new_tokens": 3072,
            "max_length": 4096,
            "packing": True,
            "offline": False,
            "output_dir": output,
            "num_train_epochs": 3,
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 8,
            "activation_checkpointing": True,
            "learning_rate": 0.0006,
            "lr_scheduler_type": "cosine",
            "warmup_steps": 0.04,
            "num_anchors": 512,
            "eval_strategy": "steps",
            "eval_steps": 1000,
            "save_steps": 1000,
            "logging_steps": 10,
            "spec_eval_prompts": 0,
            "seed": 0,
        }
    long_context = size != "cpu" and context_length is not None and context_length > REFERENCE_CONTEXT
    if context_length is not None:
        answer = body["max_new_tokens"] if size == "cpu" else answer_budget(context_length)
        body.update(max_length=context_length, max_new_tokens=answer, max_prompt_length=context_length - answer)
        body["num_anchors"] = anchors_for_supervised(answer)
        if size != "cpu":  # unset, evaluation would put an anchor on every valid position
            body["eval_num_anchors"] = body["num_anchors"]
    if long_context and context_length is not None:  # (long_context implies a context_length)
        body.update(LONG_DATASET, num_train_samples=9744)  # its 10,000 conversations less the 256 held out
        rows = max(1, STEP_TOKENS // (8 * context_length))
        body.update(packing=False, per_device_train_batch_size=1, gradient_accumulation_steps=rows)
        body["output_dir"] = f"{output}-{context_length // 1024}k"
    length, anchors = body["max_length"], body["num_anchors"]
    slots = packed_block_slots(length, anchors)
    if long_context:
        answer = body["max_new_tokens"]
        notes = {
            "dataset": LONG_CONTEXT_NOTE.format(max_length=length, answer=answer, slots=slots),
            "per_device_train_batch_size": LONG_BATCH_NOTE,
            "num_anchors": LONG_ANCHORS_NOTE.format(answer=answer, num_anchors=anchors),
        }
    else:
        packing_note = CPU_PACKING_NOTE if size == "cpu" else GPU_PACKING_NOTE
        ratio = slots / anchors
        notes = {"packing": packing_note.format(max_length=length, num_anchors=anchors, slots=slots, ratio=ratio)}
        if size != "cpu":
            notes["per_device_train_batch_size"] = GPU_BATCH_NOTE
    return header + _commented(yaml.safe_dump(body, sort_keys=False), notes)

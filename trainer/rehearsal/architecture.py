"""Tiny stand-ins of the recipe's two models: the same architectures at a width a CPU trains in seconds.

What decides how a run behaves is kept: the model type and its layer types (a hybrid target's linear
and full attention layers), the depth (the draft's `target_layer_ids` index it), the ratios of every
kind of attention head, the head dimensions, the vocabulary (so token ids, the mask token and the
LM head's shape are the real ones; "vocab kept"), and every DFlash2 setting of the draft. What only
sizes the run is shrunk: the hidden width to `TINY_HIDDEN`, MLPs to twice that, head counts divided by
their common divisor, experts to at most 4, the selector rank to at most 16. The weights are random.

The tokenizer is the target's own when it can be read here; otherwise a stand-in
(`stand_in_tokenizer`): byte-level, with a ChatML template and one token for every embedding row.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from modeling_dflash2 import DFlash2Config

TINY_HIDDEN = 64
TINY_RANK = 16  # selector rank: the codebooks are [vocab, rank], the draft's largest tensors
TINY_EXPERTS = 4
TINY_EXPERTS_PER_TOKEN = 2
# the window of a sliding-window draft layer, so that it slides within the rehearsal's short rows
TINY_WINDOW = 24
HEAD_COUNT = re.compile(r"^(num_attention_heads|num_key_value_heads|[a-z_]*num_[a-z_]*heads)$")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "experts_per_token")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, with Qwen3's thinking switch (a recipe's enable_thinking must find it)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def shrink(values: dict[str, Any], hidden: int = TINY_HIDDEN) -> tuple[dict[str, Any], list[str]]:
    """A config dict at tiny width (see the module docstring) and a line for each value changed."""
    tiny = dict(values)
    changes: list[str] = []

    def change(key: str, new: Any) -> None:
        if tiny.get(key) != new:
            changes.append(f"{key} {tiny.get(key)} -> {new}")
            tiny[key] = new

    real_hidden = values.get("hidden_size")
    heads = {key: value for key, value in values.items() if HEAD_COUNT.match(key) and isinstance(value, int) and value}
    if "num_attention_heads" in heads and "head_dim" not in values and isinstance(real_hidden, int):
        tiny["head_dim"] = real_hidden // heads["num_attention_heads"]  # what the real model derives
    if isinstance(real_hidden, int):
        change("hidden_size", hidden)
    for key, value in values.items():
        if key.endswith("intermediate_size") and isinstance(value, int) and value:
            change(key, 2 * hidden)
    divisor = math.gcd(*heads.values()) if heads else 1
    for key, value in heads.items():
        change(key, value // divisor)
    for key in EXPERT_COUNTS:
        if isinstance(values.get(key), int) and values[key]:
            change(key, min(values[key], TINY_EXPERTS))
    for key in EXPERTS_PER_TOKEN:
        if isinstance(values.get(key), int) and values[key]:
            change(key, min(values[key], TINY_EXPERTS_PER_TOKEN))
    return tiny, changes


def text_config_values(config: PretrainedConfig) -> dict[str, Any]:
    """The config as a dict, without transformers' private keys."""
    return {key: value for key, value in config.to_dict().items() if not key.startswith("_")}


def tiny_target_config(config: PretrainedConfig) -> tuple[PretrainedConfig, list[str]]:
    """The target's config class at tiny width (a multimodal config: its text config shrunk)."""
    values = text_config_values(config)
    if isinstance(values.get("text_config"), dict):
        text, changes = shrink(values["text_config"])
        values["text_config"] = text
    else:
        values, changes = shrink(values)
    return type(config).from_dict(values), changes


def tiny_target(config: PretrainedConfig, dtype: torch.dtype, seed: int = 0) -> PreTrainedModel:
    """A random causal LM of `config` (already tiny), in `dtype`."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def tiny_draft_values(draft: DFlash2Config, hidden: int) -> tuple[dict[str, Any], list[str]]:
    """The draft config at the target's tiny width: every DFlash2 setting kept except the selector's
    rank (a width) and a sliding window longer than the rehearsal's rows."""
    values, changes = shrink(text_config_values(draft), hidden)
    dflash = dict(values.get("dflash_config") or {})
    if isinstance(dflash.get("selector_rank"), int) and dflash["selector_rank"] > TINY_RANK:
        changes.append(f"dflash_config.selector_rank {dflash['selector_rank']} -> {TINY_RANK}")
        dflash["selector_rank"] = TINY_RANK
    group = dflash.get("conv_group_size")
    if isinstance(group, int) and hidden % group:
        changes.append(f"dflash_config.conv_group_size {group} -> {math.gcd(hidden, group)}")
        dflash["conv_group_size"] = math.gcd(hidden, group)
    values["dflash_config"] = dflash
    window = values.get("sliding_window")
    if isinstance(window, int) and window > TINY_WINDOW:
        changes.append(f"sliding_window {window} -> {TINY_WINDOW} (so it slides within the rehearsal's rows)")
        values["sliding_window"] = TINY_WINDOW
    return values, changes


def stand_in_target_config(draft: DFlash2Config) -> PretrainedConfig:
    """A real-size target of the draft config's model type, built from the draft's dimensions (when
    the target's own config cannot be read here): its depth, width, vocabulary, heads and RoPE."""
    settings = draft.dflash_settings
    depth = settings.num_target_layers or max(settings.target_layer_ids) + 1
    return AutoConfig.for_model(
        draft.model_type,
        hidden_size=draft.hidden_size,
        intermediate_size=draft.intermediate_size,
        num_hidden_layers=depth,
        num_attention_heads=draft.num_attention_heads,
        num_key_value_heads=draft.num_key_value_heads,
        head_dim=getattr(draft, "head_dim", None) or draft.hidden_size // draft.num_attention_heads,
        vocab_size=draft.vocab_size,
        max_position_embeddings=draft.max_position_embeddings,
        rope_parameters={"rope_theta": settings.rope_theta, "rope_type": "default"},
        tie_word_embeddings=False,
    )


def stand_in_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level, a token for every embedding row (a random target's answers decode to text),
    ChatML special tokens after the 256 bytes, and a ChatML template with Qwen3's thinking switch."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {character: index for index, character in enumerate(sorted(alphabet))}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    for index in range(len(vocab), vocab_size):
        vocab[f"<t{index}>"] = index
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def target_tokenizer(target: str, offline: bool) -> tuple[PreTrainedTokenizerBase | None, str]:
    """The target's own tokenizer when it can be read here (a local folder, or the Hub or its cache),
    with where it came from; (None, why) when not."""
    path = Path(target)
    if path.is_dir() and not any(path.glob("tokenizer*")):
        return None, f"{target} holds no tokenizer"
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as error:
        where = "the Hub is unreachable and it is not in the Hugging Face cache" if offline else str(error)
        return None, f"{target}'s tokenizer cannot be read here ({where.splitlines()[0][:200]})"
    if not tokenizer.chat_template:
        return None, f"{target}'s tokenizer has no chat template"
    return tokenizer, f"the target's own ({target})"

"""A tiny random causal-LM target with a real (word-level, ChatML) tokenizer, built in-process."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
)

from modeling_dflash2 import DFlash2Config
from tests.support.drafts import tiny_config_kwargs, tiny_dflash_config
from trainer.models.target import FrozenTarget

SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<mask>"]
WORDS = [
    "hello",
    "hi",
    "how",
    "are",
    "you",
    "i",
    "am",
    "fine",
    "thanks",
    "what",
    "is",
    "your",
    "name",
    "my",
    "the",
    "a",
    "capital",
    "of",
    "france",
    "paris",
    "good",
    "morning",
    "evening",
    "night",
    "do",
    "like",
    "to",
    "eat",
    "read",
    "play",
    "music",
    "games",
    "yes",
    "no",
    "maybe",
    "why",
    "because",
    "tell",
    "me",
    "about",
    "weather",
    "sunny",
    "rain",
    "today",
    "tomorrow",
    "user",
    "assistant",
    "system",
]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|> ' + message['role'] + ' ' + message['content'] + ' <|im_end|> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|> assistant ' }}{% endif %}"
)
MASK_TOKEN_ID = 3


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIAL + sorted(set(WORDS)))}
    vocab["<unk>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHATML
    return tokenizer


# The widths every tiny target shares (the tiny draft is sized to them).
TINY_WIDTHS: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def tiny_target(kind: str = "llama", seed: int = 0, layers: int = 4) -> FrozenTarget:
    tokenizer = tiny_tokenizer()
    common: dict[str, Any] = {
        **TINY_WIDTHS,
        "vocab_size": len(tokenizer),
        "num_hidden_layers": layers,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen3ForCausalLM(Qwen3Config(**common))
    return FrozenTarget(model.float(), tokenizer)


def tiny_hybrid_config(vocab_size: int, layers: int = 2, **overrides: Any) -> Qwen3NextConfig:
    """A tiny Qwen3-Next config: linear-attention layers (state carried along the whole row) between
    full-attention ones, the kind of target packing must refuse."""
    values: dict[str, Any] = {
        **TINY_WIDTHS,
        "vocab_size": vocab_size,
        "num_hidden_layers": layers,
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "layer_types": ["linear_attention", "full_attention"] * (layers // 2),
        **overrides,
    }
    return Qwen3NextConfig(**values)


def tiny_draft_config_for(
    target: FrozenTarget, dflash: dict[str, Any] | None = None, **overrides: Any
) -> DFlash2Config:
    """The conftest tiny draft, one layer deep and sized to `target` (vocab rows, depth, mask token)."""
    dflash_config = tiny_dflash_config(
        **{"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": [1, 2], "selector_top_k": 4, **(dflash or {})}
    )
    values = {
        "num_hidden_layers": 1,
        "layer_types": ["full_attention"],
        "vocab_size": target.vocab_rows,
        "num_target_layers": target.num_layers,
        "dflash_config": dflash_config,
        **overrides,
    }
    return DFlash2Config(**tiny_config_kwargs(**values))


def tiny_conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Random short conversations over the tiny vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    words = sorted(set(WORDS))

    def sentence(length: int) -> str:
        picks = torch.randint(0, len(words), (length,), generator=generator).tolist()
        return " ".join(words[i] for i in picks)

    conversations = []
    for _ in range(count):
        length = int(torch.randint(6, 14, (1,), generator=generator))
        conversations.append(
            [{"role": "user", "content": sentence(4)}, {"role": "assistant", "content": sentence(length)}]
        )
    return conversations


def tiny_chat_dataset(target: FrozenTarget, count: int, seed: int = 0, max_length: int = 48):
    """Tokenized tiny conversations with assistant loss masks, ready for a trainer."""
    import datasets

    from trainer.data.dataset import tokenize_conversations, truncate_and_filter

    conversations = datasets.Dataset.from_dict({"messages": tiny_conversations(count, seed=seed)})
    return truncate_and_filter(tokenize_conversations(target.tokenizer, conversations), max_length)

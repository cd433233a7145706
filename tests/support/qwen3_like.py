"""A tiny byte-level tokenizer (and random target) with tests/fixtures/qwen3_like_chat_template.jinja,
a template that rewrites history as Qwen3's does (issue 34). One token per byte, ChatML's special
tokens, and Qwen3's `<think>` / `<tool_call>` / `<tool_response>` tags as added, non-special tokens
(decoding keeps them, as Qwen3's tokenizer does): every text is tokenized one character at a time,
so a test can write the exact token sequence it expects as text."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from trainer.models.target import FrozenTarget

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen3_like_chat_template.jinja").read_text()
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def qwen3_like_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {character: index for index, character in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_tokens(TAGS)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def qwen3_like_target(seed: int = 0, layers: int = 4) -> FrozenTarget:
    """A random `layers`-deep Llama over that tokenizer (its answers are whatever the weights say)."""
    tokenizer = qwen3_like_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=layers,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return FrozenTarget(LlamaForCausalLM(config).float(), tokenizer)

"""benchmarks.capture: the analytic FLOP count, by hand and against torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.capture import QWEN3_8B, QWEN3_8B_DRAFT, TargetShape, capture_flops, draft_layer_ids

TINY = TargetShape(hidden=4, intermediate=8, layers=3, heads=2, kv_heads=1, head_dim=2, vocab=10)


def test_flops_of_a_tiny_target_worked_by_hand():
    # per token, one layer: q 2*4*4=32, k and v 2*2*4*2=32, o 2*4*4=32, SwiGLU 3*2*4*8=192;
    # attention at S=3: 1+2+3=6 visible pairs x (scores + values: 2*2*heads*head_dim=16) = 96 / 3 tokens = 32.
    # layer 320; head 2*4*10=80; full 3*320+80 = 1040; truncated after layer 1: 2*320 = 640.
    counted = capture_flops(TINY, [1, 0], sequence_length=3)
    assert counted["flops_per_token_full_depth_with_head"] == 1040
    assert counted["flops_per_token_truncated"] == 640
    assert counted["saving_fraction"] == pytest.approx(400 / 1040)
    assert capture_flops(TINY, [2], sequence_length=3)["flops_per_token_truncated"] == 960


def test_matrix_products_match_torch_flop_counter_on_a_real_forward():
    """Everything but attention, counted by torch on a tiny Qwen3 with the same shape (S tokens, with head)."""
    length = 5
    config = Qwen3Config(
        vocab_size=TINY.vocab,
        hidden_size=TINY.hidden,
        intermediate_size=TINY.intermediate,
        num_hidden_layers=TINY.layers,
        num_attention_heads=TINY.heads,
        num_key_value_heads=TINY.kv_heads,
        head_dim=TINY.head_dim,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.ones(1, length, dtype=torch.long))
    totals = counter.get_flop_counts()["Global"]
    matmuls = sum(count for op, count in totals.items() if "attention" not in str(op))
    attention_per_token = 2 * TINY.heads * TINY.head_dim * (length + 1)
    full = capture_flops(TINY, [0], sequence_length=length)["flops_per_token_full_depth_with_head"]
    assert matmuls == length * (full - TINY.layers * attention_per_token)


def test_qwen3_8b_numbers_use_the_draft_config_layer_ids():
    ids = draft_layer_ids(QWEN3_8B_DRAFT)
    assert ids == [1, 9, 17, 25, 33]
    counted = capture_flops(QWEN3_8B, ids)
    layer = (2 * 4096 * 4096 * 2 + 2 * 2 * 4096 * 1024) + 6 * 4096 * 12288 + 2 * 32 * 128 * 4097
    assert counted["flops_per_token_truncated"] == 34 * layer
    assert counted["flops_per_token_full_depth_with_head"] == 36 * layer + 2 * 4096 * 151936
    assert 0.12 < counted["saving_fraction"] < 0.13


def test_layer_ids_outside_the_target_are_refused():
    with pytest.raises(ValueError, match=r"target_layer_ids \[3\]: each must be in 0\.\.2"):
        capture_flops(TINY, [3])

"""Draft forward: equality with a naive implementation, masks, cache, backends, gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from modeling_dflash2 import DFlash2DraftModel, DFlashDraftModel, unary_transform
from modeling_dflash2.modeling_dflash2 import DFlashRMSNorm, DFlashRotaryEmbedding
from modeling_dflash2.ops_dflash2 import _RMSNormFunction, apply_rotary, block_visibility, grouped_sdpa_forward
from tests.support import naive_dflash
from tests.support.drafts import draft_inputs, tiny_config, tiny_draft, tiny_v1_draft

HYBRID = {
    "layer_types": ["full_attention", "sliding_attention"],
    "use_sliding_window": True,
    "sliding_window": 3,
    "is_causal": None,
}


def _assert_matches_naive(model, inputs, atol=2e-5):
    model.eval()
    with torch.no_grad():
        out = model(**inputs)
    visible = naive_dflash.serving_visibility(model)
    for row in range(out.shape[0]):
        expected = naive_dflash.forward(
            model,
            inputs["position_ids"][row],
            inputs["noise_embedding"][row],
            inputs["target_hidden"][row],
            visible,
        )
        torch.testing.assert_close(out[row].double(), expected, atol=atol, rtol=1e-4)


def test_dflash2_forward_matches_naive_reference():
    model = tiny_draft(seed=0)
    _assert_matches_naive(model, draft_inputs(model.config, batch=2, context=5))


def test_dflash2_forward_matches_naive_reference_with_two_blocks():
    model = tiny_draft(seed=1)
    inputs = draft_inputs(model.config, batch=1, context=3, blocks=2)
    _assert_matches_naive(model, inputs)


def test_hybrid_causal_sliding_forward_matches_naive_reference():
    model = tiny_draft(seed=2, **HYBRID)
    assert [model.dflash.layer_is_causal(i) for i in range(2)] == [False, True]
    _assert_matches_naive(model, draft_inputs(model.config, batch=1, context=6))


def test_v1_forward_matches_naive_reference():
    model = tiny_v1_draft(seed=3)
    assert all(layer.attention_conv is None and layer.mlp_conv is None for layer in model.layers)
    _assert_matches_naive(model, draft_inputs(model.config, batch=2, context=4))


def test_causal_block_slot_ignores_later_slots():
    model = tiny_draft(seed=4, is_causal=True).eval()
    inputs = draft_inputs(model.config, batch=1, context=4)
    changed = dict(inputs, noise_embedding=inputs["noise_embedding"].clone())
    changed["noise_embedding"][:, 2:] += 1.0
    with torch.no_grad():
        before, after = model(**inputs), model(**changed)
    torch.testing.assert_close(before[:, :2], after[:, :2], rtol=0, atol=0)
    assert not torch.allclose(before[:, 2:], after[:, 2:])


def test_bidirectional_block_slot_sees_later_slots():
    model = tiny_draft(seed=4, is_causal=False).eval()
    inputs = draft_inputs(model.config, batch=1, context=4)
    changed = dict(inputs, noise_embedding=inputs["noise_embedding"].clone())
    changed["noise_embedding"][:, 3] += 1.0
    with torch.no_grad():
        assert not torch.allclose(model(**inputs)[:, 0], model(**changed)[:, 0])


def _block_diagonal_mask(context: int, blocks: int, block: int) -> torch.Tensor:
    """Every block sees the whole context and its own block only (a training-style packing)."""
    query = blocks * block
    mask = torch.zeros(1, 1, query, context + query, dtype=torch.bool)
    mask[..., :context] = True
    for n in range(blocks):
        mask[..., n * block : (n + 1) * block, context + n * block : context + (n + 1) * block] = True
    return mask


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_blocks_do_not_leak_into_each_other(implementation):
    model = tiny_draft(seed=5, attn_implementation=implementation).eval()
    inputs = draft_inputs(model.config, batch=1, context=3, blocks=3)
    inputs["attention_mask"] = _block_diagonal_mask(3, 3, model.block_size)
    changed = dict(inputs, noise_embedding=inputs["noise_embedding"].clone())
    changed["noise_embedding"][:, 4:8] += 5.0  # block 1 only
    with torch.no_grad():
        before, after = model(**inputs), model(**changed)
    torch.testing.assert_close(before[:, :4], after[:, :4], rtol=0, atol=0)
    torch.testing.assert_close(before[:, 8:], after[:, 8:], rtol=0, atol=0)
    assert not torch.allclose(before[:, 4:8], after[:, 4:8])


def test_eager_equals_sdpa_with_masks():
    sdpa = tiny_draft(seed=6, attn_implementation="sdpa", **HYBRID).eval()
    eager = tiny_draft(seed=6, attn_implementation="eager", **HYBRID).eval()
    assert eager.config._attn_implementation == "eager"
    inputs = draft_inputs(sdpa.config, batch=2, context=5, blocks=2)
    inputs["attention_mask"] = _block_diagonal_mask(5, 2, 4)
    with torch.no_grad():
        torch.testing.assert_close(sdpa(**inputs), eager(**inputs), atol=1e-5, rtol=1e-5)
        del inputs["attention_mask"]
        torch.testing.assert_close(sdpa(**inputs), eager(**inputs), atol=1e-5, rtol=1e-5)


def test_dict_mask_is_picked_per_layer_type_and_missing_types_fail():
    model = tiny_draft(seed=7, **HYBRID).eval()
    inputs = draft_inputs(model.config, batch=1, context=4)
    positions = inputs["position_ids"]
    masks = {
        "full_attention": block_visibility(positions[:, 4:], positions, False, None),
        "sliding_attention": block_visibility(positions[:, 4:], positions, True, 3),
    }
    assert masks["full_attention"] is None
    masks["full_attention"] = torch.ones(1, 1, 4, 8, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs, attention_mask=masks), model(**inputs), rtol=0, atol=0)
        with pytest.raises(ValueError, match="sliding_attention"):
            model(**inputs, attention_mask={"full_attention": masks["full_attention"]})


def test_block_visibility_truth_table():
    query = torch.tensor([[6, 7]])
    keys = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    causal_sliding = block_visibility(query, keys, causal=True, sliding_window=3)[0, 0]
    assert causal_sliding.int().tolist() == [
        [0, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
    ]
    symmetric = block_visibility(query, keys, causal=False, sliding_window=3)[0, 0]
    assert symmetric.int().tolist() == [
        [0, 1, 1, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 1, 1],
    ]
    assert block_visibility(query, keys, causal=True, sliding_window=None)[0, 0].int().tolist() == [
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
    ]
    assert block_visibility(query, keys, causal=False, sliding_window=None) is None


def test_cached_decoding_equals_full_context_forward():
    """The z-lab loop: context goes into the cache block by block and is cropped after each block."""
    model = tiny_draft(seed=8, **HYBRID).eval()
    config = model.config
    block = model.block_size
    generator = torch.Generator().manual_seed(0)
    width = 2 * config.hidden_size
    features = torch.randn(1, 9, width, generator=generator)
    first_block = torch.randn(1, block, config.hidden_size, generator=generator)
    second_block = torch.randn(1, block, config.hidden_size, generator=generator)
    cache = DynamicCache()
    with torch.no_grad():
        model(
            position_ids=torch.arange(5 + block)[None],
            noise_embedding=first_block,
            target_hidden=features[:, :5],
            past_key_values=cache,
            use_cache=True,
        )
        cache.crop(-block)  # drop the block, keep the context (z-lab `_crop_to`)
        cached = model(
            position_ids=torch.arange(5, 9 + block)[None],
            noise_embedding=second_block,
            target_hidden=features[:, 5:],
            past_key_values=cache,
            use_cache=True,
        )
        full = model(
            position_ids=torch.arange(9 + block)[None],
            noise_embedding=second_block,
            target_hidden=features,
        )
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_rotary_matches_transformers_qwen3_rotary():
    config = tiny_config(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    positions = torch.tensor([[0, 3, 17, 1000, 4095]])
    cos, sin = DFlashRotaryEmbedding(config.head_dim, config.rope_base)(positions, torch.float32)
    their_cos, their_sin = Qwen3RotaryEmbedding(config)(torch.zeros(1, 5, config.head_dim), positions)
    torch.testing.assert_close(cos[:, 0], their_cos, rtol=0, atol=0)
    half = config.head_dim // 2  # rotate-half's sign lives in the first half of our sin
    torch.testing.assert_close(
        sin[:, 0], torch.cat([-their_sin[..., :half], their_sin[..., half:]], -1), rtol=0, atol=0
    )
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, config.head_dim, generator=generator)  # the last 3 positions
    key = torch.randn(1, 2, 5, config.head_dim, generator=generator)
    ours = apply_rotary(query, key, cos, sin)
    expected_query, _ = apply_rotary_pos_emb(query, query, their_cos[:, -3:], their_sin[:, -3:])
    _, expected_key = apply_rotary_pos_emb(key, key, their_cos, their_sin)
    torch.testing.assert_close(ours[0], expected_query, rtol=0, atol=0)
    torch.testing.assert_close(ours[1], expected_key, rtol=0, atol=0)


def test_compute_logits_multiplies_then_softcaps():
    model = tiny_draft(
        seed=9, dflash_config={**tiny_config().dflash_config, "output_multiplier": 0.5, "final_logit_softcapping": 2.0}
    )
    head = torch.zeros(50, 32)
    head[0, 0], head[1, 0] = 8.0, -1.0
    hidden = torch.zeros(1, 1, 32)
    hidden[..., 0] = 1.0
    logits = model.compute_logits(hidden, head)
    assert logits.dtype == torch.float32
    # z = 8 -> 2 * tanh((0.5 * 8) / 2) = 2 tanh(2); softcap-then-multiply would give 0.5 * 2 tanh(4).
    assert logits[0, 0, 0].item() == pytest.approx(2 * torch.tanh(torch.tensor(2.0)).item(), abs=1e-6)
    assert logits[0, 0, 1].item() == pytest.approx(2 * torch.tanh(torch.tensor(-0.25)).item(), abs=1e-6)
    torch.testing.assert_close(logits, unary_transform(hidden @ head.T, 0.5, 2.0))
    lm_head = torch.nn.Linear(32, 50, bias=False)
    lm_head.weight.data.copy_(head)
    torch.testing.assert_close(model.compute_logits(hidden, lm_head), logits)


def test_compute_logits_without_transform_is_raw_head():
    model = tiny_draft(seed=9)
    hidden = torch.randn(2, 3, 32)
    head = torch.randn(50, 32)
    torch.testing.assert_close(model.compute_logits(hidden, head), hidden @ head.T)


def test_input_validation_errors():
    model = tiny_draft(seed=10).eval()
    inputs = draft_inputs(model.config, batch=1, context=4)
    two_blocks = draft_inputs(model.config, batch=1, context=4, blocks=2)
    with pytest.raises(ValueError, match="not a multiple of the block size 4"):  # 1.5 blocks
        model(
            **dict(
                two_blocks,
                noise_embedding=two_blocks["noise_embedding"][:, :6],
                position_ids=two_blocks["position_ids"][:, :10],
            )
        )
    with pytest.raises(ValueError, match="target_hidden has width 32, expected 64"):
        model(**dict(inputs, target_hidden=inputs["target_hidden"][..., :32]))
    with pytest.raises(ValueError, match="position_ids must cover context \\+ block"):
        model(**dict(inputs, position_ids=inputs["position_ids"][:, 1:]))
    flash = tiny_draft(seed=10)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="cannot express DFlash block masks"):
        flash(**inputs)
    flash.config._attn_implementation = "flex_attention"
    # its parameters require grad and torch has no CPU backward for flex (no-grad use: test_flex_cpu.py)
    with pytest.raises(ValueError, match="flex_attention' runs on CPU without gradients only"):
        flash(**inputs)


def test_draft_owns_no_embedding_and_no_head():
    model = tiny_draft(seed=11)
    assert model.get_input_embeddings() is None
    assert model.get_output_embeddings() is None
    names = list(model.state_dict())
    assert not any("embed" in name or "lm_head" in name for name in names)
    assert model._no_split_modules == {"DFlash2DecoderLayer"}


def test_v1_and_v2_classes_reject_each_others_configs():
    from tests.support.drafts import tiny_v1_config

    with pytest.raises(ValueError, match="DFlash2DraftModel needs a DFlash2DraftModel config"):
        DFlash2DraftModel(tiny_v1_config())
    with pytest.raises(ValueError, match="DFlashDraftModel needs a DFlashDraftModel config"):
        DFlashDraftModel(tiny_config())


def _selector_loss(model, inputs):
    hidden = model(**inputs)
    head = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    unary = model.compute_logits(hidden, head)
    predecessors = torch.randint(0, 50, hidden.shape[:2], generator=torch.Generator().manual_seed(4))
    scores = model.candidate_selector.score(hidden, unary, predecessors).scores
    return hidden.square().mean() + torch.logsumexp(scores, dim=-1).mean()


def test_gradients_reach_every_parameter():
    model = tiny_draft(seed=12).train()
    _selector_loss(model, draft_inputs(model.config)).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_gradient_checkpointing_gives_identical_gradients():
    inputs = draft_inputs(tiny_config(), batch=2, context=5, blocks=2)
    plain = tiny_draft(seed=13).train()
    checkpointed = tiny_draft(seed=13).train()
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in checkpointed.layers)
    _selector_loss(plain, inputs).backward()
    _selector_loss(checkpointed, inputs).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_qwen3_forward_bit_for_bit_and_its_gradients(dtype):
    generator = torch.Generator().manual_seed(3)
    ours, theirs = DFlashRMSNorm(16, eps=1e-6).to(dtype), Qwen3RMSNorm(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, generator=generator))
        ours.weight.copy_(theirs.weight)
    hidden = torch.randn(2, 3, 4, 16, generator=generator).to(dtype).requires_grad_(True)
    hidden_copy = hidden.detach().clone().requires_grad_(True)
    output, expected = ours(hidden), theirs(hidden_copy)
    assert output.dtype == expected.dtype == dtype
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    grad = torch.randn(expected.shape, generator=generator).to(dtype)
    output.backward(grad)
    expected.backward(grad)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(hidden.grad, hidden_copy.grad, **tolerance)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, **tolerance)


def test_rms_norm_gradient_is_exact_in_double_and_skips_a_frozen_weight():
    norm = DFlashRMSNorm(8, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    hidden = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, w: _RMSNormFunction.apply(h, w, 1e-5), (hidden, norm.weight))
    norm.weight.requires_grad_(False)
    norm(hidden).sum().backward()
    assert norm.weight.grad is None and hidden.grad is not None


def test_grouped_sdpa_on_cpu_equals_transformers_sdpa_with_repeated_heads():
    generator = torch.Generator().manual_seed(8)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, False
    query = torch.randn(2, 6, 5, 8, generator=generator, requires_grad=True)
    key = torch.randn(2, 2, 9, 8, generator=generator, requires_grad=True)
    value = torch.randn(2, 2, 9, 8, generator=generator, requires_grad=True)
    mask = torch.rand(2, 1, 5, 9, generator=generator) > 0.4
    mask[..., 0] = True  # every query sees something
    ours, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=0.3)
    theirs, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, scaling=0.3, is_causal=False)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    grad = torch.randn(ours.shape, generator=generator)
    ours_grads = torch.autograd.grad(ours, (query, key, value), grad)
    theirs_grads = torch.autograd.grad(theirs, (query, key, value), grad)
    for a, b in zip(ours_grads, theirs_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

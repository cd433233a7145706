"""The grouped dynamic causal convolution: hand values, block locality, identity init."""

from __future__ import annotations

import pytest
import torch

from modeling_dflash2 import DFlash2GroupedDynamicConv, grouped_dynamic_causal_conv
from tests.support import naive_dflash
from tests.support.drafts import draft_inputs, tiny_draft


def test_conv_values_worked_by_hand():
    # H = 2 channels, one channel per group, k = 2 taps, blocks of 2, two blocks.
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]])
    base = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    dynamic = torch.zeros(1, 4, 2, 2)
    dynamic[0, 1, 1, 0] = 0.5  # t = 1, tap 1, group 0
    dynamic[0, 3, 0, 1] = 1.0  # t = 3, tap 0, group 1
    out = grouped_dynamic_causal_conv(x, base, dynamic, block_size=2)
    # t=0: [1*1, 2*2]; t=1: [1*3, 2*4] + [(0.5+0.5)*1, -1*2]; t=2: block start, tap 1 reads zero;
    # t=3: [1*7, (2+1)*8] + [0.5*5, -1*6].
    assert out[0].tolist() == [[1.0, 4.0], [4.0, 6.0], [5.0, 12.0], [9.5, 18.0]]


def test_conv_groups_are_contiguous_channel_ranges():
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    base = torch.ones(1, 4)
    dynamic = torch.tensor([10.0, 100.0]).view(1, 1, 1, 2)
    out = grouped_dynamic_causal_conv(x, base, dynamic, block_size=1)
    # channel c uses group c // 2 (not c % 2, which would give [11, 202, 33, 404])
    assert out[0, 0].tolist() == [11.0, 22.0, 303.0, 404.0]


def test_conv_matches_naive_sum_over_several_blocks():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 8, generator=generator)
    base = torch.randn(3, 8, generator=generator)
    dynamic = torch.randn(2, 12, 3, 4, generator=generator)
    out = grouped_dynamic_causal_conv(x, base, dynamic, block_size=4)
    for row in range(2):
        expected = naive_dflash.conv(x[row].double(), base.double(), dynamic[row].double(), 4)
        torch.testing.assert_close(out[row].double(), expected, atol=1e-5, rtol=1e-5)


def test_conv_never_reads_across_a_block_start():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 8, 4, generator=generator)
    base = torch.randn(4, 4, generator=generator)
    dynamic = torch.randn(1, 8, 4, 2, generator=generator)
    before = grouped_dynamic_causal_conv(x, base, dynamic, block_size=4)
    changed = x.clone()
    changed[:, :4] += 100.0  # the whole first block
    after = grouped_dynamic_causal_conv(changed, base, dynamic, block_size=4)
    torch.testing.assert_close(before[:, 4:], after[:, 4:], rtol=0, atol=0)
    # ...whereas one long block would let the taps reach back
    leaked = grouped_dynamic_causal_conv(changed, base, dynamic, block_size=8)
    assert not torch.allclose(grouped_dynamic_causal_conv(x, base, dynamic, block_size=8)[:, 4:], leaked[:, 4:])


def test_conv_rejects_length_not_a_multiple_of_the_block():
    with pytest.raises(ValueError, match="sequence length 6 is not a multiple of the block size 4"):
        grouped_dynamic_causal_conv(torch.zeros(1, 6, 4), torch.zeros(2, 4), torch.zeros(1, 6, 2, 2), block_size=4)


def test_kernel_projection_rows_are_side_tap_group():
    conv = DFlash2GroupedDynamicConv(hidden_size=4, kernel_size=2, group_size=2)
    with torch.no_grad():
        conv.base_kernel.copy_(conv.identity_kernel())
        conv.kernel_projection.weight.zero_()
        conv.kernel_projection.weight[0 * 4 + 1 * 2 + 1, 0] = 1.0  # side 0, tap 1, group 1 <- x[:, 0]
        conv.kernel_projection.weight[1 * 4 + 0 * 2 + 0, 1] = 1.0  # side 1, tap 0, group 0 <- x[:, 1]
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]])
    prepared, (base_one, side_one) = conv.prepare(x, block_size=2)
    assert torch.equal(base_one, conv.base_kernel[1])
    # side 0: t=1 adds x[t,0] * x[t-1, c] on group 1 (channels 2, 3): 5 * [3, 4]
    assert prepared[0].tolist() == [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0 + 15.0, 8.0 + 20.0]]
    assert side_one[0, :, 0, 0].tolist() == [2.0, 6.0]  # tap 0, group 0 = x[t, 1]
    assert side_one[0].abs().sum() == 8.0
    finished = conv.finish(torch.ones(1, 2, 4), (base_one, side_one), block_size=2)
    assert finished[0].tolist() == [[3.0, 3.0, 1.0, 1.0], [7.0, 7.0, 1.0, 1.0]]


def test_fresh_conv_is_an_exact_identity_after_post_init():
    model = tiny_draft(seed=0, randomized=False)
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert conv.base_kernel[:, 0].eq(1).all() and conv.base_kernel[:, 1:].eq(0).all()
            assert conv.kernel_projection.weight.eq(0).all()
    # post_init again (as a subclass or a wrapper might) keeps the identity
    model.post_init()
    x = torch.randn(2, 8, 32)
    for layer in model.layers:
        prepared, dynamic = layer.attention_conv.prepare(x, block_size=4)
        assert torch.equal(prepared, x)
        assert torch.equal(layer.attention_conv.finish(x, dynamic, block_size=4), x)


def test_identity_convs_make_dflash2_equal_to_its_backbone():
    """With identity convs the DFlash2 layers compute exactly the v1 layers."""
    from modeling_dflash2 import DFlashDraftModel
    from tests.support.drafts import tiny_v1_config

    model = tiny_draft(seed=3)
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            with torch.no_grad():
                conv.base_kernel.copy_(conv.identity_kernel())
                conv.kernel_projection.weight.zero_()
    v1 = DFlashDraftModel(tiny_v1_config())
    missing, unexpected = v1.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all("_conv." in k or "candidate_selector" in k for k in unexpected)
    inputs = draft_inputs(model.config, batch=2, context=5, blocks=2)
    with torch.no_grad():
        assert torch.equal(model.eval()(**inputs), v1.eval()(**inputs))


def test_backward_reaches_kernel_projection_from_identity():
    model = tiny_draft(seed=4, randomized=False).train()
    model(**draft_inputs(model.config)).square().mean().backward()
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert conv.kernel_projection.weight.grad.abs().sum() > 0
            assert conv.base_kernel.grad.abs().sum() > 0


@pytest.mark.parametrize(("kernel_size", "block_size"), [(2, 4), (3, 4), (5, 4), (1, 2)])
def test_conv_hand_written_backward_is_exact(kernel_size, block_size):
    """gradcheck in double against finite differences, including taps longer than the block."""
    generator = torch.Generator().manual_seed(kernel_size)
    length = 3 * block_size
    x = torch.randn(2, length, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    base = torch.randn(kernel_size, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    dynamic = torch.randn(2, length, kernel_size, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: grouped_dynamic_causal_conv(a, b, c, block_size), (x, base, dynamic)
    )


def test_conv_gradients_match_the_naive_sum_through_strided_kernel_views():
    """As the module calls it: one side of a shared [b, L, 2, k, G] projection and of the base pair."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 8, generator=generator, requires_grad=True)
    projection = torch.randn(2, 8, 2, 2, 4, generator=generator, requires_grad=True)
    base = torch.randn(2, 2, 8, generator=generator, requires_grad=True)
    out = grouped_dynamic_causal_conv(x, base[1], projection[..., 1, :, :], 4)
    (out * out).sum().backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (x, projection, base)]
    expected = torch.stack([naive_dflash.conv(leaves[0][r], leaves[2][1], leaves[1][r, :, 1], 4) for r in range(2)])
    (expected * expected).sum().backward()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip((x, projection, base), leaves, strict=True):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-4)

"""The fused LM head + cross-entropy and the candidates' unary logits, against plain autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modeling_dflash2 import unary_transform
from trainer.objective.loss_head import candidate_unary, fused_unary_cross_entropy


def _plain(hidden, weight, labels, weights, multiplier, softcap):
    unary = unary_transform(F.linear(hidden, weight), multiplier, softcap)
    nll = torch.logsumexp(unary, -1) - unary.gather(1, labels[:, None])[:, 0]
    return (nll * weights).sum(), nll, unary


@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.5, 3.0)])
def test_fused_head_equals_plain_autograd_in_value_gradient_and_outputs(multiplier, softcap):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator)
    labels = torch.randint(0, 50, (7,), generator=generator)
    weights = torch.rand(7, generator=generator)
    head = fused_unary_cross_entropy(hidden, weight, labels, lambda nll: weights, multiplier, softcap, top_k=4)
    (grad,) = torch.autograd.grad(head.numerator, hidden)
    plain_hidden = hidden.detach().clone().requires_grad_(True)
    numerator, nll, unary = _plain(plain_hidden, weight, labels, weights, multiplier, softcap)
    (plain_grad,) = torch.autograd.grad(numerator, plain_hidden)
    torch.testing.assert_close(head.numerator, numerator, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.nll, nll.detach())
    top = torch.topk(unary.detach(), 4, dim=-1)
    assert torch.equal(head.top[1], top.indices) and torch.equal(head.argmax, top.indices[:, 0])
    torch.testing.assert_close(head.top[0], top.values)
    torch.testing.assert_close(head.gold, unary.detach().gather(1, labels[:, None])[:, 0])


@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (2.0, 5.0)])
def test_candidate_unary_gradient_is_the_dot_product_formulation(multiplier, softcap):
    """Values from the head pass, gradient through one embedding_bag: the same as transforming
    hidden . W[ids] under autograd."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 5, 16, generator=generator, requires_grad=True)
    weight = torch.randn(40, 16, generator=generator)
    ids = torch.randint(0, 40, (3, 5, 4), generator=generator)
    direct = unary_transform(torch.einsum("...h,...kh->...k", hidden, weight[ids]), multiplier, softcap)
    ours = candidate_unary(hidden, direct.detach(), weight, ids, multiplier, softcap)
    torch.testing.assert_close(ours, direct)
    upstream = torch.randn(direct.shape, generator=generator)
    (expected,) = torch.autograd.grad(direct, hidden, upstream)
    (grad,) = torch.autograd.grad(ours, hidden, upstream)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def test_under_autocast_a_16_bit_head_is_never_copied():
    """Mixed precision without FSDP: the hidden states are fp32, the target's head bf16; the GEMMs
    run in bf16 on the head as it is (a [V, H] copy per chunk would be 2.5 GB for Qwen3-8B)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CopiedShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default:
                self.shapes.append(tuple(out.shape))
            return out

    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 16, generator=generator, requires_grad=True)
    weight = torch.randn(64, 16, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, 64, (6,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16), CopiedShapes() as copies:
        head = fused_unary_cross_entropy(hidden, weight, labels, lambda nll: torch.ones_like(nll))
        head.numerator.backward()
    assert (64, 16) not in copies.shapes, copies.shapes
    assert hidden.grad.dtype == torch.float32 and torch.isfinite(hidden.grad).all()
    expected = F.cross_entropy(F.linear(hidden.detach().to(torch.bfloat16), weight).float(), labels, reduction="sum")
    torch.testing.assert_close(head.numerator, expected, rtol=1e-3, atol=1e-3)

"""The fused LM head + cross-entropy and the candidates' unary logits, against plain autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modeling_dflash2 import unary_transform
from trainer.loss_head import candidate_unary, fused_unary_cross_entropy


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

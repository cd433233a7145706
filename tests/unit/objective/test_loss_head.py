"""The fused LM head + cross-entropy and the candidates' unary logits, against plain autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from modeling_dflash2 import unary_transform
from trainer.objective import loss_head
from trainer.objective.loss_head import candidate_unary, fused_unary_cross_entropy, head_matmul


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


class CopiedShapes(TorchDispatchMode):
    """The shapes of every dtype copy (`.to(dtype)`, `.float()`) made inside it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            self.shapes.append(tuple(out.shape))
        return out


def test_under_autocast_a_16_bit_head_is_never_copied(monkeypatch):
    """Mixed precision without FSDP: the hidden states are fp32, the target's head bf16; the GEMMs
    run in bf16 on the head as it is (a [V, H] copy per chunk would be 2.5 GB for Qwen3-8B). On a
    device with native 16-bit GEMMs, as a GPU: the CPU's own path is the test below."""
    monkeypatch.setattr(loss_head, "EMULATED_16_BIT_GEMMS", ())
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cpu_forms_16_bit_head_gemms_in_float32_a_vocabulary_slice_at_a_time(monkeypatch, dtype):
    """On a CPU (emulated 16-bit GEMMs) both head GEMMs are the float32 product of the 16-bit
    operands rounded once, as a GPU's 16-bit GEMM; W is turned into float32 a slice of rows at a
    time, never whole; a float32 head is the plain product."""
    monkeypatch.setattr(loss_head, "HEAD_ROWS_PER_SLICE", 16)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 8, generator=generator).to(dtype)
    weight = torch.randn(40, 8, generator=generator).to(dtype)  # V = 40: slices of 16, 16 and 8 rows
    gradient = torch.randn(5, 40, generator=generator).to(dtype)
    with CopiedShapes() as copies:
        logits, grad_hidden = head_matmul(hidden, weight.t()), head_matmul(gradient, weight)
    assert logits.dtype == grad_hidden.dtype == dtype
    assert torch.equal(logits, (hidden.float() @ weight.float().t()).to(dtype))
    # partial sums over three slices: within one rounding of the one-shot product
    torch.testing.assert_close(grad_hidden, (gradient.float() @ weight.float()).to(dtype), rtol=1e-2, atol=1e-2)
    assert max(rows for rows, _ in copies.shapes if _ == 8) <= 16, copies.shapes  # W's copies: 16 rows at most
    assert (40, 8) not in copies.shapes and (8, 40) not in copies.shapes
    single = hidden.float()
    assert torch.equal(head_matmul(single, weight.float().t()), single @ weight.float().t())


def test_under_cpu_autocast_the_head_gemms_are_rounded_to_the_autocast_dtype():
    """fp32 hidden states and a bf16 head under CPU autocast: the GEMM sees both operands in bf16
    (what autocast gives a GPU) and returns bf16, now formed in float32."""
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 8, generator=generator)
    weight = torch.randn(24, 8, generator=generator).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head_matmul(hidden, weight.t())
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, (hidden.to(torch.bfloat16).float() @ weight.float().t()).to(torch.bfloat16))

"""Distillation from the target (loss_type kd / kd_weight): the fused head against plain autograd,
a hand-worked KL, a gradient check, the objective against the full-logits reference, and the wiring
of the teacher's rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.naive import naive_loss
from modeling_dflash2 import unary_transform
from tests.support.drafts import objective_batch, tiny_dflash_config, tiny_draft, tiny_v1_draft
from trainer.objective.blocks import AnchorDraw, build_blocks, sample_anchors
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import dflash_loss, draft_objective, teacher_rows
from trainer.objective.loss_head import Distillation, fused_unary_cross_entropy

HIDDEN, VOCAB = 32, 50  # tiny_config's sizes


def _plain(hidden, teacher, weight, labels, weights, multiplier, softcap, kd_weight, temperature):
    """Per-row (1 - w) NLL + w T^2 KL(softmax(t / T) || softmax(u / T)) under plain autograd."""
    unary = unary_transform(F.linear(hidden, weight), multiplier, softcap)
    target = unary_transform(F.linear(teacher, weight), multiplier, softcap)
    nll = torch.logsumexp(unary, -1) - unary.gather(1, labels[:, None])[:, 0]
    log_p, log_q = F.log_softmax(target / temperature, -1), F.log_softmax(unary / temperature, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1) * temperature**2
    return (((1 - kd_weight) * nll + kd_weight * kl) * weights).sum(), kl


@pytest.mark.parametrize(
    ("multiplier", "softcap", "kd_weight", "temperature"),
    [(1.0, None, 1.0, 1.0), (1.0, None, 0.5, 2.0), (0.5, 3.0, 0.25, 0.7)],
)
def test_fused_head_with_distillation_equals_plain_autograd(multiplier, softcap, kd_weight, temperature):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=generator, requires_grad=True)
    teacher = torch.randn(9, 16, generator=generator)
    weight = torch.randn(50, 16, generator=generator)
    labels = torch.randint(0, 50, (9,), generator=generator)
    weights = torch.rand(9, generator=generator)
    distillation = Distillation(teacher, kd_weight, temperature)
    head = fused_unary_cross_entropy(
        hidden, weight, labels, lambda nll: weights, multiplier, softcap, top_k=3, distillation=distillation
    )
    (grad,) = torch.autograd.grad(head.numerator, hidden)
    plain_hidden = hidden.detach().clone().requires_grad_(True)
    numerator, kl = _plain(plain_hidden, teacher, weight, labels, weights, multiplier, softcap, kd_weight, temperature)
    (plain_grad,) = torch.autograd.grad(numerator, plain_hidden)
    torch.testing.assert_close(head.numerator, numerator, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.kd, kl.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-5, atol=1e-6)


def test_kl_by_hand_and_zero_when_the_draft_matches_the_teacher():
    """Head = identity on 2 tokens. Draft logits (0, 0): q = (1/2, 1/2); teacher logits (ln 3, 0):
    p = (3/4, 1/4); KL = 3/4 ln(3/2) + 1/4 ln(1/2). A draft equal to the teacher has KL 0 and, with
    kd_weight 1, no gradient."""
    weight = torch.eye(2, dtype=torch.float64)
    hidden = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)
    ones = torch.ones(1, dtype=torch.float64)
    head = fused_unary_cross_entropy(
        hidden, weight, torch.tensor([0]), lambda nll: ones, distillation=Distillation(teacher, 1.0, 1.0)
    )
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert head.kd.item() == pytest.approx(expected, rel=1e-12)
    assert head.numerator.item() == pytest.approx(expected, rel=1e-12)
    # d KL / du = q - p = (1/2 - 3/4, 1/2 - 1/4)
    (grad,) = torch.autograd.grad(head.numerator, hidden)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, 0.25]], dtype=torch.float64))
    same = teacher.clone().requires_grad_(True)
    head = fused_unary_cross_entropy(
        same, weight, torch.tensor([0]), lambda nll: ones, distillation=Distillation(teacher, 1.0, 2.0)
    )
    assert head.kd.item() == pytest.approx(0.0, abs=1e-12)
    (grad,) = torch.autograd.grad(head.numerator, same)
    assert torch.allclose(grad, torch.zeros_like(grad), atol=1e-12)


def test_gradient_check_of_the_fused_head_with_distillation():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    weight = torch.randn(11, 6, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 11, (5,), generator=generator)
    weights = torch.rand(5, generator=generator, dtype=torch.float64)
    distillation = Distillation(teacher, 0.6, 1.5)

    def numerator(h):
        return fused_unary_cross_entropy(h, weight, labels, lambda nll: weights, 0.8, 2.5, distillation=distillation)

    assert torch.autograd.gradcheck(lambda h: numerator(h).numerator, (hidden,))


@pytest.mark.parametrize(
    ("loss_type", "kd_weight", "temperature"), [("kd", None, 1.0), ("ce", 0.5, 2.0), ("dpace", 0.3, 1.0)]
)
def test_objective_equals_the_full_logits_reference(loss_type, kd_weight, temperature):
    """The chunked objective (teacher rows gathered per chunk) against `naive_loss`, which forms the
    target's logits at every context position and the draft's for every block; the selector term is
    the cross-entropy recipe's, unchanged."""
    model = tiny_draft(seed=4)
    input_ids, loss_mask, _, _, head, target_final = objective_batch(4, final_hidden=True)
    anchors = sample_anchors(loss_mask, 5, AnchorDraw(4, 0))
    blocks = build_blocks(input_ids, loss_mask, *anchors, model.block_size, model.mask_token_id)
    hidden = torch.randn(2, 5 * model.block_size, HIDDEN, generator=torch.Generator().manual_seed(4))
    config = ObjectiveConfig(loss_type=loss_type, kd_weight=kd_weight, kd_temperature=temperature, chunk_blocks=2)
    result = dflash_loss(model, hidden, blocks, head, config, target_final_hidden=target_final)
    if loss_type != "dpace":  # the reference knows the decay weighting only
        with torch.no_grad():
            expected = naive_loss(model, hidden, blocks, head, config, 1.0, target_final)
        torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    plain_type = "dpace" if loss_type == "dpace" else "ce"  # the same position weighting, no distillation
    plain = dflash_loss(model, hidden, blocks, head, ObjectiveConfig(loss_type=plain_type, chunk_blocks=2))
    torch.testing.assert_close(result.terms["loss_selector"][0], plain.terms["loss_selector"][0])
    torch.testing.assert_close(result.denominator, plain.denominator)
    # D-PACE weights come from the cross-entropy, so the mix is exactly (1 - w) CE + w KD per slot
    weight = config.resolved_kd_weight
    kd_numerator = result.terms["loss_base"][0] - (1 - weight) * plain.terms["loss_base"][0]
    assert kd_numerator.item() > 0 and result.terms["kd_divergence"][0].item() > 0


def test_teacher_rows_by_hand():
    """Rows of 10 positions, N = 2 blocks of B = 4: slot k of the block at anchor a reads position
    a + k - 1; the second row's positions are offset by 10; past the end is clamped to 9."""
    input_ids = torch.zeros(2, 10, dtype=torch.long)
    loss_mask = torch.ones(2, 10, dtype=torch.long)
    anchors, keep = torch.tensor([[2, 5], [1, 8]]), torch.ones(2, 2, dtype=torch.bool)
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, 4, 1)
    rows = teacher_rows(blocks, torch.tensor([0, 1, 2, 3]))
    assert rows.tolist() == [[2, 3, 4], [5, 6, 7], [11, 12, 13], [18, 19, 19]]
    assert teacher_rows(blocks, torch.tensor([3])).tolist() == [[18, 19, 19]]


def test_chunked_equals_unchunked_with_distillation_in_loss_and_gradients():
    model = tiny_draft(seed=6)
    input_ids, loss_mask, target_hidden, embedding, head, target_final = objective_batch(6, final_hidden=True)
    results, grads = [], []
    for chunk in (1, 1000):
        model.zero_grad(set_to_none=True)
        config = ObjectiveConfig(num_anchors=8, kd_weight=0.5, kd_temperature=2.0, chunk_blocks=chunk)
        result = draft_objective(
            model,
            input_ids,
            loss_mask,
            target_hidden,
            embedding,
            head,
            config,
            AnchorDraw(6, 0),
            target_final_hidden=target_final,
        )
        result.loss.backward()
        results.append(result)
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(results[0].loss, results[1].loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0].terms["kd_divergence"][0], results[1].terms["kd_divergence"][0])
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_v1_draft_distills_too():
    model = tiny_v1_draft(seed=7)
    input_ids, loss_mask, target_hidden, embedding, head, target_final = objective_batch(7, final_hidden=True)
    config = ObjectiveConfig(num_anchors=4, loss_type="kd")
    result = draft_objective(
        model,
        input_ids,
        loss_mask,
        target_hidden,
        embedding,
        head,
        config,
        AnchorDraw(7, 0),
        target_final_hidden=target_final,
    )
    # pure distillation: the base numerator is the position-weighted KD alone
    assert result.terms["loss_base"][0].item() == pytest.approx(result.terms["loss"][0].item())
    assert "loss_selector" not in result.terms and result.terms["kd_divergence"][1] > 0


def test_distilling_without_the_targets_final_states_is_refused():
    model = tiny_draft(seed=8)
    input_ids, loss_mask, target_hidden, embedding, head, _ = objective_batch(8, final_hidden=True)
    with pytest.raises(ValueError, match="final hidden states"):
        draft_objective(
            model, input_ids, loss_mask, target_hidden, embedding, head, ObjectiveConfig(loss_type="kd"), None
        )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kd_weight": 1.5}, "kd_weight"),
        ({"kd_weight": -0.1}, "kd_weight"),
        ({"kd_weight": float("nan")}, "kd_weight"),
        ({"loss_type": "kd", "kd_weight": 0.0}, "distills nothing"),
        ({"kd_temperature": 0.0}, "kd_temperature"),
        ({"kd_temperature": float("inf")}, "kd_temperature"),
    ],
)
def test_bad_distillation_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ObjectiveConfig(**settings)


def test_distillation_defaults():
    assert ObjectiveConfig(loss_type="kd").resolved_kd_weight == 1.0
    assert not ObjectiveConfig().distills and not ObjectiveConfig(loss_type="dpace").distills
    assert ObjectiveConfig(kd_weight=0.5).distills and ObjectiveConfig(loss_type="kd", kd_weight=0.25).distills


def test_distillation_honours_the_drafts_logit_transform():
    """Teacher and draft logits both go through the served transform (multiplier, then softcap)."""
    dfc = tiny_dflash_config(output_multiplier=0.5, final_logit_softcapping=1.5)
    model = tiny_draft(seed=9, dflash_config=dfc)
    input_ids, loss_mask, _, _, head, target_final = objective_batch(9, final_hidden=True)
    anchors = sample_anchors(loss_mask, 4, AnchorDraw(9, 0))
    blocks = build_blocks(input_ids, loss_mask, *anchors, model.block_size, model.mask_token_id)
    hidden = torch.randn(2, 4 * model.block_size, HIDDEN, generator=torch.Generator().manual_seed(9))
    config = ObjectiveConfig(loss_type="kd", gamma=0)
    result = dflash_loss(model, hidden, blocks, head, config, target_final_hidden=target_final)
    with torch.no_grad():
        expected = naive_loss(model, hidden, blocks, head, config, 1.0, target_final)
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)


def test_distillation_under_autocast_runs_on_the_16_bit_head_as_it_is():
    """Mixed precision: fp32 draft and teacher states, a bf16 head. Both heads' GEMMs run in bf16 on
    the head itself, the result matches the fp32 computation to bf16 rounding, and the gradient
    reaching the draft is fp32."""
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(6, 16, generator=generator, requires_grad=True)
    teacher = torch.randn(6, 16, generator=generator)
    weight = torch.randn(64, 16, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, 64, (6,), generator=generator)
    ones = torch.ones(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head = fused_unary_cross_entropy(
            hidden, weight, labels, lambda nll: ones, distillation=Distillation(teacher, 0.5, 2.0)
        )
        head.numerator.backward()
    assert hidden.grad.dtype == torch.float32 and torch.isfinite(hidden.grad).all()
    rounded = weight.float()
    expected, kl = _plain(
        hidden.detach().to(torch.bfloat16).float(), teacher.to(torch.bfloat16).float(), rounded, labels, ones,
        1.0, None, 0.5, 2.0,
    )  # fmt: skip
    torch.testing.assert_close(head.numerator, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(head.kd, kl, rtol=2e-2, atol=2e-2)

"""The objective: hand numbers, a naive second implementation, chunking, gradients, schedule."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.drafts import objective_batch, tiny_dflash_config, tiny_draft, tiny_v1_draft
from trainer.objective.blocks import AnchorDraw, build_blocks, sample_anchors
from trainer.objective.config import ObjectiveConfig, default_gamma, selector_alpha_at
from trainer.objective.loss import (
    configure_selector_training,
    decay_weights,
    dflash_loss,
    dpace_weights,
    draft_objective,
)
from trainer.objective.metrics import finalize_terms

VOCAB, HIDDEN = 50, 32


def test_alpha_schedule_pinned_values():
    config = ObjectiveConfig(selector_alpha=0.9, selector_warmup_ratio=0.2, selector_ramp_ratio=0.3)
    assert [round(selector_alpha_at(step, 10, config), 10) for step in range(7)] == [0, 0, 0.3, 0.6, 0.9, 0.9, 0.9]
    assert selector_alpha_at(None, None, config) == 0.9
    assert selector_alpha_at(0, 10, ObjectiveConfig(selector_alpha=0.5)) == 0.5


@pytest.mark.parametrize(
    "bad",
    [
        {"selector_alpha": -0.1},
        {"selector_alpha": float("nan")},
        {"loss_type": "tv"},
        {"selector_gold": "always"},
        {"dpace_weighting": "middle"},
        {"chunk_blocks": 0},
        {"selector_warmup_ratio": 1.5},
        {"num_anchors": 0},
    ],
)
def test_invalid_objective_settings_are_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ObjectiveConfig(**bad)


def test_decay_weights_and_defaults():
    torch.testing.assert_close(decay_weights(4, 2.0), torch.tensor([1.0, 1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert decay_weights(3, None).tolist() == [1.0, 1.0, 1.0]
    assert (default_gamma(16), default_gamma(8), default_gamma(4)) == (7.0, 4.0, None)
    assert ObjectiveConfig(gamma=0).resolved_gamma(16) is None
    assert ObjectiveConfig().resolved_gamma(16) == 7.0


def test_dpace_weights_by_hand():
    # w = [0, 1, 1]; nll = [., ln 2, ln 4] -> q = [., 0.5, 0.25]; alpha 0.5 -> s = [1, 0.75, 0.625]
    nll = torch.tensor([[3.0, math.log(2), math.log(4)]])
    weights = torch.tensor([[0.0, 1.0, 1.0]])
    prefix = dpace_weights(nll, weights, 0.5, "prefix")
    torch.testing.assert_close(prefix, torch.tensor([[1.0, 0.75, 0.46875]]))
    torch.testing.assert_close(dpace_weights(nll, weights, 0.5, "full"), torch.tensor([[1.21875, 1.21875, 0.46875]]))
    torch.testing.assert_close(dpace_weights(nll, weights, 0.5, "suffix"), torch.tensor([[1.21875, 1.625, 1.0]]))


def _blocks_and_hidden(model, seed=0, num_anchors=6):
    input_ids, loss_mask, _target_hidden, _embedding, head = objective_batch(seed)
    anchors, keep = sample_anchors(loss_mask, num_anchors, AnchorDraw(seed, 0))
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, model.block_size, model.mask_token_id)
    hidden = torch.randn(2, num_anchors * model.block_size, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return blocks, hidden, head


@torch.no_grad()
def naive_objective(model, hidden, blocks, head, gamma, alpha, multiplier=1.0, softcap=None):
    """Loops over blocks and slots; the selector score as explicit sums over the rank."""
    selector = getattr(model, "candidate_selector", None)
    numerator = denominator = 0.0
    block = blocks.block_size
    for b in range(hidden.shape[0]):
        for n in range(blocks.num_blocks):
            for k in range(1, block):
                weight = float(blocks.weights[b, n, k])
                if weight == 0:
                    continue
                decay = math.exp(-(k - 1) / gamma) if gamma else 1.0
                h = hidden[b, n * block + k].double()
                z = head.double() @ h * multiplier
                u = softcap * torch.tanh(z / softcap) if softcap else z
                gold = int(blocks.labels[b, n, k])
                numerator += weight * decay * float(torch.logsumexp(u, 0) - u[gold])
                denominator += weight * decay
                if selector is None:
                    continue
                values, candidates = torch.topk(u, selector.top_k)
                if gold not in candidates.tolist():
                    continue
                predecessor = int(blocks.labels[b, n, k - 1])
                projected = selector.hidden_projection.weight.double() @ h
                scores = []
                for value, candidate in zip(values, candidates, strict=True):
                    bilinear = sum(
                        float(selector.predecessor_codebook[predecessor, r])
                        * float(projected[r])
                        * float(selector.successor_codebook[candidate, r])
                        for r in range(projected.numel())
                    )
                    scores.append(float(value) + bilinear)
                scores = torch.tensor(scores, dtype=torch.float64)
                index = candidates.tolist().index(gold)
                numerator += alpha * weight * decay * float(torch.logsumexp(scores, 0) - scores[index])
    return numerator / denominator


def test_loss_matches_naive_implementation_dflash2():
    model = tiny_draft(seed=0)
    blocks, hidden, head = _blocks_and_hidden(model)
    config = ObjectiveConfig(gamma=2.0, selector_alpha=0.7)
    result = dflash_loss(model, hidden, blocks, head, config)
    expected = naive_objective(model, hidden, blocks, head, gamma=2.0, alpha=0.7)
    assert result.loss.item() == pytest.approx(expected, rel=1e-5)
    assert result.terms["coverage"][0] < result.terms["coverage"][1]  # some gold outside the top-K


def test_loss_matches_naive_implementation_with_multiplier_then_softcap():
    dfc = tiny_dflash_config(output_multiplier=0.5, final_logit_softcapping=1.5)
    model = tiny_draft(seed=1, dflash_config=dfc)
    blocks, hidden, head = _blocks_and_hidden(model, seed=1)
    result = dflash_loss(model, hidden, blocks, head, ObjectiveConfig(gamma=0, selector_alpha=1.0))
    expected = naive_objective(model, hidden, blocks, head, gamma=None, alpha=1.0, multiplier=0.5, softcap=1.5)
    assert result.loss.item() == pytest.approx(expected, rel=1e-5)


def test_loss_matches_naive_implementation_v1():
    model = tiny_v1_draft(seed=2)
    blocks, hidden, head = _blocks_and_hidden(model, seed=2)
    result = dflash_loss(model, hidden, blocks, head, ObjectiveConfig(gamma=3.0))
    assert result.loss.item() == pytest.approx(naive_objective(model, hidden, blocks, head, 3.0, 0.0), rel=1e-5)
    assert "coverage" not in result.terms and "loss_selector" not in result.terms


def test_cross_entropy_by_hand():
    """One block of 3, decay off: logits are 0 except u[gold] = 2 at slot 1 and u[gold] = 0 at slot 2."""
    model = tiny_v1_draft(seed=3)
    head = torch.zeros(VOCAB, HIDDEN)
    head[7, 0] = 2.0
    hidden = torch.zeros(1, 4, HIDDEN)
    hidden[0, 1, 0] = 1.0
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    blocks = build_blocks(input_ids, torch.ones_like(input_ids), torch.tensor([[1]]), torch.tensor([[True]]), 4, 3)
    # slots 1, 2, 3 predict 7, 8, 9: nll = log(49 + e^2) - 2, log(50), log(50)
    result = dflash_loss(model, hidden, blocks, head, ObjectiveConfig(gamma=0))
    expected = (math.log(49 + math.e**2) - 2 + 2 * math.log(50)) / 3
    assert result.loss.item() == pytest.approx(expected, rel=1e-6)
    assert result.terms["accuracy"][0].item() == 1.0 and result.terms["accuracy"][1].item() == 3.0


def test_dpace_loss_uses_dpace_weights_in_numerator_and_denominator():
    model = tiny_v1_draft(seed=4)
    blocks, hidden, head = _blocks_and_hidden(model, seed=4)
    result = dflash_loss(model, hidden, blocks, head, ObjectiveConfig(loss_type="dpace", dpace_alpha=0.3))
    logits = hidden.view(-1, 4, HIDDEN) @ head.T
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, blocks.labels.view(-1, 4, 1))[..., 0]
    weights = blocks.weights.view(-1, 4)
    position_weight = weights * dpace_weights(nll, weights, 0.3, "full")
    # normalised by the supervised-slot count, which a trainer can pool before the forward pass
    expected = (nll * position_weight).sum() / weights.sum()
    assert result.loss.item() == pytest.approx(expected.item(), rel=1e-5)


def _all_grads(model):
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def _draft_run(model, config, alpha=None, chunk=None, seed=0, backward=True):
    input_ids, loss_mask, target_hidden, embedding, head = objective_batch(seed)
    if chunk is not None:
        config = ObjectiveConfig(**{**config.__dict__, "chunk_blocks": chunk})
    model.zero_grad(set_to_none=True)
    result = draft_objective(
        model, input_ids, loss_mask, target_hidden, embedding, head, config, AnchorDraw(seed, 0), alpha=alpha
    )
    if backward:
        result.loss.backward()
    return result


@pytest.mark.parametrize("gold", ["skip", "insert"])
def test_chunked_equals_unchunked_in_loss_metrics_and_gradients(gold):
    model = tiny_draft(seed=5)
    config = ObjectiveConfig(num_anchors=8, selector_gold=gold, loss_type="dpace")
    one = _draft_run(model, config, chunk=1)
    one_grads = _all_grads(model)
    full = _draft_run(model, config, chunk=1000)
    torch.testing.assert_close(one.loss, full.loss, rtol=1e-6, atol=1e-6)
    assert set(one.terms) == set(full.terms)
    for name in one.terms:
        torch.testing.assert_close(one.terms[name][0], full.terms[name][0], rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(one.terms[name][1], full.terms[name][1], rtol=1e-6, atol=1e-6, msg=name)
    for name, grad in _all_grads(model).items():
        torch.testing.assert_close(one_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_all_masked_batch_gives_zero_loss_and_terms_without_nan():
    model = tiny_draft(seed=6)
    blocks, hidden, head = _blocks_and_hidden(model, seed=6)
    blocks.weights.zero_()
    hidden.requires_grad_(True)
    result = dflash_loss(model, hidden, blocks, head, ObjectiveConfig())
    assert result.loss.item() == 0.0
    result.loss.backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() == 0
    for name, (numerator, denominator) in result.terms.items():
        assert not numerator.any() and not denominator.any(), name
    assert finalize_terms(result.terms) == {}


def test_gradients_reach_every_draft_parameter_and_never_the_target():
    model = tiny_draft(seed=7)
    input_ids, loss_mask, target_hidden, embedding, head = objective_batch(7)
    embedding.requires_grad_(True)
    head_module = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    head_module.weight.data.copy_(head)
    with pytest.raises(ValueError, match="LM head must be frozen"):
        draft_objective(
            model, input_ids, loss_mask, target_hidden, embedding, head_module, ObjectiveConfig(), AnchorDraw(0, 0)
        )
    head_module.requires_grad_(False)
    result = draft_objective(
        model, input_ids, loss_mask, target_hidden, embedding, head_module, ObjectiveConfig(), AnchorDraw(0, 0)
    )
    result.loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert embedding.grad is None and head_module.weight.grad is None


def _backbone(grads):
    return {name: grad for name, grad in grads.items() if not name.startswith("candidate_selector")}


def test_stop_gradient_keeps_the_selector_term_out_of_the_backbone():
    model = tiny_draft(seed=8)
    _draft_run(model, ObjectiveConfig(selector_stop_gradient=True), alpha=1.0)
    stopped = _all_grads(model)
    _draft_run(model, ObjectiveConfig(), alpha=0.0)
    base_only = _all_grads(model)
    _draft_run(model, ObjectiveConfig(), alpha=1.0)
    coupled = _all_grads(model)
    for name, grad in _backbone(stopped).items():
        torch.testing.assert_close(grad, base_only[name], rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.allclose(grad, coupled[name]) for name, grad in _backbone(stopped).items())
    assert stopped["candidate_selector.successor_codebook"].abs().sum() > 0


def test_warmup_keeps_every_parameter_in_the_graph_with_zero_selector_gradient():
    model = tiny_draft(seed=9)
    config = ObjectiveConfig(selector_alpha=1.0, selector_warmup_ratio=0.5)
    alpha = selector_alpha_at(0, 10, config)
    assert alpha == 0.0
    result = _draft_run(model, config, alpha=alpha)
    assert result.alpha == 0.0
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        if name.startswith("candidate_selector"):
            assert parameter.grad.abs().sum() == 0, name
    assert result.terms["loss_selector"][0] > 0  # still computed, just weighted by zero
    assert result.loss.item() == pytest.approx((result.terms["loss_base"][0] / result.terms["loss_base"][1]).item())


def test_configured_alpha_zero_freezes_and_skips_the_selector():
    model = tiny_draft(seed=10)
    config = ObjectiveConfig(selector_alpha=0.0)
    configure_selector_training(model, config)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and not any(name.startswith("candidate_selector") for name in trainable)
    result = _draft_run(model, config)
    assert "loss_selector" not in result.terms and "coverage" not in result.terms
    assert all(p.grad is None for p in model.candidate_selector.parameters())


def test_gold_insertion_scores_gold_outside_the_top_k():
    """Gold forced out of the top-K: skip gives the selector nothing; insert puts gold in last place."""
    model = tiny_draft(seed=11)
    head = torch.zeros(VOCAB, HIDDEN)
    head[:, 0] = -torch.arange(VOCAB, dtype=torch.float32)  # token t has logit -t: top-5 is {0..4}
    hidden = torch.zeros(1, 4, HIDDEN)
    hidden[..., 0] = 1.0
    hidden[..., 1:] = torch.randn(1, 4, HIDDEN - 1) * 0.1
    input_ids = torch.tensor([[20, 30, 40, 45, 2]])
    blocks = build_blocks(input_ids, torch.ones_like(input_ids), torch.tensor([[0]]), torch.tensor([[True]]), 4, 3)
    skip = dflash_loss(model, hidden, blocks, head, ObjectiveConfig(gamma=0, selector_gold="skip"))
    insert = dflash_loss(model, hidden, blocks, head, ObjectiveConfig(gamma=0, selector_gold="insert"))
    assert skip.terms["coverage"][0].item() == 0 and skip.terms["loss_selector"][0].item() == 0
    assert insert.terms["loss_selector"][0].item() > 0
    # by hand for slot 1 (gold 30, predecessor 20): candidates [0, 1, 2, 3, 30] with unary [0, -1, -2, -3, -30]
    selector = model.candidate_selector
    projected = selector.hidden_projection(hidden[0, 1])
    candidates = torch.tensor([0, 1, 2, 3, 30])
    scores = (
        -candidates.float()
        + (selector.predecessor_codebook[20] * projected) @ selector.successor_codebook[candidates].T
    )
    slot_one = torch.logsumexp(scores, 0) - scores[4]
    assert slot_one.item() > 20  # gold's unary is far below the others
    assert insert.terms["loss_selector"][0].item() >= slot_one.item()


def test_tiny_draft_overfits_one_batch():
    torch.manual_seed(0)
    model = tiny_draft(seed=12, randomized=False)
    input_ids, loss_mask, target_hidden, embedding, head = objective_batch(12, batch=2, length=16)
    config = ObjectiveConfig(num_anchors=8, selector_alpha=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    history = []
    for step in range(80):
        result = draft_objective(
            model, input_ids, loss_mask, target_hidden, embedding, head, config, AnchorDraw(0, step % 4)
        )
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        history.append(finalize_terms(result.terms))
    first, last = history[0], history[-1]
    assert last["loss"] < 0.5 * first["loss"]
    assert last["accuracy"] > first["accuracy"] + 0.3
    assert last["tau_unary"] > first["tau_unary"] + 0.5
    assert last["tau_walk"] > first["tau_walk"] + 0.5

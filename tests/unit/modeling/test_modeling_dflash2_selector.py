"""The candidate selector: hand scores, no-op init, teacher forcing vs the walk, ties, sampling."""

from __future__ import annotations

import pytest
import torch

from modeling_dflash2 import DFlash2CandidateSelector
from modeling_dflash2.modeling_dflash2 import SelectorLattice
from tests.support.drafts import tiny_draft


def _hand_selector() -> DFlash2CandidateSelector:
    selector = DFlash2CandidateSelector(vocab_size=4, hidden_size=2, rank=2, top_k=2)
    with torch.no_grad():
        selector.predecessor_codebook.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
        selector.successor_codebook.copy_(torch.tensor([[1.0, 2.0], [0.0, 1.0], [3.0, 0.0], [1.0, 1.0]]))
        selector.hidden_projection.weight.copy_(torch.eye(2))
    return selector


def test_score_is_unary_plus_transition_by_hand():
    selector = _hand_selector()
    hidden = torch.tensor([[2.0, 3.0]])
    unary = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    result = selector.score(hidden, unary, torch.tensor([2]))
    # top-2 = ids [1, 2] (unary 2.0, 1.0); A[2] * Ph = [2, 3]; Bs[1] . [2, 3] = 3, Bs[2] . [2, 3] = 6
    assert result.candidate_ids.tolist() == [[1, 2]]
    assert result.candidate_unary.tolist() == [[2.0, 1.0]]
    assert result.scores.tolist() == [[5.0, 7.0]]
    # predecessor 3 has a zero code: no transition, scores are the unary values
    assert selector.score(hidden, unary, torch.tensor([3])).scores.tolist() == [[2.0, 1.0]]


def test_walk_follows_its_own_choices_by_hand():
    selector = _hand_selector()
    hidden = torch.tensor([[[2.0, 3.0], [1.0, 1.0]]])
    unary = torch.tensor([[[0.5, 2.0, 1.0, -1.0], [2.0, 0.0, 0.0, 1.5]]])
    walk = selector.walk(hidden, unary, anchor_ids=torch.tensor([2]))
    # slot 0 after anchor 2: [5, 7] -> token 2; slot 1 candidates [0, 3] (2.0, 1.5),
    # A[2] * Ph = [1, 1]: Bs[0] -> 3, Bs[3] -> 2 -> scores [5, 3.5] -> token 0
    assert walk.scores.tolist() == [[[5.0, 7.0], [5.0, 3.5]]]
    assert walk.tokens.tolist() == [[2, 0]]
    assert walk.probs is None


def test_greedy_tie_goes_to_the_higher_unary_candidate():
    selector = _hand_selector()
    hidden = torch.tensor([[[1.0, 0.0]]])
    # candidates [1, 0] with unary [3, 2]; anchor 0: A[0] * Ph = [1, 0]; Bs[1] -> 0, Bs[0] -> 1: both 3
    unary = torch.tensor([[[2.0, 3.0, -5.0, -5.0]]])
    walk = selector.walk(hidden, unary, anchor_ids=torch.tensor([0]))
    assert walk.scores.tolist() == [[[3.0, 3.0]]]
    assert walk.candidate_ids.tolist() == [[[1, 0]]]
    assert walk.tokens.tolist() == [[1]]


def test_fresh_selector_is_an_exact_unary_no_op():
    model = tiny_draft(seed=0, randomized=False)
    selector = model.candidate_selector
    assert selector.successor_codebook.eq(0).all()
    assert selector.predecessor_codebook.std() > 0
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 32, generator=generator)
    unary = torch.randn(3, 7, 50, generator=generator)
    scores = selector.score(hidden, unary, torch.randint(0, 50, (3, 7), generator=generator))
    assert torch.equal(scores.scores, scores.candidate_unary)
    walk = selector.walk(hidden, unary, torch.tensor([1, 2, 3]))
    assert torch.equal(walk.tokens, unary.argmax(-1))


def test_teacher_forced_scores_equal_the_walks_own_scores():
    model = tiny_draft(seed=1)
    selector = model.candidate_selector
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 6, 32, generator=generator)
    unary = torch.randn(4, 6, 50, generator=generator) * 3
    anchors = torch.tensor([0, 7, 13, 49])
    walk = selector.walk(hidden, unary, anchors)
    predecessors = torch.cat([anchors[:, None], walk.tokens[:, :-1]], dim=1)
    teacher_forced = selector.score(hidden, unary, predecessors)
    assert torch.equal(teacher_forced.candidate_ids, walk.candidate_ids)
    torch.testing.assert_close(teacher_forced.scores, walk.scores, rtol=1e-6, atol=1e-6)
    # and the walk is not the unary argmax here (the selector is doing something)
    assert not torch.equal(walk.tokens, unary.argmax(-1))


def test_lattice_rows_equal_teacher_forced_scores_for_every_predecessor():
    model = tiny_draft(seed=2)
    selector = model.candidate_selector
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 3, 32, generator=generator)
    unary = torch.randn(2, 3, 50, generator=generator)
    anchors = torch.tensor([5, 6])
    lattice = selector.lattice(hidden, unary, anchors)
    torch.testing.assert_close(lattice.first_scores, selector.score(hidden[:, 0], unary[:, 0], anchors).scores)
    for slot in range(1, 3):
        for i in range(selector.top_k):
            predecessor = lattice.candidate_ids[:, slot - 1, i]
            expected = selector.score(hidden[:, slot], unary[:, slot], predecessor).scores
            torch.testing.assert_close(lattice.transitions[:, slot - 1, i], expected, rtol=1e-6, atol=1e-6)


def test_candidates_are_the_strict_top_k_of_transformed_logits():
    config_overrides = {"final_logit_softcapping": 1.5, "output_multiplier": 0.7}
    model = tiny_draft(seed=3, dflash_config={**tiny_draft().config.dflash_config, **config_overrides})
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 3, 32, generator=generator)
    head = torch.randn(50, 32, generator=generator)
    tokens, candidates, q = model.propose(hidden, torch.tensor([4]), head)
    transformed = model.compute_logits(hidden, head)
    values, ids = torch.topk(transformed, 5, dim=-1)
    assert torch.equal(candidates, ids)
    assert q is None and tokens.shape == (1, 3)
    scores = model.candidate_selector.score(hidden, transformed, torch.tensor([[4, 0, 0]]))
    torch.testing.assert_close(scores.candidate_unary, values)
    assert scores.candidate_unary.abs().max() <= 1.5


def test_sampled_walk_returns_q_and_is_reproducible():
    model = tiny_draft(seed=4)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 3, 32, generator=generator)
    head = torch.randn(50, 32, generator=generator)
    anchors = torch.tensor([1, 2])
    first = model.propose(hidden, anchors, head, temperature=0.7, generator=torch.Generator().manual_seed(9))
    second = model.propose(hidden, anchors, head, temperature=0.7, generator=torch.Generator().manual_seed(9))
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2])
    tokens, candidates, q = first
    assert q.shape == (2, 3, 5)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
    # q is softmax(S / T) of the rows the sampled path actually visited
    walk = model.candidate_selector.walk(
        hidden, model.compute_logits(hidden, head), anchors, 0.7, torch.Generator().manual_seed(9)
    )
    torch.testing.assert_close(q, torch.softmax(walk.scores / 0.7, dim=-1))
    picked = (candidates == tokens[..., None]).float()
    assert picked.sum(-1).eq(1).all()
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.propose(hidden, anchors, head, temperature=-1.0)


def test_sampling_frequencies_follow_q():
    selector = _hand_selector()
    hidden = torch.tensor([[[2.0, 3.0]]]).expand(4000, 1, 2)
    unary = torch.tensor([[[0.5, 2.0, 1.0, -1.0]]]).expand(4000, 1, 4)
    walk = selector.walk(
        hidden, unary, torch.full((4000,), 2), temperature=2.0, generator=torch.Generator().manual_seed(0)
    )
    # scores [5, 7] at T = 2 -> q = [1 / (1 + e), e / (1 + e)] = [0.2689, 0.7311]
    expected = torch.softmax(torch.tensor([5.0, 7.0]) / 2.0, dim=0)
    torch.testing.assert_close(walk.probs[0, 0], expected)
    frequency = (walk.tokens[:, 0] == 2).float().mean().item()
    assert abs(frequency - expected[1].item()) < 0.03  # 4000 draws: sd ~ 0.007


def test_selector_cross_entropy_reaches_all_three_factors():
    model = tiny_draft(seed=5)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 3, 32, generator=generator, requires_grad=True)
    unary = torch.randn(2, 3, 50, generator=generator)
    scores = model.candidate_selector.score(hidden, unary, torch.randint(0, 50, (2, 3), generator=generator))
    torch.nn.functional.cross_entropy(scores.scores.flatten(0, 1), torch.zeros(6, dtype=torch.long)).backward()
    selector = model.candidate_selector
    for parameter in (selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight):
        assert parameter.grad.abs().sum() > 0
    assert hidden.grad.abs().sum() > 0


def test_greedy_walk_equals_a_slot_by_slot_argmax_over_its_own_rows():
    """The pointer-following greedy walk against the obvious loop, on integer scores full of ties."""
    generator = torch.Generator().manual_seed(11)
    batch, slots, top_k = 5, 6, 4
    lattice = SelectorLattice(
        candidate_ids=torch.randint(0, 100, (batch, slots, top_k), generator=generator),
        first_scores=torch.randint(0, 3, (batch, top_k), generator=generator).float(),
        transitions=torch.randint(0, 3, (batch, slots - 1, top_k, top_k), generator=generator).float(),
    )
    walk = DFlash2CandidateSelector.walk_lattice(lattice)
    row, rows, tokens, pick = lattice.first_scores, [], [], None
    for slot in range(slots):
        if pick is not None:
            row = lattice.transitions[torch.arange(batch), slot - 1, pick]
        pick = torch.tensor([int(torch.nonzero(r == r.max())[0]) for r in row])  # first maximum
        rows.append(row)
        tokens.append(lattice.candidate_ids[torch.arange(batch), slot, pick])
    assert torch.equal(walk.tokens, torch.stack(tokens, dim=1))
    assert torch.equal(walk.scores, torch.stack(rows, dim=1))
    assert walk.probs is None

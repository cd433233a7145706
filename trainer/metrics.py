"""Training metrics as additive (numerator, denominator) pairs (objective.md §10).

Pairs add across chunks, micro-batches and ranks; a ratio is taken only at the end, so pooled
numbers are exact however the work was split. Acceptance lengths use the strict convention: the
leading run of correct slots over 1..B-1, the first unscored slot ends the run, blocks with no
scored slot are not counted, and the target's bonus token adds 1.
"""

from __future__ import annotations

import torch

MetricTerms = dict[str, tuple[torch.Tensor, torch.Tensor]]


def add_terms(total: MetricTerms, new: MetricTerms) -> MetricTerms:
    """Sum `new` into `total` (in place) and return it."""
    for name, (numerator, denominator) in new.items():
        if name in total:
            old_numerator, old_denominator = total[name]
            total[name] = (old_numerator + numerator, old_denominator + denominator)
        else:
            total[name] = (numerator, denominator)
    return total


def finalize_terms(terms: MetricTerms) -> dict[str, float]:
    """Ratios of the pooled pairs; a metric with nothing counted is left out rather than faked."""
    return {name: (n / d).item() for name, (n, d) in terms.items() if d.item() > 0}


def leading_run(correct: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of scored, correct slots: [..., T] bool -> [...] int."""
    return (correct & scored).long().cumprod(dim=-1).sum(dim=-1)


def acceptance_terms(correct: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of accepted + 1 over counted blocks, number of counted blocks) for [blocks, T] slots."""
    counted = scored.any(dim=-1)
    accepted = leading_run(correct, scored)
    return ((accepted + 1) * counted).sum().float(), counted.sum().float()


def unary_terms(predicted: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> MetricTerms:
    """Accuracy, per-position accuracy and teacher-forced acceptance of the unary argmax.

    All [blocks, B] with slot 0 the anchor (weight 0); `weights` binary.
    """
    correct = (predicted == labels).float() * weights
    terms: MetricTerms = {"accuracy": (correct.sum(), weights.sum())}
    per_position_correct, per_position_count = correct.sum(dim=0), weights.sum(dim=0)
    for slot in range(1, labels.shape[-1]):
        terms[f"accuracy_position_{slot}"] = (per_position_correct[slot], per_position_count[slot])
    scored = weights[:, 1:] > 0
    terms["tau_unary"] = acceptance_terms(predicted[:, 1:] == labels[:, 1:], scored)
    return terms


def selector_terms(
    covered: torch.Tensor,
    selector_correct: torch.Tensor,
    unary_correct: torch.Tensor,
    walk_correct: torch.Tensor,
    weights: torch.Tensor,
) -> MetricTerms:
    """DFlash2 metrics over the proposal slots 1..B-1, all [blocks, B-1].

    coverage: gold inside the strict unary top-K; selector_accuracy / unary_accuracy_covered and
    their difference (lift) on covered slots with the gold predecessor; tau_walk: the selector's
    own greedy walk from the anchor (what serving sees); tau_oracle: leading run of covered slots.
    """
    covered_weight = covered.float() * weights
    scored = weights > 0
    return {
        "coverage": (covered_weight.sum(), weights.sum()),
        "selector_accuracy": ((selector_correct.float() * covered_weight).sum(), covered_weight.sum()),
        "unary_accuracy_covered": ((unary_correct.float() * covered_weight).sum(), covered_weight.sum()),
        "selector_lift": (
            ((selector_correct.float() - unary_correct.float()) * covered_weight).sum(),
            covered_weight.sum(),
        ),
        "tau_walk": acceptance_terms(walk_correct, scored),
        "tau_oracle": acceptance_terms(covered, scored),
    }

"""Training metrics as additive (numerator, denominator) pairs (docs/objective.md §9, Metrics).

Pairs add across chunks, micro-batches and ranks; a ratio is taken only at the end, so pooled
numbers are exact however the work was split. Acceptance lengths use the strict convention: the
leading run of correct slots over 1..B-1, the first unscored slot ends the run, blocks with no
scored slot are not counted, and the target's bonus token adds 1.
"""

from __future__ import annotations

import torch

MetricTerms = dict[str, tuple[torch.Tensor, torch.Tensor]]
# A term whose numerator and denominator are vectors (accuracy_position) counts per proposal slot
# 1..B-1; it is logged as `<name>_<slot>`.


def add_terms(total: MetricTerms, new: MetricTerms) -> MetricTerms:
    """Sum `new` into `total` (in place) and return it."""
    for name, (numerator, denominator) in new.items():
        if name in total:
            old_numerator, old_denominator = total[name]
            total[name] = (old_numerator + numerator, old_denominator + denominator)
        else:
            total[name] = (numerator, denominator)
    return total


def flatten_terms(terms: MetricTerms) -> tuple[list[str], torch.Tensor]:
    """(log names, [2, m] numerators and denominators): one tensor to all-reduce across ranks, with a
    per-slot term expanded to one name per slot."""
    names, columns = [], []
    for name in sorted(terms):
        numerator, denominator = terms[name]
        pair = torch.stack([numerator, denominator]).float().reshape(2, -1)
        names += [name] if numerator.dim() == 0 else [f"{name}_{slot + 1}" for slot in range(pair.shape[1])]
        columns.append(pair)
    return names, torch.cat(columns, dim=1) if columns else torch.zeros(2, 0)


def ratios(names: list[str], pairs: torch.Tensor) -> dict[str, float]:
    """numerator / denominator by name; a metric with nothing counted is left out rather than faked."""
    numerators, denominators = pairs.tolist()
    return {name: n / d for name, n, d in zip(names, numerators, denominators, strict=True) if d > 0}


def finalize_terms(terms: MetricTerms) -> dict[str, float]:
    """Ratios of the pooled pairs."""
    return ratios(*flatten_terms(terms))


def leading_run(correct: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of scored, correct slots: [..., T] bool -> [...] int."""
    return (correct & scored).long().cumprod(dim=-1).sum(dim=-1)


def acceptance_terms(correct: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of accepted + 1 over counted blocks, number of counted blocks) for [..., blocks, T]
    slots; a leading axis of `correct` (several predictions of the same blocks) gives a vector."""
    counted = scored.any(dim=-1)
    accepted = leading_run(correct, scored)
    return ((accepted + 1) * counted).sum(dim=-1).float(), counted.sum().float()


def unary_terms(predicted: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> MetricTerms:
    """Accuracy, per-position accuracy and teacher-forced acceptance of the unary argmax.

    All [blocks, B] with slot 0 the anchor (weight 0); `weights` binary.
    """
    correct = predicted == labels
    per_slot = torch.stack([correct * weights, weights]).sum(dim=1)[:, 1:]  # [2, B-1]
    totals = per_slot.sum(dim=-1)
    return {
        "accuracy": (totals[0], totals[1]),
        "accuracy_position": (per_slot[0], per_slot[1]),
        "tau_unary": acceptance_terms(correct[:, 1:], weights[:, 1:] > 0),
    }


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
    covered_selector, covered_unary = covered & selector_correct, covered & unary_correct
    fields = torch.stack([weights > 0, covered, covered_selector, covered_unary]) * weights
    scored_sum, covered_sum, selector_sum, unary_sum = fields.sum(dim=(1, 2))
    tau, counted = acceptance_terms(torch.stack([walk_correct, covered]), weights > 0)
    return {
        "coverage": (covered_sum, scored_sum),
        "selector_accuracy": (selector_sum, covered_sum),
        "unary_accuracy_covered": (unary_sum, covered_sum),
        "selector_lift": (selector_sum - unary_sum, covered_sum),
        "tau_walk": (tau[0], counted),
        "tau_oracle": (tau[1], counted),
    }

"""Training metrics as additive (numerator, denominator) pairs (docs/objective.md §9, Metrics).

Pairs add across chunks, micro-batches and ranks; a ratio is taken only at the end, so pooled
numbers are exact however the work was split. That needs wide sums: every pair is float32 as the
objective forms it (`check_pooled` refuses anything narrower, e.g. a bf16 cast of the draft's
outputs by a mixed-precision wrapper), and sums kept over many steps (a logging interval, a whole
evaluation) are float64 (`accumulation_dtype`), where counts past 2^24 stay exact.

Acceptance lengths use the strict convention: the leading run of correct slots over 1..B-1, the
first unscored slot ends the run, blocks with no scored slot are not counted, and the target's
bonus token adds 1.
"""

from __future__ import annotations

import torch

MetricTerms = dict[str, tuple[torch.Tensor, torch.Tensor]]
POOLED_DTYPES = (torch.float32, torch.float64)
# A term whose numerator and denominator are vectors (accuracy_position) counts per proposal slot
# 1..B-1; it is logged as `<name>_<slot>`.


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for sums kept over many steps (gloo and NCCL both all-reduce it); float32 on Apple's MPS,
    which has no float64 (counts there stay exact up to 2^24)."""
    return torch.float32 if device.type == "mps" else torch.float64


def check_pooled(sums: dict[str, torch.Tensor]) -> None:
    """Refuse a pooled sum narrower than float32, at once: in bf16 a loss numerator is off by ~1e-3 and
    a count past 256 is rounded, so pooling over micro-batches and ranks would silently stop being
    exact. Costs a dtype comparison per sum (no device sync)."""
    for name, value in sums.items():
        if value.dtype not in POOLED_DTYPES:
            raise ValueError(
                f"pooled sum {name!r} of the objective is {value.dtype}, not float32: something cast the draft's "
                "outputs (an FSDP2 MixedPrecisionPolicy with output_dtype set, or a custom wrapper); leave the "
                "draft's outputs uncast (output_dtype None), as DFlash2Trainer does for accelerate's policy"
            )


def pooled_sums(terms: MetricTerms) -> dict[str, torch.Tensor]:
    """Every numerator and denominator of `terms` by a readable name (what `check_pooled` checks)."""
    sums = {}
    for name, (numerator, denominator) in terms.items():
        sums[f"{name} numerator"], sums[f"{name} denominator"] = numerator, denominator
    return sums


def add_terms(total: MetricTerms, new: MetricTerms) -> MetricTerms:
    """Sum `new` into `total` (in place) and return it; every sum must be float32 or float64."""
    check_pooled(pooled_sums(new))
    for name, (numerator, denominator) in new.items():
        if name in total:
            old_numerator, old_denominator = total[name]
            total[name] = (old_numerator + numerator, old_denominator + denominator)
        else:
            total[name] = (numerator, denominator)
    return total


def flatten_terms(terms: MetricTerms) -> tuple[list[str], torch.Tensor]:
    """(log names, [2, m] numerators and denominators): one tensor to all-reduce across ranks, with a
    per-slot term expanded to one name per slot. float64 if any sum is (else float32): never narrowed."""
    check_pooled(pooled_sums(terms))
    names, columns = [], []
    for name in sorted(terms):
        numerator, denominator = terms[name]
        pair = torch.stack([numerator, denominator]).reshape(2, -1)
        names += [name] if numerator.dim() == 0 else [f"{name}_{slot + 1}" for slot in range(pair.shape[1])]
        columns.append(pair)
    return names, torch.cat(columns, dim=1) if columns else torch.zeros(2, 0)  # cat promotes float32 to float64


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

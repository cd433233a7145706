"""Why real speculative τ is below the teacher-forced τ of training: the anchors decoding visits.

Greedy decoding verifies a block at anchor `a` (its newest token) and moves to `a + τ_a`. The
training objective scores the same block teacher-forced, given the target's tokens. For greedy
decoding the target's continuation *is* the decoded sequence, so at the anchors decoding visited
the two acceptance lengths must agree exactly (up to numerics, and a last block cut by
`max_new_tokens` or a stop token). Any gap between the training estimate and the served τ then
splits into which sequences are scored (the training eval set versus the decoded prompts) and
which anchors are scored (every valid position versus the ones decoding lands on: a long
accepted run covers many easy positions but is visited once).

`tau_gap_report` measures each piece with the training objective's own code (`draft_objective`,
anchors given) on the very sequences decoding produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
from torch import nn

from modeling_dflash2 import DFlash2CandidateSelector, DFlashDraftModel
from trainer.evaluation.speculative import with_stats
from trainer.models.target import FrozenTarget
from trainer.objective.blocks import build_blocks, sample_anchors
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import draft_objective
from trainer.objective.metrics import leading_run

PATH_MODES = {"selector": "walk", "unary": "unary"}  # decoding path -> its teacher-forced metric


def decoding_anchors(prompt_length: int, acceptance_lengths: Sequence[int]) -> list[int]:
    """The anchor of every verification step: the first generated token (position `prompt_length`),
    then each anchor plus the tokens its step produced."""
    if not acceptance_lengths:
        return []
    return list(accumulate(acceptance_lengths[:-1], initial=prompt_length))


@dataclass
class TeacherForcedAcceptance:
    """Teacher-forced acceptance lengths (accepted + 1) at each anchor, for the unary argmax and
    the selector walk (None for a draft without a selector), and the objective's pooled
    (numerator, denominator) pairs `tau_unary` / `tau_walk` over the same anchors."""

    anchors: list[int]
    unary: list[int]
    walk: list[int] | None
    pooled: dict[str, tuple[float, float]]

    def lengths(self, mode: str) -> list[int]:
        values = self.walk if mode == "walk" else self.unary
        if values is None:
            raise ValueError(f"no teacher-forced '{mode}' lengths: the draft has no selector")
        return values


class _HiddenRecorder(nn.Module):
    """Runs the draft as `draft_objective` calls it and keeps the hidden states the objective
    scored, so per-anchor lengths come from the very forward that gives the pooled metrics."""

    def __init__(self, draft: DFlashDraftModel):
        super().__init__()
        self.draft = draft
        self.hidden: torch.Tensor | None = None

    def forward(self, output_transform: Any, **inputs: Any) -> Any:
        def keep_then_score(hidden: torch.Tensor) -> Any:
            self.hidden = hidden
            return output_transform(hidden)

        return self.draft(**inputs, output_transform=keep_then_score)


@torch.no_grad()
def teacher_forced_acceptance(
    draft: DFlashDraftModel,
    target: FrozenTarget,
    sequence: torch.Tensor,
    prompt_length: int,
    anchors: Sequence[int] | None = None,
    config: ObjectiveConfig | None = None,
) -> TeacherForcedAcceptance:
    """Teacher-forced acceptance of one decoded `sequence` [S] (prompt then generated ids) at
    `anchors` (None: every valid position, as training's evaluation scores), through
    `draft_objective` with the loss mask on the generated tokens, the draft in eval mode."""
    draft.eval()
    device = target.device
    input_ids = torch.as_tensor(sequence, dtype=torch.long, device=device).reshape(1, -1)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[:, prompt_length:] = 1
    if anchors is None:
        anchor_ids, keep = sample_anchors(loss_mask, input_ids.shape[1], draw=None)
        anchor_ids, keep = anchor_ids[keep][None], keep[keep][None]
    else:
        anchor_ids = torch.tensor([list(anchors)], dtype=torch.long, device=device)
        keep = torch.ones_like(anchor_ids, dtype=torch.bool)
    dtype = next(draft.parameters()).dtype
    # (FrozenTarget.capture has no overload saying that without final_hidden it returns one tensor)
    features = target.capture(input_ids, None, draft.target_layer_ids).to(dtype)
    recorder = _HiddenRecorder(draft)
    result = draft_objective(
        draft,
        input_ids,
        loss_mask,
        features,
        target.embedding_weight,
        target.lm_head,
        config or ObjectiveConfig(),
        draw=None,
        anchors=(anchor_ids, keep),
        forward_module=recorder,
    )
    pooled = {name: (float(n), float(d)) for name, (n, d) in result.terms.items() if name in ("tau_unary", "tau_walk")}

    if recorder.hidden is None:
        raise RuntimeError("draft_objective did not run the draft's forward through forward_module")
    settings = draft.dflash
    blocks = build_blocks(input_ids, loss_mask, anchor_ids, keep, settings.block_size, settings.mask_token_id)
    proposal_hidden = recorder.hidden.reshape(-1, settings.block_size, recorder.hidden.shape[-1])[:, 1:]
    labels = blocks.labels[0]
    scored = blocks.weights[0, :, 1:] > 0
    logits = draft.compute_logits(proposal_hidden, target.lm_head)
    unary = leading_run(logits.argmax(dim=-1) == labels[:, 1:], scored) + 1
    walk = None
    selector = getattr(draft, "candidate_selector", None)
    if isinstance(selector, DFlash2CandidateSelector):
        walk_tokens = selector.walk(proposal_hidden, logits, labels[:, 0]).tokens
        walk = (leading_run(walk_tokens == labels[:, 1:], scored) + 1).tolist()
    return TeacherForcedAcceptance(anchor_ids[0].tolist(), unary.tolist(), walk, pooled)


def served_lengths(teacher_forced: Sequence[int], anchors: Sequence[int], sequence_length: int) -> list[int]:
    """Teacher-forced lengths as decoding would have reported them: a step cannot produce past the
    sequence's end (the `max_new_tokens` cut, or the stop token), so the bonus token is dropped
    when the accepted run reaches it."""
    room = sequence_length - 1 - torch.tensor(anchors, dtype=torch.long)
    return torch.minimum(torch.tensor(teacher_forced, dtype=torch.long), room).tolist()


def _ratio(pair: tuple[float, float]) -> float:
    numerator, denominator = pair
    return numerator / denominator if denominator > 0 else float("nan")


def _pool(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    return sum(pair[0] for pair in pairs), sum(pair[1] for pair in pairs)


def decode_and_force(
    target: FrozenTarget,
    draft: DFlashDraftModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: list[int] | None,
    path: str,
) -> dict[str, Any] | None:
    """One prompt decoded greedily along `path` ("selector" or "unary"), and the teacher-forced
    acceptance of the decoded sequence at the anchors decoding used and at every valid anchor;
    None when the first token already ended the answer (no verification step)."""
    mode = PATH_MODES[path]
    prompt_ids = torch.tensor([list(prompt)], device=target.device)
    output = with_stats(
        draft.spec_generate(
            target.model,
            prompt_ids,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            return_stats=True,
            use_selector=path == "selector",
        )
    )
    anchors = decoding_anchors(len(prompt), output.acceptance_lengths)
    if not anchors:
        return None
    sequence = output.output_ids[0]
    # a step before the last one drafted a whole block and was not cut: its lengths must be equal
    max_length = len(prompt) + max_new_tokens
    whole = [anchor + draft.block_size <= max_length for anchor in anchors[:-1]] + [False]
    at_real = teacher_forced_acceptance(draft, target, sequence, len(prompt), anchors)
    at_every = teacher_forced_acceptance(draft, target, sequence, len(prompt), None)
    return {
        "sequence": sequence.tolist(),
        "prompt_length": len(prompt),
        "anchors": anchors,
        "real": list(output.acceptance_lengths),
        "teacher_forced": at_real.lengths(mode),
        "served": served_lengths(at_real.lengths(mode), anchors, sequence.numel()),
        "whole_step": whole,
        "pooled_at_real": at_real.pooled,
        "pooled_at_every": at_every.pooled,
        "every_anchor": at_every.anchors,
        "teacher_forced_every_anchor": at_every.lengths(mode),
        "per_anchor_sums_equal_objective": all(
            sum(forced.lengths(name)) == forced.pooled[f"tau_{name}"][0]
            for forced in (at_real, at_every)
            for name in PATH_MODES.values()
            if f"tau_{name}" in forced.pooled
        ),
    }


def path_report(
    target: FrozenTarget,
    draft: DFlashDraftModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: list[int] | None,
    path: str,
) -> dict[str, Any]:
    """(a), (b) and (c) for one decoding path, pooled over the prompts; the per-prompt records too."""
    mode = PATH_MODES[path]
    decoded = [decode_and_force(target, draft, p, max_new_tokens, stop_token_ids, path) for p in prompts]
    records = [record for record in decoded if record is not None]
    if not records:
        raise ValueError("no prompt reached a verification step: every answer ended at its first token")
    real = [length for record in records for length in record["real"]]
    same = [int(s == r) for rec in records for s, r in zip(rec["served"], rec["real"], strict=True)]
    same_whole = [
        int(t == r)
        for rec in records
        for t, r, whole in zip(rec["teacher_forced"], rec["real"], rec["whole_step"], strict=True)
        if whole
    ]
    at_every = {
        name: _pool([record["pooled_at_every"][name] for record in records]) for name in records[0]["pooled_at_every"]
    }
    return {
        "mode": mode,
        "steps": len(real),
        "real_tau": sum(real) / len(real),
        "teacher_forced_tau_at_real_anchors": _ratio(_pool([r["pooled_at_real"][f"tau_{mode}"] for r in records])),
        "teacher_forced_tau_at_real_anchors_cut_like_decoding": (
            sum(sum(record["served"]) for record in records) / len(real)
        ),
        "same_acceptance_fraction": sum(same) / len(same),
        "whole_steps": len(same_whole),
        "same_acceptance_fraction_whole_steps": sum(same_whole) / max(len(same_whole), 1),
        "teacher_forced_tau_all_anchors": _ratio(at_every[f"tau_{mode}"]),
        "teacher_forced_tau_all_anchors_by_mode": {name: _ratio(pair) for name, pair in at_every.items()},
        "all_anchor_count": int(at_every[f"tau_{mode}"][1]),
        "per_anchor_sums_equal_objective": all(record["per_anchor_sums_equal_objective"] for record in records),
        "per_prompt": records,
    }


def tau_gap_report(
    target: FrozenTarget,
    draft: DFlashDraftModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    paths: Sequence[str] = ("selector", "unary"),
    training_summary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """(a) real τ, (b) teacher-forced τ at the anchors decoding visited and how often it equals the
    real length, (c) teacher-forced τ at every valid anchor of the same sequences, per path, and
    (d) the training evaluation's teacher-forced τ from `training_summary` (the run's trainer_state.json)."""
    if getattr(draft, "candidate_selector", None) is None:
        paths = [path for path in paths if path == "unary"]
    report: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "paths": {}}
    for path in paths:
        report["paths"][path] = path_report(target, draft, prompts, max_new_tokens, stop_token_ids, path)
    decoded = [[record["sequence"] for record in entry["per_prompt"]] for entry in report["paths"].values()]
    report["paths_decoded_the_same_sequences"] = all(sequences == decoded[0] for sequences in decoded)
    if training_summary is not None:
        trained = training_summary.get("trained", training_summary)
        report["training_eval"] = {
            mode: trained.get(f"eval_tau_{mode}") for mode in PATH_MODES.values() if f"eval_tau_{mode}" in trained
        }
    return report


def render_table(report: dict[str, Any]) -> str:
    """The report's headline numbers as one Markdown table, one row per path."""
    training = report.get("training_eval", {})
    rows = [
        "| path | (a) real τ | (b) teacher-forced τ at real anchors | same length at real anchors "
        "| (c) teacher-forced τ, every anchor of the same sequences | (d) training eval τ |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for path, entry in report["paths"].items():
        training_tau = training.get(entry["mode"])
        rows.append(
            f"| {path} ({entry['mode']}) | {entry['real_tau']:.3f} | {entry['teacher_forced_tau_at_real_anchors']:.3f} "
            f"(cut like decoding: {entry['teacher_forced_tau_at_real_anchors_cut_like_decoding']:.3f}) "
            f"| {entry['same_acceptance_fraction']:.1%} of {entry['steps']} steps "
            f"({entry['same_acceptance_fraction_whole_steps']:.1%} of {entry['whole_steps']} whole blocks) "
            f"| {entry['teacher_forced_tau_all_anchors']:.3f} ({entry['all_anchor_count']} anchors) "
            f"| {'n/a' if training_tau is None else f'{training_tau:.3f}'} |"
        )
    return "\n".join(rows)

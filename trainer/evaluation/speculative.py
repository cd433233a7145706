"""Speculative decoding for the evaluation code: thin wrappers over the shipped loop.

The loop itself is `DFlashDraftModel.spec_generate` in `modeling_dflash2` (z-lab's call, carried
by every checkpoint); these wrappers only turn its statistics into `SpeculativeResult` and run the
target alone through the same loop (block size 1) as the speed and lossless baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from modeling_dflash2 import DFlashDraftModel, SamplingSettings, SpeculativeOutput, speculative_generate


def with_stats(output: SpeculativeOutput | torch.Tensor) -> SpeculativeOutput:
    """The output of a loop run with `return_stats=True` (without, the loop returns only the ids).

    Checked by "not a tensor", not by class: a draft loaded with `trust_remote_code` returns the
    `SpeculativeOutput` of its own copy of the modeling files, a different class with the same fields."""
    if isinstance(output, torch.Tensor):
        raise TypeError("the speculative loop returned token ids only: call it with return_stats=True")
    return output


@dataclass
class SpeculativeResult:
    """New tokens (prompt excluded), tokens produced per step (accepted + bonus), and timings."""

    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def mean_acceptance(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @classmethod
    def from_output(cls, output: SpeculativeOutput | torch.Tensor) -> SpeculativeResult:
        output = with_stats(output)
        return cls(output.new_tokens, output.acceptance_lengths, output.time_to_first_token, output.decode_seconds)


def spec_generate(
    target: PreTrainedModel,
    draft: DFlashDraftModel,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: list[int] | None = None,
    use_selector: bool = True,
    generator: torch.Generator | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
) -> SpeculativeResult:
    """`draft.spec_generate(...)` with statistics, as a `SpeculativeResult`. Keyword-only after
    `input_ids`: the shipped call orders (max_new_tokens, stop_token_ids, temperature) differently,
    so a positional call written for one would swap two arguments of the other silently."""
    output = draft.spec_generate(
        target,
        input_ids,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        return_stats=True,
        use_selector=use_selector,
        generator=generator,
    )
    return SpeculativeResult.from_output(output)


def target_generate(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
) -> SpeculativeResult:
    """The target alone, one token per step through the same loop and calls (the baseline); keyword-only
    after `input_ids`, like `spec_generate`."""
    output = speculative_generate(
        target,
        None,
        input_ids,
        max_new_tokens,
        stop_token_ids,
        SamplingSettings(temperature, top_p, top_k),
        block_size=1,
        return_stats=True,
        generator=generator,
    )
    return SpeculativeResult.from_output(output)

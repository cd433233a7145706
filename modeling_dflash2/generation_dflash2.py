# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dflash2-hub authors. Shipped inside every exported checkpoint under this licence.
"""Speculative decoding with a DFlash draft: z-lab's decoding loop (`spec_generate`) and the
rejection sampling that keeps its output distributed as the target's.

`SpeculativeDecodingMixin` gives the draft models `spec_generate` and the per-block drafting step;
the loop itself, `speculative_generate`, also runs the target alone (the speed-up baseline). The
mixin's name avoids "GenerationMixin" on purpose: transformers treats any base so named as a
`generate()` model and would then write a generation_config.json into every checkpoint.

This file ships inside every checkpoint: it may import only torch, transformers and its siblings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from .ops_dflash2 import cast_to

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .configuration_dflash2 import DFlashSettings


@dataclass(frozen=True)
class SamplingSettings:
    """Temperature (0 = greedy), top-p (1 = off) and top-k (0 = off), checked once."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0 (got {self.temperature}).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}).")
        if self.top_k < 0 or int(self.top_k) != self.top_k:
            raise ValueError(f"top_k must be a non-negative integer (got {self.top_k}).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 sampling distribution [..., V], filtered in z-lab's order: logits / T; only the
        top-k logits; then, by falling probability, only tokens whose preceding mass is below
        top_p; renormalised."""
        scores = logits.float() / self.temperature
        kept_ids = None
        if 0 < self.top_k < scores.shape[-1]:
            scores, kept_ids = scores.topk(int(self.top_k), dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1:
            ranked, order = probs.sort(dim=-1, descending=True)
            ranked = ranked * ((ranked.cumsum(dim=-1) - ranked) < self.top_p)
            probs = torch.zeros_like(probs).scatter(-1, order, ranked)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        if kept_ids is None:
            return probs
        return probs.new_zeros(logits.shape).scatter(-1, kept_ids, probs)

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The next token from next-token logits [..., V]: argmax, or a draw from `probabilities`."""
        if self.greedy:
            return logits.argmax(dim=-1)
        return draw(self.probabilities(logits), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One sample per row of `probs` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


@dataclass
class BlockProposals:
    """The tokens a draft proposes for one block [1, n] and, when sampling, the distribution they
    were drawn from: `probs` [1, n, V] over the vocabulary, or [1, n, K] over `candidate_ids`
    [1, n, K] (the selector's candidates)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    candidate_ids: torch.Tensor | None = None

    def sampled_probs(self) -> torch.Tensor:
        """`probs`, which a sampled block carries (greedy proposals are never accepted by rejection)."""
        if self.probs is None:
            raise ValueError("greedy proposals carry no distribution to accept or reject them against")
        return self.probs

    def probability_of_tokens(self) -> torch.Tensor:
        """q of each proposed token [n]."""
        tokens, probs = self.tokens[0], self.sampled_probs()
        if self.candidate_ids is None:
            return probs[0].gather(-1, tokens[:, None])[:, 0]
        return (probs[0] * (self.candidate_ids[0] == tokens[:, None])).sum(dim=-1)

    def residual(self, target_probs: torch.Tensor, slot: int) -> torch.Tensor:
        """Where to draw after rejecting `slot`: (p - q)+ renormalised, or p if that is empty."""
        residual, probs = target_probs.clone(), self.sampled_probs()
        if self.candidate_ids is None:
            residual -= probs[0, slot]
        else:
            residual.scatter_add_(0, self.candidate_ids[0, slot], -probs[0, slot].to(residual.dtype))
        residual.clamp_(min=0)
        total = residual.sum()
        return residual / total if total > 0 else target_probs


def rejection_sample(
    proposals: BlockProposals, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, torch.Tensor]:
    """(accepted proposals, the target's token after them), so the output follows p exactly.

    target_probs [n + 1, V]: row i is the target's distribution after block token i. Proposal i is
    accepted while `u_i * q_i < p_i` (u uniform: probability min(1, p/q)); the first rejected slot
    draws from the residual, and a fully accepted block draws from the last row.
    """
    tokens = proposals.tokens[0]
    count = tokens.numel()
    p = target_probs[:count].gather(-1, tokens[:, None])[:, 0]
    q = proposals.probability_of_tokens()
    uniform = torch.rand(q.shape, generator=generator, device=q.device, dtype=q.dtype)
    accepted = int((uniform * q < p).int().cumprod(dim=0).sum())
    if accepted == count:
        return accepted, draw(target_probs[count], generator)
    return accepted, draw(proposals.residual(target_probs[accepted], accepted), generator)


@dataclass
class SpeculativeOutput:
    """`spec_generate(..., return_stats=True)`: z-lab's statistics and the decode time.

    acceptance_lengths: tokens produced per verification step (accepted proposals + the target's
    own token, cut at a stop token or `max_new_tokens`); the first token, from the prompt's
    prefill, is not a step. time_per_output_token is the decode time over num_output_tokens.
    """

    output_ids: torch.Tensor  # [1, prompt + generated] token ids (long)
    num_input_tokens: int
    num_output_tokens: int
    time_to_first_token: float
    time_per_output_token: float
    acceptance_lengths: list[int]
    decode_seconds: float

    @property
    def new_tokens(self) -> list[int]:
        return self.output_ids[0, self.num_input_tokens :].tolist()

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def _clock(device: torch.device) -> float:
    """Wall time once the device's queued work is done (CUDA launches are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _rollback_cache(config: Any = None) -> DynamicCache:
    """A cache that can be cut back to the verified prefix: the model's own layer kinds, with
    sliding-window layers recording their past so a rejected tail can be removed."""
    cache = DynamicCache() if config is None else DynamicCache(config=config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def keep_first(cache: Cache, length: int) -> None:
    """Cut `cache` back to its first `length` positions (no call when nothing is to go)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """`hidden_states[id + 1]` (the output of layer id) concatenated in `target_layer_ids` order."""
    return torch.cat([hidden_states[layer_id + 1] for layer_id in layer_ids], dim=-1)


def target_embedding_weight(target: PreTrainedModel) -> torch.Tensor:
    """The target's input embedding [V, H] (an embedding module's `weight` is its Parameter)."""
    return cast(torch.Tensor, target.get_input_embeddings().weight)


def target_output_head(target: PreTrainedModel) -> nn.Module:
    head = getattr(target, "lm_head", None)
    if head is None:
        head = target.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(target).__name__} has no LM head (lm_head or output embeddings) to verify with")
    return head


def _verify(
    proposed: torch.Tensor,
    proposals: BlockProposals | None,
    target_logits: torch.Tensor,
    sampling: SamplingSettings,
    generator: torch.Generator | None,
) -> tuple[int, torch.Tensor]:
    """(accepted proposals, the target's token after them) from its logits over the block [n+1, V]."""
    if sampling.greedy:
        posterior = target_logits.argmax(dim=-1)
        accepted = int((proposed == posterior[:-1]).int().cumprod(dim=0).sum())
        return accepted, posterior[accepted]
    target_probs = sampling.probabilities(target_logits)
    if proposals is None:
        return 0, draw(target_probs[-1], generator)
    return rejection_sample(proposals, target_probs, generator)


@torch.no_grad()
def speculative_generate(
    target: PreTrainedModel,
    draft: DraftModel | None,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: list[int] | None,
    sampling: SamplingSettings,
    *,
    block_size: int | None = None,
    return_stats: bool = False,
    use_selector: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor | SpeculativeOutput:
    """z-lab's decoding loop (`dflash_generate`) for one sequence.

    After the prompt's prefill, each step drafts the block `[anchor, mask x (n - 1)]`, the anchor
    being the newest token, with n = min(B, tokens left + 1) (so the final block may be short). The
    draft attends to the target features of the tokens verified by the previous step; earlier ones
    sit in its cache. The target verifies the block in one pass on its own cache, which is then cut
    back to the verified prefix. `draft=None` with `block_size=1` is the target alone through the
    same loop and calls, one token per step: the speed-up baseline.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"spec_generate decodes one sequence at a time (batch size 1); got input_ids of shape "
            f"{tuple(input_ids.shape)}."
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens}).")
    if block_size is None:
        block_size = draft.block_size if draft is not None else 1
    if (draft is None and block_size != 1) or (draft is not None and not 1 <= block_size <= draft.block_size):
        raise ValueError(f"block_size {block_size} needs a draft of at least that block size (1 = target alone).")
    device = target_embedding_weight(target).device
    prompt_length = input_ids.shape[1]
    max_length = prompt_length + max_new_tokens
    output_ids = torch.full(
        (1, max_length + 1), draft.mask_token_id if draft is not None else 0, dtype=torch.long, device=device
    )
    output_ids[:, :prompt_length] = input_ids
    positions = torch.arange(max_length + 1, device=device)[None]
    stops = torch.tensor(sorted(set(stop_token_ids or ())), dtype=torch.long, device=device)
    drafter = draft if block_size > 1 else None  # (checked above: a block over 1 has a draft)
    drafting = drafter is not None
    layer_ids = drafter.target_layer_ids if drafter is not None else []
    target_cache = _rollback_cache(target.config)
    draft_cache = DynamicCache() if drafting else None

    started = _clock(device)
    output = target(
        input_ids=output_ids[:, :prompt_length],
        position_ids=positions[:, :prompt_length],
        past_key_values=target_cache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=drafting,
    )
    output_ids[0, prompt_length] = sampling.pick(output.logits[0, -1], generator)
    context = target_features(output.hidden_states, layer_ids) if drafting else None
    time_to_first_token = _clock(device) - started

    started = _clock(device)
    acceptance_lengths: list[int] = []
    start = prompt_length  # the anchor's position: the newest token, which the target has not seen
    stopped = bool(torch.isin(output_ids[0, start], stops))
    while start + 1 < max_length and not stopped:
        size = min(block_size, max_length - start)
        block_ids = output_ids[:, start : start + size].clone()
        proposals = None
        # all three are set whenever size > 1 (block_size > 1: drafting, with the prefill's context)
        if size > 1 and drafter is not None and context is not None and draft_cache is not None:
            proposals = drafter.draft_block(
                target,
                context,
                block_ids,
                positions[:, start - context.shape[1] : start + size],
                draft_cache,
                sampling,
                use_selector,
                generator,
            )
            block_ids[:, 1:] = proposals.tokens
        verified = target(
            input_ids=block_ids,
            position_ids=positions[:, start : start + size],
            past_key_values=target_cache,
            use_cache=True,
            output_hidden_states=size > 1,
        )
        accepted, bonus = _verify(block_ids[0, 1:], proposals, verified.logits[0], sampling, generator)
        output_ids[:, start + 1 : start + accepted + 1] = block_ids[:, 1 : accepted + 1]
        output_ids[0, start + accepted + 1] = bonus
        produced = min(accepted + 1, max_length - start - 1)
        hits = torch.isin(output_ids[0, start + 1 : start + produced + 1], stops).nonzero()
        if hits.numel() > 0:
            produced, stopped = int(hits[0, 0]) + 1, True
        start += produced
        keep_first(target_cache, start)
        acceptance_lengths.append(produced)
        if size > 1:
            context = target_features(verified.hidden_states, layer_ids)[:, :produced]
    output_ids = output_ids[:, : min(start + 1, max_length)]
    if not return_stats:
        return output_ids
    decode_seconds = _clock(device) - started
    generated = output_ids.shape[1] - prompt_length
    return SpeculativeOutput(
        output_ids=output_ids,
        num_input_tokens=prompt_length,
        num_output_tokens=generated,
        time_to_first_token=time_to_first_token,
        time_per_output_token=decode_seconds / generated,
        acceptance_lengths=acceptance_lengths,
        decode_seconds=decode_seconds,
    )


class DraftModel(Protocol):
    """What decoding uses of a draft: a `DFlashDraftModel` (this mixin's methods, and what it supplies)."""

    dflash: DFlashSettings

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def block_size(self) -> int: ...

    @property
    def mask_token_id(self) -> int: ...

    @property
    def target_layer_ids(self) -> list[int]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def eval(self) -> Any: ...

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module | torch.Tensor) -> torch.Tensor: ...

    def draft_block(
        self,
        target: PreTrainedModel,
        context: torch.Tensor,
        block_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Cache,
        sampling: SamplingSettings,
        use_selector: bool = True,
        generator: torch.Generator | None = None,
    ) -> BlockProposals: ...

    def block_proposals(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        output_head: nn.Module | torch.Tensor,
        sampling: SamplingSettings,
        use_selector: bool = True,
        generator: torch.Generator | None = None,
    ) -> BlockProposals: ...


class SpeculativeDecodingMixin:
    """`spec_generate` and the drafting step it calls once per block, for `DFlashDraftModel`
    (which supplies `dflash`, `dtype`, `compute_logits` and its forward)."""

    def draft_block(
        self: DraftModel,
        target: PreTrainedModel,
        context: torch.Tensor,
        block_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Cache,
        sampling: SamplingSettings,
        use_selector: bool = True,
        generator: torch.Generator | None = None,
    ) -> BlockProposals:
        """One drafting pass while decoding: the block `block_ids` [1, n] = [anchor, mask, ...]
        embedded with the target's embedding, attending to `context` (target features of the
        newly verified tokens [1, c, n_layers * H]) and to the earlier context in `cache`, which
        keeps only the context afterwards. Proposes tokens for the n - 1 slots after the anchor."""
        embedding = target_embedding_weight(target)
        noise = F.embedding(block_ids, embedding) * self.dflash.input_embedding_scale
        hidden = self(
            position_ids=position_ids,
            noise_embedding=cast_to(noise, self.dtype),
            target_hidden=cast_to(context, self.dtype),
            past_key_values=cache,
            use_cache=True,
        )
        cache.crop(-block_ids.shape[1])
        return self.block_proposals(
            hidden[:, 1:], block_ids[:, 0], target_output_head(target), sampling, use_selector, generator
        )

    def block_proposals(
        self: DraftModel,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        output_head: nn.Module | torch.Tensor,
        sampling: SamplingSettings,
        use_selector: bool = True,
        generator: torch.Generator | None = None,
    ) -> BlockProposals:
        """Proposals from the draft's output at a block's proposal slots [1, n, H]: the unary
        argmax, or a draw from the unary distribution filtered like the target's (top-k, top-p)."""
        logits = self.compute_logits(hidden, output_head)
        if sampling.greedy:
            return BlockProposals(logits.argmax(dim=-1))
        probs = sampling.probabilities(logits)
        return BlockProposals(draw(probs, generator), probs)

    def spec_generate(
        self: DraftModel,
        target: PreTrainedModel,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        *,
        return_stats: bool = False,
        use_selector: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor | SpeculativeOutput:
        """Speculative decoding with `target` (a transformers causal LM): z-lab's call and result.

        Returns the ids [1, prompt + generated]: at most `max_new_tokens` new tokens, ending after
        the first token of `stop_token_ids` (kept). Greedy (`temperature=0`) gives exactly the
        target's greedy tokens; sampling follows the target's temperature/top-k/top-p
        distribution. Keyword-only extras: `return_stats=True` returns a `SpeculativeOutput`
        (ids, tokens per step, timings); `use_selector=False` makes a DFlash2 draft propose its
        unary argmax or sample instead of the selector's walk; `generator` seeds the sampling.
        """
        self.eval()
        return speculative_generate(
            target,
            self,
            input_ids,
            max_new_tokens,
            stop_token_ids,
            SamplingSettings(temperature, top_p, top_k),
            return_stats=return_stats,
            use_selector=use_selector,
            generator=generator,
        )

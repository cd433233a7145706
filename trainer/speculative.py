"""Real speculative decoding with a target and a DFlash / DFlash2 draft (batch size 1).

Each step drafts one block `[anchor, mask x (B-1)]` from the last verified token (the anchor),
attending to target features of the accepted tokens only; the proposals come from the DFlash2
selector walk (or the unary argmax / sample when the selector is switched off, and for DFlash v1);
the target verifies the whole block in one forward pass. Greedy: the leading run of proposals
matching the target's argmax is accepted, plus the target's bonus token, so the output is exactly
the target's own greedy output. Sampling: standard rejection sampling with the draft's q (for the
selector, q over its K candidates, the residual (p - q)+ formed on those ids), so the output follows
the target's distribution. Semantics follow z-lab's reference loop (`dflash_generate`).

Only batch size 1 is supported: acceptance lengths differ per sequence, and so would every cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from modeling_dflash2 import DFlashDraftModel


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


def _distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(_distribution(logits, temperature), 1, generator=generator))


def _features(hidden_states, layer_ids) -> torch.Tensor:
    return torch.cat([hidden_states[layer_id + 1] for layer_id in layer_ids], dim=-1)


class _Proposal:
    """Draft tokens of one block and, when sampling, the draft probability of each proposal
    (`chosen_q`) and the full draft distribution on the target vocabulary per slot (`q_vocab`)."""

    def __init__(self, tokens: torch.Tensor, chosen_q: torch.Tensor | None, q_vocab: torch.Tensor | None):
        self.tokens, self.chosen_q, self.q_vocab = tokens, chosen_q, q_vocab


def _propose(
    draft: DFlashDraftModel,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    head: nn.Module,
    temperature: float,
    use_selector: bool,
    generator: torch.Generator | None,
) -> _Proposal:
    """hidden [1, B-1, H] at the proposal slots -> proposals (and q when sampling)."""
    if use_selector and getattr(draft, "candidate_selector", None) is not None:
        tokens, candidates, q = draft.propose(hidden, anchor, head, temperature, generator)
        if q is None:
            return _Proposal(tokens[0], None, None)
        q_vocab = torch.zeros(q.shape[1], draft.config.vocab_size, dtype=q.dtype, device=q.device)
        q_vocab.scatter_(1, candidates[0], q[0])  # the residual lives on the candidate ids
        chosen = q[0].gather(1, (candidates[0] == tokens[0][:, None]).float().argmax(1, keepdim=True))[:, 0]
        return _Proposal(tokens[0], chosen, q_vocab)
    logits = draft.compute_logits(hidden, head)[0]
    if temperature <= 0:
        return _Proposal(logits.argmax(-1), None, None)
    q_vocab = _distribution(logits, temperature)
    tokens = torch.multinomial(q_vocab, 1, generator=generator)[:, 0]
    return _Proposal(tokens, q_vocab.gather(1, tokens[:, None])[:, 0], q_vocab)


def _verify(
    proposal: _Proposal, target_logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[int, int]:
    """(number of accepted proposals, the token the target adds after them).

    target_logits [B, V]: row i is the target's next-token logits after block token i.
    """
    drafted = proposal.tokens
    if temperature <= 0:
        posterior = target_logits.argmax(-1)
        matches = (drafted == posterior[:-1]).long().cumprod(0)
        accepted = int(matches.sum())
        return accepted, int(posterior[accepted])
    p = _distribution(target_logits, temperature)
    for slot in range(drafted.numel()):
        token = drafted[slot]
        ratio = p[slot, token] / proposal.chosen_q[slot]
        if torch.rand((), generator=generator, device=ratio.device) >= ratio:  # reject
            residual = (p[slot] - proposal.q_vocab[slot]).clamp(min=0)
            total = residual.sum()
            residual = residual / total if total > 0 else p[slot]
            return slot, int(torch.multinomial(residual, 1, generator=generator))
    return drafted.numel(), int(torch.multinomial(p[-1], 1, generator=generator))


@torch.no_grad()
def spec_generate(
    target: nn.Module,
    draft: DFlashDraftModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: list[int] | None = None,
    use_selector: bool = True,
    generator: torch.Generator | None = None,
) -> SpeculativeResult:
    """Speculative decoding of up to `max_new_tokens` new tokens after `input_ids` [1, P].

    Stops after a token of `stop_token_ids` (which is kept). With `temperature=0` the tokens are
    exactly the target's greedy tokens.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"spec_generate supports batch size 1; got input_ids of shape {tuple(input_ids.shape)}.")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    draft.eval()
    settings = draft.dflash
    block, layer_ids = settings.block_size, list(settings.target_layer_ids)
    stops = set(stop_token_ids or ())
    embedding = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    device = embedding.device
    input_ids = input_ids.to(device)

    started = time.perf_counter()
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    output = target(input_ids=input_ids, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
    tokens = [_pick(output.logits[0, -1], temperature, generator)]
    context = _features(output.hidden_states, layer_ids)  # features not yet given to the draft
    start = input_ids.shape[1]  # position of the anchor (the last verified token)
    result = SpeculativeResult(tokens=tokens, prefill_seconds=time.perf_counter() - started)

    started = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        anchor = torch.tensor([tokens[-1]], device=device)
        block_ids = torch.full((1, block), settings.mask_token_id, device=device)
        block_ids[0, 0] = anchor
        noise = (embedding[block_ids] * settings.input_embedding_scale).to(next(draft.parameters()).dtype)
        positions = torch.arange(start - context.shape[1], start + block, device=device)[None]
        hidden = draft(
            position_ids=positions,
            noise_embedding=noise,
            target_hidden=context.to(noise.dtype),
            past_key_values=draft_cache,
            use_cache=True,
        )
        draft_cache.crop(-block)  # keep the context, drop the block
        proposal = _propose(draft, hidden[:, 1:], anchor, head, temperature, use_selector, generator)
        block_ids[0, 1:] = proposal.tokens
        verified = target(
            input_ids=block_ids,
            position_ids=torch.arange(start, start + block, device=device)[None],
            past_key_values=target_cache,
            use_cache=True,
            output_hidden_states=True,
        )
        accepted, bonus = _verify(proposal, verified.logits[0].float(), temperature, generator)
        new_tokens = [*proposal.tokens[:accepted].tolist(), bonus]
        for index, token in enumerate(new_tokens):
            if token in stops:
                new_tokens = new_tokens[: index + 1]
                break
        new_tokens = new_tokens[: max_new_tokens - len(tokens)]
        tokens.extend(new_tokens)
        result.acceptance_lengths.append(len(new_tokens))
        # The anchor and the accepted proposals are now verified context; the bonus is the next anchor.
        target_cache.crop(-(block - 1 - accepted))
        context = _features(verified.hidden_states, layer_ids)[:, : accepted + 1]
        start += accepted + 1
    result.decode_seconds = time.perf_counter() - started
    return result


@torch.no_grad()
def target_generate(
    target: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> SpeculativeResult:
    """Plain autoregressive decoding with the same calls, as the speed and lossless baseline."""
    stops = set(stop_token_ids or ())
    device = target.get_input_embeddings().weight.device
    started = time.perf_counter()
    cache = DynamicCache()
    output = target(input_ids=input_ids.to(device), past_key_values=cache, use_cache=True)
    tokens = [_pick(output.logits[0, -1], temperature, generator)]
    result = SpeculativeResult(tokens=tokens, prefill_seconds=time.perf_counter() - started)
    started = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        output = target(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=cache, use_cache=True)
        tokens.append(_pick(output.logits[0, -1], temperature, generator))
        result.acceptance_lengths.append(1)
    result.decode_seconds = time.perf_counter() - started
    return result

# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dflash2-hub authors. Shipped inside every exported checkpoint under this licence.
"""DFlash (v1) and DFlash2 draft models: the architecture, as trained and as shipped in checkpoints.

A draft predicts a block `[anchor, mask, ..., mask]` in one pass. Its queries are the block tokens
(embedded with the target's embedding); its keys/values are `[context; block]`, where the context is
`hidden_norm(fc(target hidden states))`. DFlash2 wraps every attention and MLP sublayer in a
block-local grouped dynamic causal convolution and re-ranks the unary top-K candidates with a
low-rank, predecessor-conditioned selector, computing what z-lab's reference and the servers compute.

The fused ops these modules call are in `ops_dflash2.py`, the decoding loop (`spec_generate`) in
`generation_dflash2.py`, the checkpoint folder's rules in `checkpoint_dflash2.py`.

This file ships inside every checkpoint: it may import only torch, transformers and its siblings.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, eager_attention_forward

from .checkpoint_dflash2 import CODEBOOK_KEY_MAPPING, check_loaded_tensors, write_remote_code
from .configuration_dflash2 import (
    DFLASH2_ARCHITECTURE,
    DFLASH_V1_ARCHITECTURE,
    DFlash2Config,
    DFlashSettings,
    resolve_dflash_settings,
)
from .generation_dflash2 import BlockProposals, SamplingSettings, SpeculativeDecodingMixin
from .ops_dflash2 import (
    FLEX_CPU_NO_BACKWARD,
    apply_rotary,
    block_visibility,
    cast_to,
    flex_block_mask_from_dense,
    grouped_dynamic_causal_conv,
    grouped_sdpa_forward,
    rms_norm,
    unfused_flex_forward,
)

MaskLike = Any  # bool/float tensor, flex BlockMask, or {layer_type: either}


# ---------------------------------------------------------------------------------------------
# Unary logits
# ---------------------------------------------------------------------------------------------


def unary_transform(logits: torch.Tensor, output_multiplier: float, softcap: float | None) -> torch.Tensor:
    """Serving's unary transform in fp32: multiply first, then `cap * tanh(x / cap)` when cap > 0."""
    logits = logits.float()
    if output_multiplier != 1.0:
        logits = logits * output_multiplier
    if softcap is not None and softcap > 0:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def apply_output_head(hidden: torch.Tensor, output_head: nn.Module | torch.Tensor) -> torch.Tensor:
    """The target's LM head, given as a module (`lm_head`) or as its weight matrix [V, H]. Outside
    autocast the hidden states take the head's dtype, so a draft and a target loaded in different
    dtypes still decode together."""
    weight = output_head if isinstance(output_head, torch.Tensor) else getattr(output_head, "weight", None)
    if weight is not None and not torch.is_autocast_enabled(hidden.device.type):
        hidden = cast_to(hidden, weight.dtype)
    if isinstance(output_head, torch.Tensor):
        return F.linear(hidden, output_head)
    return output_head(hidden)


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


class DFlashRMSNorm(nn.Module):
    """RMSNorm with Qwen3's semantics and parameter name (`weight`), computed by `ops_dflash2.rms_norm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


class DFlashRotaryEmbedding(nn.Module):
    """Default (rotate-half) RoPE with the target's base.

    The inverse frequencies are recomputed in fp32 on every call instead of living in a buffer, so
    a dtype cast, meta-device init or FSDP broadcast can never degrade or desynchronise them.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return torch.pow(self.theta, exponents).reciprocal()

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [b, 1, len, d] for `apply_rotary`; sin's first half carries rotate-half's minus sign."""
        inv_freq = self.inverse_frequencies(position_ids.device)
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            freqs = position_ids.float()[:, None, :, None] * inv_freq
            angles = torch.cat((-freqs, freqs), dim=-1)  # cos is even, sin odd: the sign lands on sin
            return angles.cos().to(dtype), angles.sin().to(dtype)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from `[context; block]` with shared projections."""

    def __init__(self, config: DFlash2Config, settings: DFlashSettings, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = settings.layer_types[layer_idx]
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = config.num_key_value_heads
        if kv_heads is None:  # (Qwen3Config.__post_init__ sets it to num_attention_heads)
            kv_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // kv_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = 0.0
        # Tells transformers' kernels never to impose their own causal pattern: visibility always
        # comes from an explicit mask here (context keys precede the block).
        self.is_causal = False
        self.block_causal = settings.layer_is_causal(layer_idx)
        self.sliding_window = settings.layer_sliding_window(layer_idx)
        hidden, heads = config.hidden_size, config.num_attention_heads
        bias = bool(config.attention_bias)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        target_hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor,
        attention_mask: MaskLike = None,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        batch, q_len = hidden_states.shape[:2]
        ctx_len = target_hidden.shape[1]
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        kv_input = torch.cat([target_hidden, hidden_states], dim=1)
        key = self.k_norm(self.k_proj(kv_input).view(batch, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(batch, ctx_len + q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary(query, key, cos, sin)
        past_len = 0
        if past_key_values is not None:
            past_len = past_key_values.get_seq_length(self.layer_idx)
            key, value = past_key_values.update(key, value, self.layer_idx)
        mask = self._layer_mask(attention_mask, position_ids, past_len, key.shape[-2], q_len)
        needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
        attention = self._attention_function(query.device, needs_grad)
        output, _ = attention(
            self,
            query,
            key,
            value,
            self._mask_for_backend(mask, query.dtype, batch),
            dropout=0.0,
            scaling=self.scaling,
            is_causal=False,
            **kwargs,
        )
        return self.o_proj(output.reshape(batch, q_len, -1))

    def _layer_mask(
        self, attention_mask: MaskLike, position_ids: torch.Tensor, past_len: int, kv_len: int, q_len: int
    ) -> MaskLike:
        if isinstance(attention_mask, dict):
            if self.layer_type not in attention_mask:
                raise ValueError(
                    f"attention_mask dict has no entry for layer {self.layer_idx} of type '{self.layer_type}' "
                    f"(keys: {sorted(attention_mask)})."
                )
            return attention_mask[self.layer_type]
        if attention_mask is not None:
            return attention_mask
        # No mask given: serve-time visibility by absolute position. Cached keys are contiguous and
        # end right before the new ones (true for full and for sliding-window caches).
        first = position_ids[:, :1]
        past_positions = first - past_len + torch.arange(past_len, device=position_ids.device)[None, :]
        key_positions = torch.cat([past_positions, position_ids], dim=1)[:, -kv_len:]
        return block_visibility(position_ids[:, -q_len:], key_positions, self.block_causal, self.sliding_window)

    def _attention_function(self, device: torch.device, needs_grad: bool):
        """The kernel for the configured backend. flex_attention on CPU runs without gradients only:
        torch has no CPU backward for it, so a forward that would need one is refused here, in one
        line, rather than by torch's NotImplementedError from inside the call."""
        implementation = self.config._attn_implementation or "sdpa"
        if implementation == "eager":
            return eager_attention_forward
        if implementation == "flex_attention" and device.type == "cpu":
            if needs_grad:
                raise ValueError(FLEX_CPU_NO_BACKWARD)
            return unfused_flex_forward
        if implementation.startswith("flash"):
            raise ValueError(
                f"attn_implementation='{implementation}' cannot express DFlash block masks; "
                "use 'sdpa', 'eager' or 'flex_attention'."
            )
        if implementation == "sdpa" and device.type == "cpu":
            return grouped_sdpa_forward
        return ALL_ATTENTION_FUNCTIONS[implementation]

    def _mask_for_backend(self, mask: MaskLike, dtype: torch.dtype, batch: int) -> MaskLike:
        """sdpa takes a bool mask; eager an additive one; flex_attention a BlockMask."""
        implementation = self.config._attn_implementation or "sdpa"
        if not isinstance(mask, torch.Tensor) or implementation == "sdpa":
            return mask
        if implementation == "flex_attention":
            return flex_block_mask_from_dense(mask, batch)
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        return mask


# ---------------------------------------------------------------------------------------------
# DFlash2 convolution and decoder layer
# ---------------------------------------------------------------------------------------------


class DFlash2GroupedDynamicConv(nn.Module):
    """Conv pair around one sublayer: side 0 before it (`prepare`), side 1 after it (`finish`).

    One projection of the sublayer input yields both sides' dynamic kernels; rows of
    `kernel_projection` are ordered (side, tap, group).
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        # a plain flag: torch types Module.__setattr__ for tensors and modules only
        self.kernel_projection._dflash_zero_init = True  # type: ignore[assignment]

    def identity_kernel(self) -> torch.Tensor:
        kernel = torch.zeros_like(self.base_kernel)
        kernel[:, 0, :] = 1.0
        return kernel

    def prepare(self, hidden: torch.Tensor, block_size: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Side 0 applied to the sublayer input; returns it and side 1's (base [k, H], dynamic
        [b, L, k, G]) kernels for `finish`. Both sides are split off with one unbind each."""
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, self.groups)
        (base_before, base_after), (dynamic_before, dynamic_after) = self.base_kernel.unbind(0), dynamic.unbind(-3)
        convolved = grouped_dynamic_causal_conv(hidden, base_before, dynamic_before, block_size)
        return convolved, (base_after, dynamic_after)

    def finish(self, hidden: torch.Tensor, kernel: tuple[torch.Tensor, torch.Tensor], block_size: int) -> torch.Tensor:
        """Side 1 applied to the sublayer output, with the kernels `prepare` returned."""
        return grouped_dynamic_causal_conv(hidden, *kernel, block_size)


class DFlash2DecoderLayer(GradientCheckpointingLayer):
    """Qwen3 decoder layer over the block; DFlash2 adds a conv pair around each sublayer."""

    def __init__(self, config: DFlash2Config, settings: DFlashSettings, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, settings, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv: DFlash2GroupedDynamicConv | None = None
        self.mlp_conv: DFlash2GroupedDynamicConv | None = None
        self.block_size = settings.block_size
        if settings.is_dflash2:
            self.attention_conv = DFlash2GroupedDynamicConv(config.hidden_size, *settings.conv_sizes)
            self.mlp_conv = DFlash2GroupedDynamicConv(config.hidden_size, *settings.conv_sizes)

    def forward(
        self,
        hidden_states: torch.Tensor,
        target_hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor,
        attention_mask: MaskLike = None,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.attention_conv is not None:
            hidden_states, kernel = self.attention_conv.prepare(hidden_states, self.block_size)
        hidden_states = self.self_attn(
            hidden_states,
            target_hidden,
            position_embeddings,
            position_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            **kwargs,
        )
        if self.attention_conv is not None:
            hidden_states = self.attention_conv.finish(hidden_states, kernel, self.block_size)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        if self.mlp_conv is not None:
            hidden_states, kernel = self.mlp_conv.prepare(hidden_states, self.block_size)
        hidden_states = self.mlp(hidden_states)
        if self.mlp_conv is not None:
            hidden_states = self.mlp_conv.finish(hidden_states, kernel, self.block_size)
        return residual + hidden_states


# ---------------------------------------------------------------------------------------------
# Candidate selector
# ---------------------------------------------------------------------------------------------


def row_products(rows: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """`rows` [..., K, d] times `vectors` [..., d] -> [..., K]: one batched matrix-vector product."""
    return torch.matmul(rows, vectors.unsqueeze(-1)).squeeze(-1)


@dataclass
class SelectorScores:
    """Teacher-forced selector scores: candidates [..., K] (descending unary), their unary logits, S."""

    candidate_ids: torch.Tensor
    candidate_unary: torch.Tensor
    scores: torch.Tensor


@dataclass
class SelectorLattice:
    """Per-slot candidates [b, T, K]; slot 0 scores after the anchor [b, K]; for t >= 1,
    `transitions[:, t - 1, i, j]` = S_t(candidate i of slot t-1, candidate j of slot t)."""

    candidate_ids: torch.Tensor
    first_scores: torch.Tensor
    transitions: torch.Tensor


@dataclass
class SelectorWalk:
    """A path through the block: tokens [b, T], candidates [b, T, K], the score row used at each
    slot [b, T, K], and q = softmax(scores / T) [b, T, K] when sampling (else None)."""

    tokens: torch.Tensor
    candidate_ids: torch.Tensor
    scores: torch.Tensor
    probs: torch.Tensor | None


class DFlash2CandidateSelector(nn.Module):
    """`S_t(p, c) = u_t(c) + sum_r A[p, r] (P h_t)[r] Bs[c, r]` over the strict unary top-K.

    A = `predecessor_codebook`, Bs = `successor_codebook` (bare parameters [V, r], the names the
    servers load), P = `hidden_projection`. Unary terms are fp32, the bilinear term runs in the
    model dtype, as served.
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def candidates(self, unary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Strict top-K of the transformed unary logits, sorted descending: (values, ids)."""
        return torch.topk(unary, self.top_k, dim=-1, sorted=True)

    def transition(
        self, projected: torch.Tensor, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor
    ) -> torch.Tensor:
        """Bilinear term for projected [..., r], predecessors [...] and candidates [..., K] -> [..., K]."""
        conditioned = self.predecessor_codebook[predecessor_ids] * projected
        return row_products(self.successor_codebook[candidate_ids], conditioned).float()

    def score(self, hidden: torch.Tensor, unary: torch.Tensor, predecessor_ids: torch.Tensor) -> SelectorScores:
        """Vectorized teacher-forced scores: every position at once, predecessors given."""
        candidate_unary, candidate_ids = self.candidates(unary)
        return self.score_candidates(hidden, candidate_ids, candidate_unary, predecessor_ids)

    def score_candidates(
        self,
        hidden: torch.Tensor,
        candidate_ids: torch.Tensor,
        candidate_unary: torch.Tensor,
        predecessor_ids: torch.Tensor,
    ) -> SelectorScores:
        """Scores of explicitly given candidates [..., K] with their unary logits [..., K]."""
        transition = self.transition(self.hidden_projection(hidden), predecessor_ids, candidate_ids)
        return SelectorScores(candidate_ids, candidate_unary, candidate_unary + transition)

    def lattice(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor | None,
        anchor_ids: torch.Tensor,
        candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SelectorLattice:
        """All K x K transition scores of a block: hidden [b, T, H], unary [b, T, V], anchors [b].
        `candidates` (values, ids), when already computed, replaces `unary` and its top-K pass."""
        if candidates is None:
            if unary is None:
                raise ValueError("lattice needs the unary logits or the candidates computed from them")
            candidates = self.candidates(unary)
        candidate_unary, candidate_ids = candidates
        projected = self.hidden_projection(hidden)
        first = candidate_unary[:, 0] + self.transition(projected[:, 0], anchor_ids, candidate_ids[:, 0])
        conditioned = self.predecessor_codebook[candidate_ids[:, :-1]] * projected[:, 1:, None, :]
        bilinear = torch.matmul(conditioned, self.successor_codebook[candidate_ids[:, 1:]].transpose(-1, -2))
        transitions = candidate_unary[:, 1:, None, :] + bilinear.float()
        return SelectorLattice(candidate_ids, first, transitions)

    def walk(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor | None,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SelectorWalk:
        """The serving walk from the anchor: greedy (ties to the higher unary candidate) or sampled."""
        return self.walk_lattice(self.lattice(hidden, unary, anchor_ids, candidates), temperature, generator)

    @staticmethod
    def walk_lattice(
        lattice: SelectorLattice, temperature: float = 0.0, generator: torch.Generator | None = None
    ) -> SelectorWalk:
        """One path through a lattice: each slot's pick conditions the next slot's score row."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {temperature}).")
        if temperature == 0:
            return DFlash2CandidateSelector._greedy_walk(lattice)
        batch, slots, top_k = lattice.candidate_ids.shape
        rows: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        picks: list[torch.Tensor] = []
        row = lattice.first_scores
        for slot in range(slots):
            if slot > 0:
                previous = picks[-1][:, None, None].expand(batch, 1, top_k)
                row = lattice.transitions[:, slot - 1].gather(1, previous)[:, 0]
            rows.append(row)
            q = torch.softmax(row / temperature, dim=-1)
            probs.append(q)
            picks.append(torch.multinomial(q, 1, generator=generator)[:, 0])
        choice = torch.stack(picks, dim=1)
        return SelectorWalk(
            tokens=lattice.candidate_ids.gather(-1, choice[..., None])[..., 0],
            candidate_ids=lattice.candidate_ids,
            scores=torch.stack(rows, dim=1),
            probs=torch.stack(probs, dim=1),
        )

    @staticmethod
    def _greedy_walk(lattice: SelectorLattice) -> SelectorWalk:
        """Greedy: every candidate's best successor is known up front (one argmax over the whole
        lattice; ties to the higher unary candidate, the lower index), so the walk only follows
        pointers slot by slot, and the score rows it used are gathered once at the end."""
        batch, slots, top_k = lattice.candidate_ids.shape
        successor = lattice.transitions.argmax(dim=-1)  # [b, T-1, K]
        picks = [lattice.first_scores.argmax(dim=-1, keepdim=True)]
        for slot in range(1, slots):
            picks.append(successor[:, slot - 1].gather(1, picks[-1]))
        choice = torch.cat(picks, dim=1)  # [b, T]
        used_rows = lattice.transitions.gather(2, choice[:, :-1, None, None].expand(batch, slots - 1, 1, top_k))
        return SelectorWalk(
            tokens=lattice.candidate_ids.gather(-1, choice[..., None])[..., 0],
            candidate_ids=lattice.candidate_ids,
            scores=torch.cat([lattice.first_scores[:, None], used_rows[:, :, 0]], dim=1),
            probs=None,
        )


def join_lattices(lattices: list[SelectorLattice]) -> SelectorLattice:
    """Lattices of several groups of blocks as one, so a single walk covers them all."""
    return SelectorLattice(
        torch.cat([lattice.candidate_ids for lattice in lattices]),
        torch.cat([lattice.first_scores for lattice in lattices]),
        torch.cat([lattice.transitions for lattice in lattices]),
    )


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlash2Config
    config: DFlash2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # a per-class constant (ruff's RUF012 wants ClassVar), which transformers declares an instance variable
    _no_split_modules: ClassVar[list[str]] = ["DFlash2DecoderLayer"]  # type: ignore[misc]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = False
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Qwen3 init for the backbone; identity convs and a no-op selector.

        Uses transformers' `initialization` helpers, which skip tensors loaded from a checkpoint,
        so `from_pretrained` initialises exactly the missing DFlash2 modules this way.
        """
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "_dflash_zero_init", False):
                init.zeros_(module.weight)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, DFlashRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DFlash2GroupedDynamicConv):
            init.copy_(module.base_kernel, module.identity_kernel())
        elif isinstance(module, DFlash2CandidateSelector):
            init.normal_(module.predecessor_codebook, mean=0.0, std=std)
            init.zeros_(module.successor_codebook)


class DFlashDraftModel(DFlashPreTrainedModel, SpeculativeDecodingMixin):
    """DFlash v1 draft: `fc` + `hidden_norm` on the target features, Qwen3 layers over the block."""

    draft_architecture: ClassVar[str] = DFLASH_V1_ARCHITECTURE

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.dflash = resolve_dflash_settings(config)
        if self.dflash.architecture != self.draft_architecture:
            raise ValueError(
                f"{type(self).__name__} needs a {self.draft_architecture} config, but this config describes "
                f"a {self.dflash.architecture} (architectures={getattr(config, 'architectures', None)}, "
                f"DFlash2 fields present: {self.dflash.is_dflash2})."
            )
        hidden = config.hidden_size
        self.layers = nn.ModuleList(
            [DFlash2DecoderLayer(config, self.dflash, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = DFlashRMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.dflash.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = DFlashRMSNorm(hidden, eps=config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.rotary_emb = DFlashRotaryEmbedding(head_dim, self.dflash.rope_theta)
        self._build_dflash2_modules()
        self.post_init()

    def _build_dflash2_modules(self) -> None:
        """DFlash v1 has none."""

    @property
    def block_size(self) -> int:
        return self.dflash.block_size

    @property
    def mask_token_id(self) -> int:
        return self.dflash.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash.target_layer_ids)

    def get_input_embeddings(self) -> None:  # type: ignore[override]  # (transformers types it as never None)
        """The draft embeds with the target's embedding; it owns none."""
        return None

    def get_output_embeddings(self) -> None:
        """Logits come from the target's LM head; the draft owns none."""
        return None

    def forward(
        self,
        position_ids: torch.Tensor,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        attention_mask: MaskLike = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        output_transform: Callable[[torch.Tensor], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Final-normed hidden states of the block tokens [b, q, H].

        position_ids [b, ctx + q]: absolute positions of the context then the block tokens.
        noise_embedding [b, q, H]: the block embedded with the target embedding (x input_embedding_scale).
        target_hidden [b, ctx, n*H]: target hidden states `hidden_states[id + 1]` concatenated in
            `target_layer_ids` order.
        attention_mask: None (serve-time visibility from positions), a bool [b, 1, q, kv] mask, an
            additive one (sdpa, eager), a flex BlockMask, or a dict of those keyed by layer type.
        past_key_values: a Cache that receives each layer's context and block keys/values; the caller
            crops it (as z-lab's `dflash_generate` does).
        output_transform: applied to the hidden states before returning, inside this forward, so a
            training objective that uses the selector runs while FSDP2 has the parameters gathered.
        """
        expected = len(self.dflash.target_layer_ids) * self.config.hidden_size
        if target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target_hidden has width {target_hidden.shape[-1]}, expected {expected} "
                f"= len(target_layer_ids) x hidden_size."
            )
        if position_ids.shape[-1] != target_hidden.shape[1] + noise_embedding.shape[1]:
            raise ValueError(
                f"position_ids must cover context + block: got {position_ids.shape[-1]} positions for "
                f"{target_hidden.shape[1]} context and {noise_embedding.shape[1]} block tokens."
            )
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        position_ids = position_ids.expand(noise_embedding.shape[0], -1)
        hidden_states = noise_embedding
        context = self.hidden_norm(self.fc(target_hidden))
        position_embeddings = self.rotary_emb(position_ids, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                context,
                position_embeddings,
                position_ids,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return hidden_states if output_transform is None else output_transform(hidden_states)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module | torch.Tensor) -> torch.Tensor:
        """Transformed unary logits (fp32): target LM head, x output_multiplier, then soft-cap."""
        return unary_transform(
            apply_output_head(hidden, output_head),
            self.dflash.output_multiplier,
            self.dflash.final_logit_softcapping,
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained` that also reads `.weight`-spelled codebooks and refuses
        any checkpoint whose tensors do not match this model (missing, unexpected, mis-shaped, or
        only part of the DFlash2 modules). A checkpoint without any DFlash2 tensor (a DFlash v1
        warm start) loads with identity convs and a no-op selector."""
        key_mapping = dict(CODEBOOK_KEY_MAPPING)
        key_mapping.update(kwargs.pop("key_mapping", None) or {})
        want_info = kwargs.pop("output_loading_info", False)
        # Let transformers report shape mismatches instead of raising its own nameless error; the
        # check below refuses them with the offending keys named.
        kwargs["ignore_mismatched_sizes"] = True
        # output_loading_info=True makes it (model, info); transformers types only the model
        model, info = cast(
            tuple[DFlashDraftModel, dict[str, Any]],
            super().from_pretrained(
                pretrained_model_name_or_path, *model_args, key_mapping=key_mapping, output_loading_info=True, **kwargs
            ),
        )
        check_loaded_tensors(cls.__name__, info, model.dflash2_parameter_names())
        return (model, info) if want_info else model

    def dflash2_parameter_names(self) -> set[str]:
        """State-dict names of the DFlash2-only modules (convs and selector)."""
        names: set[str] = set()
        for prefix, module in self.named_modules():
            if isinstance(module, (DFlash2GroupedDynamicConv, DFlash2CandidateSelector)):
                names.update(f"{prefix}.{name}" for name, _ in module.named_parameters())
        return names

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """Save with contract names (bare codebooks), then make the remote code exact: `auto_map`
        naming this package's classes and exactly its remote-code files, even when FSDP2 has
        swapped the instance's class (which would otherwise point `auto_map` at torch files)."""
        kwargs.setdefault("save_original_format", False)
        directory = Path(save_directory)
        python_files_before = set(directory.glob("*.py")) if directory.is_dir() else set()
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(directory, self.draft_architecture, python_files_before)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 draft: DFlash v1 plus block-local dynamic convs and the candidate selector."""

    draft_architecture: ClassVar[str] = DFLASH2_ARCHITECTURE

    def _build_dflash2_modules(self) -> None:
        self.candidate_selector = DFlash2CandidateSelector(
            self.config.vocab_size, self.config.hidden_size, *self.dflash.selector_sizes
        )

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        output_head: nn.Module | torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Draft tokens for one block, as z-lab's decoding loop asks for them.

        hidden: final-normed draft output at the B-1 proposal slots [b, B-1, H]; anchor_ids [b].
        Returns (tokens [b, B-1], candidate ids [b, B-1, K], q [b, B-1, K] or None at T = 0).
        """
        walk = self.candidate_selector.walk(
            hidden, self.compute_logits(hidden, output_head), anchor_ids, temperature, generator
        )
        return walk.tokens, walk.candidate_ids, walk.probs

    def block_proposals(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        output_head: nn.Module | torch.Tensor,
        sampling: SamplingSettings,
        use_selector: bool = True,
        generator: torch.Generator | None = None,
    ) -> BlockProposals:
        """The selector's walk (sampled with q = softmax(scores / T) over its K candidates, no
        top-k/top-p, as z-lab samples it), or DFlash v1's unary proposals when `use_selector` is off."""
        if not use_selector:
            return super().block_proposals(hidden, anchor_ids, output_head, sampling, False, generator)
        tokens, candidate_ids, q = self.propose(hidden, anchor_ids, output_head, sampling.temperature, generator)
        return BlockProposals(tokens, q, None if q is None else candidate_ids)


DFlashDraftModel.register_for_auto_class("AutoModel")
DFlash2DraftModel.register_for_auto_class("AutoModel")

__all__ = [
    "DFlash2CandidateSelector",
    "DFlash2DecoderLayer",
    "DFlash2DraftModel",
    "DFlash2GroupedDynamicConv",
    "DFlashDraftModel",
    "DFlashPreTrainedModel",
    "join_lattices",
    "unary_transform",
]

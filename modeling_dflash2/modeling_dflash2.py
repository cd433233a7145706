# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dflash2-hub authors. Shipped inside every exported checkpoint under this licence.
"""DFlash (v1) and DFlash2 draft models: the training model and the code shipped in checkpoints.

A draft predicts a block `[anchor, mask, ..., mask]` in one pass. Its queries are the block tokens
(embedded with the target's embedding); its keys/values are `[context; block]`, where the context is
`hidden_norm(fc(target hidden states))`. DFlash2 wraps every attention and MLP sublayer in a
block-local grouped dynamic causal convolution and re-ranks the unary top-K candidates with a
low-rank, predecessor-conditioned selector, computing what z-lab's reference and the servers compute.

This file ships inside every checkpoint: it may import only torch, transformers and its sibling.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, eager_attention_forward

from .configuration_dflash2 import (
    DFLASH2_ARCHITECTURE,
    DFLASH_V1_ARCHITECTURE,
    DFlash2Config,
    DFlashSettings,
    resolve_dflash_settings,
)

logger = logging.getLogger(__name__)

# z-lab's reference loader holds the codebooks as nn.Embedding and therefore writes `.weight` names;
# the servers and this model use the bare names of the public contract.
CODEBOOK_KEY_MAPPING = {
    r"^candidate_selector\.(predecessor|successor)_codebook\.weight$": r"candidate_selector.\1_codebook",
}
REMOTE_CODE_FILES = ("configuration_dflash2.py", "modeling_dflash2.py")
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


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)` without an op when it already has that dtype."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _as_float(tensor: torch.Tensor) -> torch.Tensor:
    """At least fp32, without a cast op when it already is (every op is a kernel launch)."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def apply_output_head(hidden: torch.Tensor, output_head: nn.Module | torch.Tensor) -> torch.Tensor:
    """The target's LM head, given as a module (`lm_head`) or as its weight matrix [V, H]. Outside
    autocast the hidden states take the head's dtype, so a draft and a target loaded in different
    dtypes still decode together."""
    weight = output_head if isinstance(output_head, torch.Tensor) else getattr(output_head, "weight", None)
    if weight is not None and not torch.is_autocast_enabled(hidden.device.type):
        hidden = _cast(hidden, weight.dtype)
    if isinstance(output_head, torch.Tensor):
        return F.linear(hidden, output_head)
    return output_head(hidden)


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    """Qwen3's RMSNorm, `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)` with x in fp32, with a
    hand-written backward: the same forward bits in a third of autograd's kernel launches."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        values = _as_float(hidden)
        inverse_rms = (values * values).sum(-1, keepdim=True).div_(values.shape[-1]).add_(eps).rsqrt_()
        normed = values * inverse_rms
        ctx.save_for_backward(normed, inverse_rms, weight)
        ctx.input_dtype = hidden.dtype
        return weight * _cast(normed, hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        normed, inverse_rms, weight = ctx.saved_tensors
        grad = _as_float(grad_output)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = _cast((grad * normed).flatten(0, -2).sum(0), weight.dtype)
        if ctx.needs_input_grad[0]:
            # d/dx of normed . g = rsqrt(ms + eps) * (g - normed * mean(g * normed))
            grad_normed = grad * _as_float(weight)
            projection = (grad_normed * normed).sum(-1, keepdim=True)
            grad_normed.addcmul_(normed, projection, value=-1.0 / normed.shape[-1]).mul_(inverse_rms)
            grad_hidden = _cast(grad_normed, ctx.input_dtype)
        return grad_hidden, grad_weight, None


class DFlashRMSNorm(nn.Module):
    """RMSNorm with Qwen3's semantics and parameter name (`weight`), computed by `_RMSNormFunction`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


# ---------------------------------------------------------------------------------------------
# RoPE and attention visibility
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


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] on the last axis: rotate-half without its sign (one flip, no cat)."""
    return tensor.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate [b, heads, len, d] queries and keys (x cos + rotate_half(x) sin, exactly); the
    queries take the last `q_len` positions. `cos`, `sin` as `DFlashRotaryEmbedding` returns them."""
    q_len = query.shape[-2]
    query = query * cos[..., -q_len:, :] + swap_halves(query) * sin[..., -q_len:, :]
    key = key * cos + swap_halves(key) * sin
    return query, key


def block_visibility(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """Visibility of keys for one block of queries, as the Reference serves it.

    `query_positions` [b, q], `key_positions` [b, kv]. Causal: `k <= q`; sliding: `q - k < W` and,
    when not causal, also `k - q < W`. Returns a bool mask [b, 1, q, kv], or None if all is visible.
    """
    if not causal and sliding_window is None:
        return None
    delta = query_positions[:, :, None] - key_positions[:, None, :]
    visible = torch.ones_like(delta, dtype=torch.bool)
    if causal:
        visible &= delta >= 0
    if sliding_window is not None:
        visible &= delta < sliding_window
        if not causal:
            visible &= -delta < sliding_window
    return visible[:, None]


# ---------------------------------------------------------------------------------------------
# Attention and decoder layer
# ---------------------------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from `[context; block]` with shared projections."""

    def __init__(self, config: DFlash2Config, settings: DFlashSettings, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = settings.layer_types[layer_idx]
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = 0.0
        # Tells transformers' kernels never to impose their own causal pattern: visibility always
        # comes from an explicit mask here (context keys precede the block).
        self.is_causal = False
        self.block_causal = settings.layer_is_causal(layer_idx)
        self.sliding_window = settings.layer_sliding_window(layer_idx)
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
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


FLEX_CPU_NO_BACKWARD = (
    "attn_implementation='flex_attention' runs on CPU without gradients only (torch has no CPU backward "
    "for flex_attention): use 'sdpa' or 'eager' to train on CPU, or call the draft under torch.no_grad()."
)


def flex_block_mask_from_dense(mask: torch.Tensor, batch: int) -> Any:
    """A bool visibility mask [b or 1, 1, q, kv] as a flex_attention BlockMask, so flex always gets
    a BlockMask (as from the trainer's masks), which also skips the blocks it hides.

    transformers' flex path would add a tensor mask inside a score_mod indexing it as
    `mask[b][0][q][kv]`; torch 2.13's compiled CPU kernel reads out of bounds there (a crash, or
    "index out of bounds" from the generated C++), at any length.
    """
    if mask.dtype != torch.bool:
        raise ValueError(
            "attn_implementation='flex_attention' takes a bool attention mask or a flex BlockMask, "
            f"not a {mask.dtype} (additive) mask."
        )
    from torch.nn.attention.flex_attention import create_block_mask

    visible = mask.expand(batch, 1, *mask.shape[-2:])

    def mask_mod(batch_idx: torch.Tensor, head_idx: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
        return visible[batch_idx, 0, q_idx, kv_idx]

    q_len, kv_len = visible.shape[-2:]
    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=mask.device)


def unfused_flex_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """flex_attention on CPU, outside torch.compile: torch's unfused implementation of the same
    BlockMask (or None), exact to sdpa at any length.

    CPU flex is for evaluating and decoding (no backward), where the shapes change from call to
    call; torch 2.13's compiled CPU kernel fails to build once it recompiles for dynamic shapes
    (C++ "'cur_kvSplitSize5' was not declared"), so a run could stop mid-evaluation.
    """
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # "called without torch.compile": on purpose, see above
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        output = flex_attention(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2), None


def grouped_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa on CPU with the grouped key/value heads passed as they are (`enable_gqa`).

    transformers' sdpa path repeats them whenever a mask is given, because CUDA's masked kernels
    need that; CPU's kernel takes them directly: the same values, without the copies.
    """
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2), None


def grouped_dynamic_causal_conv(
    hidden: torch.Tensor, base_kernel: torch.Tensor, dynamic_kernel: torch.Tensor, block_size: int
) -> torch.Tensor:
    """`out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group]) * hidden[t - o, c]`, block-local.

    hidden [b, L, H]; base_kernel [k, H]; dynamic_kernel [b, L, k, G] with G groups of H // G
    channels. A tap reaching before the start of t's own block reads zero, so blocks packed side by
    side never see each other. Accumulates in fp32.

    A sequence shorter than the block is one short block (the last block of a generation, which
    z-lab's decoding loop drafts with fewer slots): the same causal taps over the slots present.
    Several blocks must all be whole.
    """
    length = hidden.shape[1]
    if length > block_size and length % block_size != 0:
        raise ValueError(
            f"DFlash2 convolution: sequence length {length} is not a multiple of the block size {block_size}; "
            "packed blocks must be whole (only a single block may be shorter)."
        )
    return _GroupedDynamicCausalConv.apply(hidden, base_kernel, dynamic_kernel, block_size)


@functools.lru_cache(maxsize=32)
def _cached_conv_taps(length: int, block_size: int, kernel_size: int, device: torch.device):
    return _conv_taps(length, block_size, kernel_size, device)


def _conv_taps(
    length: int, block_size: int, kernel_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each tap reads: source rows [L * k] (row t - o for tap o of row t) and whether the tap
    stays inside t's block [L, k, 1, 1] (a tap that would cross the block start reads zero)."""
    rows = torch.arange(length, device=device)
    offsets = torch.arange(kernel_size, device=device)
    inside = (rows % block_size)[:, None] >= offsets
    sources = torch.where(inside, rows[:, None] - offsets, rows[:, None])
    return sources.reshape(-1), inside.float()[..., None, None]


def conv_taps(length: int, block_size: int, kernel_size: int, device: torch.device):
    """`_conv_taps`, cached in eager mode (they depend on shapes only); traced when compiling."""
    if torch.compiler.is_compiling():
        return _conv_taps(length, block_size, kernel_size, device)
    return _cached_conv_taps(length, block_size, kernel_size, device)


def _conv_kernel(base_kernel, dynamic_kernel, inside, groups: int) -> torch.Tensor:
    """Per-position kernel [b, L, k, G, H/G] = base + dynamic, zero on taps outside the block."""
    kernel_size = dynamic_kernel.shape[2]
    base = _as_float(base_kernel).view(kernel_size, groups, -1)
    return (base + _as_float(dynamic_kernel)[..., None]) * inside


class _GroupedDynamicCausalConv(torch.autograd.Function):
    """The convolution as one gather of the taps, with a hand-written backward (a scatter-add and
    two reductions): few kernels per call, and nothing of size k x H per position kept between
    the passes (the kernel and the gathered taps are recomputed)."""

    @staticmethod
    def forward(ctx, hidden, base_kernel, dynamic_kernel, block_size: int) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        kernel_size, groups = dynamic_kernel.shape[-2:]
        sources, inside = conv_taps(length, block_size, kernel_size, hidden.device)
        taps = _as_float(hidden).index_select(1, sources).view(batch, length, kernel_size, groups, -1)
        output = (taps * _conv_kernel(base_kernel, dynamic_kernel, inside, groups)).sum(2).view(hidden.shape)
        ctx.save_for_backward(hidden, base_kernel, dynamic_kernel, sources, inside)
        return _cast(output, hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        hidden, base_kernel, dynamic_kernel, sources, inside = ctx.saved_tensors
        batch, length, hidden_size = hidden.shape
        kernel_size, groups = dynamic_kernel.shape[-2:]
        grad = _as_float(grad_output).view(batch, length, 1, groups, -1)
        grad_hidden = grad_base = grad_dynamic = None
        if ctx.needs_input_grad[0]:
            sent = (_conv_kernel(base_kernel, dynamic_kernel, inside, groups) * grad).view(batch, -1, hidden_size)
            grad_hidden = _cast(torch.zeros_like(hidden, dtype=sent.dtype).index_add_(1, sources, sent), hidden.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            taps = _as_float(hidden).index_select(1, sources).view(batch, length, kernel_size, groups, -1)
            products = taps * (grad * inside)  # [b, L, k, G, H/G]: grad[t, c] * hidden[t - o, c] inside the block
            if ctx.needs_input_grad[1]:
                grad_base = _cast(products.sum((0, 1)).view(base_kernel.shape), base_kernel.dtype)
            if ctx.needs_input_grad[2]:
                grad_dynamic = _cast(products.sum(-1), dynamic_kernel.dtype)
        return grad_hidden, grad_base, grad_dynamic, None


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
        self.kernel_projection._dflash_zero_init = True

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
            self.attention_conv = DFlash2GroupedDynamicConv(
                config.hidden_size, settings.conv_kernel_size, settings.conv_group_size
            )
            self.mlp_conv = DFlash2GroupedDynamicConv(
                config.hidden_size, settings.conv_kernel_size, settings.conv_group_size
            )

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
        candidate_unary, candidate_ids = candidates if candidates is not None else self.candidates(unary)
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
        rows, probs, picks = [], [], []
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
    _no_split_modules: ClassVar[list[str]] = ["DFlash2DecoderLayer"]
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


class DFlashDraftModel(DFlashPreTrainedModel):
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

    def get_input_embeddings(self) -> None:
        """The draft embeds with the target's embedding; it owns none."""
        return None

    def get_output_embeddings(self) -> None:
        """Logits come from the target's LM head; the draft owns none."""
        return None

    def forward(
        self,
        position_ids: torch.LongTensor,
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

    def draft_block(
        self,
        target: nn.Module,
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
        embedding = target.get_input_embeddings().weight
        noise = F.embedding(block_ids, embedding) * self.dflash.input_embedding_scale
        hidden = self(
            position_ids=position_ids,
            noise_embedding=_cast(noise, self.dtype),
            target_hidden=_cast(context, self.dtype),
            past_key_values=cache,
            use_cache=True,
        )
        cache.crop(-block_ids.shape[1])
        return self.block_proposals(
            hidden[:, 1:], block_ids[:, 0], target_output_head(target), sampling, use_selector, generator
        )

    def block_proposals(
        self,
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
        self,
        target: nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        *,
        return_stats: bool = False,
        use_selector: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.LongTensor | SpeculativeOutput:
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
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, key_mapping=key_mapping, output_loading_info=True, **kwargs
        )
        model.check_loaded_tensors(info)
        return (model, info) if want_info else model

    def dflash2_parameter_names(self) -> set[str]:
        """State-dict names of the DFlash2-only modules (convs and selector)."""
        names = set()
        for prefix, module in self.named_modules():
            if isinstance(module, (DFlash2GroupedDynamicConv, DFlash2CandidateSelector)):
                names.update(f"{prefix}.{name}" for name, _ in module.named_parameters())
        return names

    def check_loaded_tensors(self, info: dict[str, Any]) -> None:
        missing = set(info.get("missing_keys") or ())
        unexpected = set(info.get("unexpected_keys") or ())
        mismatched = list(info.get("mismatched_keys") or ())
        name = type(self).__name__
        if unexpected:
            raise ValueError(f"{name}: the checkpoint has tensors this model does not define: {sorted(unexpected)}")
        if mismatched:
            raise ValueError(f"{name}: tensors with the wrong shape (key, checkpoint, model): {mismatched}")
        dflash2 = self.dflash2_parameter_names()
        missing_backbone = missing - dflash2
        if missing_backbone:
            raise ValueError(f"{name}: the checkpoint lacks tensors: {sorted(missing_backbone)}")
        missing_dflash2 = missing & dflash2
        if missing_dflash2 and missing_dflash2 != dflash2:
            raise ValueError(
                f"{name}: the checkpoint holds only part of the DFlash2 modules; missing: "
                f"{sorted(missing_dflash2)}. A DFlash2 checkpoint must carry every conv and selector tensor."
            )
        if missing_dflash2:
            logger.warning(
                "%s: the checkpoint has no DFlash2 tensors (a DFlash v1 draft?): convs start as identity "
                "and the selector as a unary no-op.",
                name,
            )

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """Save with contract names (bare codebooks), then make the remote code exact: `auto_map`
        naming this package's classes and exactly the two modeling files, even when FSDP2 has
        swapped the instance's class (which would otherwise point `auto_map` at torch files)."""
        kwargs.setdefault("save_original_format", False)
        directory = Path(save_directory)
        python_files_before = set(directory.glob("*.py")) if directory.is_dir() else set()
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(directory, self.draft_architecture, python_files_before)


def write_remote_code(directory: Path, architecture: str, keep_python_files: set[Path] = frozenset()) -> None:
    """Copy the two modeling files into `directory` and point `config.json` at them."""
    source = Path(__file__).resolve().parent
    for stray in set(directory.glob("*.py")) - keep_python_files:
        if stray.name not in REMOTE_CODE_FILES:
            stray.unlink()
    for filename in REMOTE_CODE_FILES:
        if (source / filename).resolve() != (directory / filename).resolve():
            shutil.copyfile(source / filename, directory / filename)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config["auto_map"] = {
        "AutoConfig": "configuration_dflash2.DFlash2Config",
        "AutoModel": f"modeling_dflash2.{architecture}",
    }
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".config.", suffix=".json")
    with os.fdopen(handle, "w") as stream:
        stream.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, config_path)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 draft: DFlash v1 plus block-local dynamic convs and the candidate selector."""

    draft_architecture: ClassVar[str] = DFLASH2_ARCHITECTURE

    def _build_dflash2_modules(self) -> None:
        self.candidate_selector = DFlash2CandidateSelector(
            self.config.vocab_size, self.config.hidden_size, self.dflash.selector_rank, self.dflash.selector_top_k
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


# ---------------------------------------------------------------------------------------------
# Speculative decoding: `spec_generate`, the loop every checkpoint carries
# ---------------------------------------------------------------------------------------------


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

    def probability_of_tokens(self) -> torch.Tensor:
        """q of each proposed token [n]."""
        tokens = self.tokens[0]
        if self.candidate_ids is None:
            return self.probs[0].gather(-1, tokens[:, None])[:, 0]
        return (self.probs[0] * (self.candidate_ids[0] == tokens[:, None])).sum(dim=-1)

    def residual(self, target_probs: torch.Tensor, slot: int) -> torch.Tensor:
        """Where to draw after rejecting `slot`: (p - q)+ renormalised, or p if that is empty."""
        residual = target_probs.clone()
        if self.candidate_ids is None:
            residual -= self.probs[0, slot]
        else:
            residual.scatter_add_(0, self.candidate_ids[0, slot], -self.probs[0, slot].to(residual.dtype))
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

    output_ids: torch.LongTensor
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


def target_output_head(target: nn.Module) -> nn.Module:
    head = getattr(target, "lm_head", None)
    return head if head is not None else target.get_output_embeddings()


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
    target: nn.Module,
    draft: DFlashDraftModel | None,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    stop_token_ids: list[int] | None,
    sampling: SamplingSettings,
    *,
    block_size: int | None = None,
    return_stats: bool = False,
    use_selector: bool = True,
    generator: torch.Generator | None = None,
) -> torch.LongTensor | SpeculativeOutput:
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
    device = target.get_input_embeddings().weight.device
    prompt_length = input_ids.shape[1]
    max_length = prompt_length + max_new_tokens
    output_ids = torch.full(
        (1, max_length + 1), draft.mask_token_id if draft is not None else 0, dtype=torch.long, device=device
    )
    output_ids[:, :prompt_length] = input_ids
    positions = torch.arange(max_length + 1, device=device)[None]
    stops = torch.tensor(sorted(set(stop_token_ids or ())), dtype=torch.long, device=device)
    drafting = block_size > 1
    layer_ids = draft.target_layer_ids if drafting else []
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
        if size > 1:
            proposals = draft.draft_block(
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


DFlashDraftModel.register_for_auto_class("AutoModel")
DFlash2DraftModel.register_for_auto_class("AutoModel")

__all__ = [
    "DFlash2CandidateSelector",
    "DFlash2DecoderLayer",
    "DFlash2DraftModel",
    "DFlash2GroupedDynamicConv",
    "DFlashDraftModel",
    "DFlashPreTrainedModel",
    "SamplingSettings",
    "SpeculativeOutput",
    "block_visibility",
    "grouped_dynamic_causal_conv",
    "join_lattices",
    "speculative_generate",
    "unary_transform",
]

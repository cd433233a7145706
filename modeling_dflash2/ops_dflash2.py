# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dflash2-hub authors. Shipped inside every exported checkpoint under this licence.
"""The DFlash draft's fused ops: functions on tensors, no parameters of their own.

Each computes what a plainer PyTorch expression computes (the tests hold them to one), in fewer
kernel launches or with less memory: RMSNorm with a hand-written backward, rotate-half RoPE with one
flip, the block visibility mask, the attention kernels this draft routes to (grouped sdpa on CPU,
unfused flex on CPU, a dense mask as a flex BlockMask), and the block-local grouped dynamic causal
convolution of DFlash2 with its own backward. The modules that hold weights live in
`modeling_dflash2.py`.

This file ships inside every checkpoint: it may import only torch.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FLEX_CPU_NO_BACKWARD = (
    "attn_implementation='flex_attention' runs on CPU without gradients only (torch has no CPU backward "
    "for flex_attention): use 'sdpa' or 'eager' to train on CPU, or call the draft under torch.no_grad()."
)


# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------


def cast_to(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)` without an op when it already has that dtype."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def as_float(tensor: torch.Tensor) -> torch.Tensor:
    """At least fp32, without a cast op when it already is (every op is a kernel launch)."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    """Qwen3's RMSNorm, `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)` with x in fp32, with a
    hand-written backward: the same forward bits in a third of autograd's kernel launches."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        values = as_float(hidden)
        inverse_rms = (values * values).sum(-1, keepdim=True).div_(values.shape[-1]).add_(eps).rsqrt_()
        normed = values * inverse_rms
        ctx.save_for_backward(normed, inverse_rms, weight)
        ctx.input_dtype = hidden.dtype
        return weight * cast_to(normed, hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        normed, inverse_rms, weight = ctx.saved_tensors
        grad = as_float(grad_output)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = cast_to((grad * normed).flatten(0, -2).sum(0), weight.dtype)
        if ctx.needs_input_grad[0]:
            # d/dx of normed . g = rsqrt(ms + eps) * (g - normed * mean(g * normed))
            grad_normed = grad * as_float(weight)
            projection = (grad_normed * normed).sum(-1, keepdim=True)
            grad_normed.addcmul_(normed, projection, value=-1.0 / normed.shape[-1]).mul_(inverse_rms)
            grad_hidden = cast_to(grad_normed, ctx.input_dtype)
        return grad_hidden, grad_weight, None


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm of `hidden` [..., d] with `weight` [d], through `_RMSNormFunction`."""
    return _RMSNormFunction.apply(hidden, weight, eps)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Attention: visibility and kernels
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# DFlash2's block-local grouped dynamic causal convolution
# ---------------------------------------------------------------------------------------------


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
    base = as_float(base_kernel).view(kernel_size, groups, -1)
    return (base + as_float(dynamic_kernel)[..., None]) * inside


class _GroupedDynamicCausalConv(torch.autograd.Function):
    """The convolution as one gather of the taps, with a hand-written backward (a scatter-add and
    two reductions): few kernels per call, and nothing of size k x H per position kept between
    the passes (the kernel and the gathered taps are recomputed)."""

    @staticmethod
    def forward(ctx, hidden, base_kernel, dynamic_kernel, block_size: int) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        kernel_size, groups = dynamic_kernel.shape[-2:]
        sources, inside = conv_taps(length, block_size, kernel_size, hidden.device)
        taps = as_float(hidden).index_select(1, sources).view(batch, length, kernel_size, groups, -1)
        output = (taps * _conv_kernel(base_kernel, dynamic_kernel, inside, groups)).sum(2).view(hidden.shape)
        ctx.save_for_backward(hidden, base_kernel, dynamic_kernel, sources, inside)
        return cast_to(output, hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        hidden, base_kernel, dynamic_kernel, sources, inside = ctx.saved_tensors
        batch, length, hidden_size = hidden.shape
        kernel_size, groups = dynamic_kernel.shape[-2:]
        grad = as_float(grad_output).view(batch, length, 1, groups, -1)
        grad_hidden = grad_base = grad_dynamic = None
        if ctx.needs_input_grad[0]:
            sent = (_conv_kernel(base_kernel, dynamic_kernel, inside, groups) * grad).view(batch, -1, hidden_size)
            grad_hidden = cast_to(torch.zeros_like(hidden, dtype=sent.dtype).index_add_(1, sources, sent), hidden.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            taps = as_float(hidden).index_select(1, sources).view(batch, length, kernel_size, groups, -1)
            products = taps * (grad * inside)  # [b, L, k, G, H/G]: grad[t, c] * hidden[t - o, c] inside the block
            if ctx.needs_input_grad[1]:
                grad_base = cast_to(products.sum((0, 1)).view(base_kernel.shape), base_kernel.dtype)
            if ctx.needs_input_grad[2]:
                grad_dynamic = cast_to(products.sum(-1), dynamic_kernel.dtype)
        return grad_hidden, grad_base, grad_dynamic, None

"""A deliberately naive second implementation of the draft forward, for equality tests.

Loops over positions, taps, heads and keys, float64 throughout, written from docs/contract.md
rather than from the model code: RoPE by explicit angle pairs, the conv by its defining sum,
attention by an explicit softmax over the visible keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Visible = Callable[[int, int, int], bool]  # (layer index, query position, key position) -> visible


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()


def rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """Rotate one head vector: pair (i, i + d/2) turns by position * theta^(-2i/d)."""
    half = x.shape[-1] // 2
    out = x.clone()
    for i in range(half):
        angle = position * theta ** (-2 * i / x.shape[-1])
        a, b = x[i], x[i + half]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def conv(x: torch.Tensor, base: torch.Tensor, dynamic: torch.Tensor, block_size: int) -> torch.Tensor:
    """out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group]) * x[t - o, c], inside t's block."""
    length, hidden = x.shape
    kernel_size, groups = dynamic.shape[1:]
    group = hidden // groups
    out = torch.zeros_like(x)
    for t in range(length):
        block_start = t - t % block_size
        for o in range(kernel_size):
            if t - o < block_start:
                continue
            for c in range(hidden):
                out[t, c] += (base[o, c] + dynamic[t, o, c // group]) * x[t - o, c]
    return out


def conv_pair(module, x: torch.Tensor, block_size: int):
    """prepare/finish of one conv module, with kernel rows ordered (side, tap, group)."""
    kernel_size, groups = module.kernel_size, module.groups
    weight = module.kernel_projection.weight.double().view(2, kernel_size, groups, x.shape[-1])
    dynamic = torch.einsum("skgh,th->stkg", weight, x)
    base = module.base_kernel.double()
    prepared = conv(x, base[0], dynamic[0], block_size)
    return prepared, lambda y: conv(y, base[1], dynamic[1], block_size)


def linear(module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight.double().T


def attention(
    layer_idx: int, attn, h: torch.Tensor, ctx: torch.Tensor, positions: list[int], visible: Visible, theta: float
):
    q_len, c_len = h.shape[0], ctx.shape[0]
    heads, d = attn.config.num_attention_heads, attn.head_dim
    kv_heads = attn.config.num_key_value_heads
    eps = attn.config.rms_norm_eps
    kv_input = torch.cat([ctx, h])
    q = linear(attn.q_proj, h).view(q_len, heads, d)
    k = linear(attn.k_proj, kv_input).view(c_len + q_len, kv_heads, d)
    v = linear(attn.v_proj, kv_input).view(c_len + q_len, kv_heads, d)
    out = torch.zeros(q_len, heads, d, dtype=torch.float64)
    for head in range(heads):
        kv_head = head // (heads // kv_heads)
        keys = [
            rope(rms_norm(k[j, kv_head], attn.k_norm.weight, eps), positions[j], theta) for j in range(c_len + q_len)
        ]
        for i in range(q_len):
            query_position = positions[c_len + i]
            query = rope(rms_norm(q[i, head], attn.q_norm.weight, eps), query_position, theta)
            scores, values = [], []
            for j in range(c_len + q_len):
                if visible(layer_idx, query_position, positions[j]):
                    scores.append(float(query @ keys[j]) / math.sqrt(d))
                    values.append(v[j, kv_head])
            weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
            out[i, head] = sum(w * value for w, value in zip(weights, values, strict=True))
    return linear(attn.o_proj, out.view(q_len, heads * d))


def mlp(module, x: torch.Tensor) -> torch.Tensor:
    gate = linear(module.gate_proj, x)
    return linear(module.down_proj, gate * torch.sigmoid(gate) * linear(module.up_proj, x))


@torch.no_grad()
def forward(model, position_ids: torch.Tensor, noise: torch.Tensor, target_hidden: torch.Tensor, visible: Visible):
    """One batch row: position_ids [c + q], noise [q, H], target_hidden [c, n*H] -> [q, H]."""
    config = model.config
    eps = config.rms_norm_eps
    theta = model.dflash.rope_theta
    block = model.dflash.block_size
    positions = [int(p) for p in position_ids]
    ctx = rms_norm(linear(model.fc, target_hidden.double()), model.hidden_norm.weight, eps)
    x = noise.double()
    for index, layer in enumerate(model.layers):
        h = rms_norm(x, layer.input_layernorm.weight, eps)
        if layer.attention_conv is not None:
            h, finish = conv_pair(layer.attention_conv, h, block)
        a = attention(index, layer.self_attn, h, ctx, positions, visible, theta)
        if layer.attention_conv is not None:
            a = finish(a)
        x = x + a
        h = rms_norm(x, layer.post_attention_layernorm.weight, eps)
        if layer.mlp_conv is not None:
            h, finish = conv_pair(layer.mlp_conv, h, block)
        m = mlp(layer.mlp, h)
        if layer.mlp_conv is not None:
            m = finish(m)
        x = x + m
    return rms_norm(x, model.norm.weight, eps)


def serving_visibility(model) -> Visible:
    """docs/contract.md's visibility by positions: causal -> k <= q; sliding -> |q - k| < W
    (one-sided if causal)."""

    def visible(layer_idx: int, query_position: int, key_position: int) -> bool:
        causal = model.dflash.layer_is_causal(layer_idx)
        window = model.dflash.layer_sliding_window(layer_idx)
        if causal and key_position > query_position:
            return False
        if window is not None:
            if query_position - key_position >= window:
                return False
            if not causal and key_position - query_position >= window:
                return False
        return True

    return visible

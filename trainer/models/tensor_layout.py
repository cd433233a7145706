"""The tensors of a DFlash2 draft in the public layout (docs/contract.md, Tensors), from its config
alone: what the export checks (rules 16-18) and what the size bounds count before anything is built."""

from __future__ import annotations

from typing import Any


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a public config (docs/contract.md, Tensors)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inner = config["intermediate_size"]
    dfc = config["dflash_config"]
    kernel, groups = dfc["conv_kernel_size"], hidden // dfc["conv_group_size"]
    rank, vocab = dfc["selector_rank"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, len(dfc["target_layer_ids"]) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
        "candidate_selector.hidden_projection.weight": (rank, hidden),
        "candidate_selector.predecessor_codebook": (vocab, rank),
        "candidate_selector.successor_codebook": (vocab, rank),
    }
    for i in range(layers):
        prefix = f"layers.{i}."
        shapes.update(
            {
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                prefix + "self_attn.q_norm.weight": (head_dim,),
                prefix + "self_attn.k_norm.weight": (head_dim,),
                prefix + "mlp.gate_proj.weight": (inner, hidden),
                prefix + "mlp.up_proj.weight": (inner, hidden),
                prefix + "mlp.down_proj.weight": (hidden, inner),
            }
        )
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"{prefix}{conv}.base_kernel"] = (2, kernel, hidden)
            shapes[f"{prefix}{conv}.kernel_projection.weight"] = (2 * kernel * groups, hidden)
    return shapes

"""`make demo` (Step 1 version): build a tiny random DFlash2 draft, save it as a checkpoint, reload
it through `AutoModel(..., trust_remote_code=True)` and check that it reproduces the same draft
tokens. Later steps replace this with real training on SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModel

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from trainer.loading import assert_draft_class

OUTPUT = Path(__file__).resolve().parents[1] / "outputs" / "demo-draft"


def tiny_config() -> DFlash2Config:
    return DFlash2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        num_target_layers=8,
        layer_types=["full_attention", "full_attention"],
        is_causal=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        dflash_config={
            "block_size": 8,
            "mask_token_id": 3,
            "target_layer_ids": [1, 6],
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 16,
            "selector_top_k": 8,
        },
    )


def main() -> None:
    torch.manual_seed(0)
    draft = DFlash2DraftModel(tiny_config()).eval()
    lm_head = torch.randn(256, 64)
    block, context = draft.block_size, 12
    positions = torch.arange(context + block)[None]
    noise = torch.randn(1, block, 64)
    features = torch.randn(1, context, 2 * 64)
    anchor = torch.tensor([42])

    draft.save_pretrained(OUTPUT)
    reloaded = AutoModel.from_pretrained(OUTPUT, trust_remote_code=True).eval()
    assert_draft_class(reloaded)
    with torch.no_grad():
        hidden = draft(position_ids=positions, noise_embedding=noise, target_hidden=features)
        hidden_reloaded = reloaded(position_ids=positions, noise_embedding=noise, target_hidden=features)
        tokens, _, _ = draft.propose(hidden[:, 1:], anchor, lm_head)
        tokens_reloaded, _, _ = reloaded.propose(hidden_reloaded[:, 1:], anchor, lm_head)

    saved = json.loads((OUTPUT / "config.json").read_text())
    print(f"saved draft: {OUTPUT}")
    print(f"  files: {sorted(p.name for p in OUTPUT.iterdir())}")
    print(f"  auto_map: {saved['auto_map']}")
    print(f"  tensors: {len(draft.state_dict())} (15 x layers + 6 = {15 * draft.config.num_hidden_layers + 6})")
    print(f"  parameters: {sum(p.numel() for p in draft.parameters()):,}")
    print(f"reloaded through AutoModel(trust_remote_code=True): {type(reloaded).__name__}")
    print(f"  max |hidden difference|: {(hidden - hidden_reloaded).abs().max().item():.3g}")
    print(f"  draft tokens: {tokens.tolist()} (reloaded: {tokens_reloaded.tolist()})")
    if not torch.equal(tokens, tokens_reloaded):
        raise SystemExit("reloaded draft proposes different tokens")


if __name__ == "__main__":
    main()

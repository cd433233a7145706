"""Training sees exactly what serving sees: packed training blocks == one block served at a time."""

from __future__ import annotations

import pytest
import torch

from modeling_dflash2 import DFlash2DraftModel
from tests.support.drafts import randomize
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.objective.blocks import build_blocks
from trainer.objective.loss import embed_draft_ids
from trainer.objective.masks import attention_masks

LAYOUTS = {
    "bidirectional full": {},
    "causal sliding + bidirectional full (is_causal unset)": {
        "num_hidden_layers": 2,
        "layer_types": ["full_attention", "sliding_attention"],
        "use_sliding_window": True,
        "sliding_window": 3,
        "is_causal": None,
    },
    "causal everywhere": {"is_causal": True},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_training_blocks_equal_served_blocks(layout):
    target = tiny_target(seed=1)
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(target, **LAYOUTS[layout])), seed=2, scale=0.3).eval()
    prompt = [1, 9, 14, 22, 7]
    input_ids = target.model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    length = input_ids.shape[1]
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[:, len(prompt) :] = 1
    features = target.capture(input_ids, None, draft.target_layer_ids)
    anchors = torch.tensor([[5, 8, 9, 13, length - 2]])  # consecutive anchors and a partial tail block
    blocks = build_blocks(input_ids, loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool), 4, 3)
    embedding = target.embedding_weight
    with torch.no_grad():
        trained = draft(
            position_ids=blocks.model_position_ids(),
            noise_embedding=embed_draft_ids(embedding, blocks.draft_ids, 1.0),
            target_hidden=features,
            attention_mask=attention_masks(blocks, draft.dflash),
        ).view(5, 4, -1)
        head = target.lm_head
        for index, anchor in enumerate(anchors[0].tolist()):
            block = torch.tensor([[input_ids[0, anchor].item(), 3, 3, 3]])
            served = draft(
                position_ids=torch.arange(anchor + 4)[None],
                noise_embedding=embedding[block],
                target_hidden=features[:, :anchor],  # serving has the target states of verified tokens only
            )[0]
            torch.testing.assert_close(trained[index], served, atol=2e-5, rtol=1e-5)
            train_walk = draft.propose(trained[index][None, 1:], block[:, 0], head)[0]
            serve_walk = draft.propose(served[None, 1:], block[:, 0], head)[0]
            assert torch.equal(train_walk, serve_walk)

"""trainer.loading: drafts are loaded with their class asserted (no silent Qwen3Model)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from modeling_dflash2 import DFlash2DraftModel, DFlashDraftModel
from tests.conftest import draft_inputs, tiny_draft, tiny_v1_draft
from trainer.loading import assert_draft_class, load_draft


@pytest.fixture(scope="module")
def saved_draft(tmp_path_factory):
    model = tiny_draft(seed=0).eval()
    directory = tmp_path_factory.mktemp("draft")
    model.save_pretrained(directory)
    return model, directory


def test_automodel_without_trust_remote_code_is_caught(saved_draft):
    _, directory = saved_draft
    fallback = AutoModel.from_pretrained(directory)
    assert type(fallback).__name__ == "Qwen3Model"  # the silent trap this helper exists for
    with pytest.raises(TypeError, match="trust_remote_code=True"):
        assert_draft_class(fallback)


def test_load_draft_uses_the_local_package_class(saved_draft):
    model, directory = saved_draft
    loaded = load_draft(directory)
    assert type(loaded) is DFlash2DraftModel
    inputs = draft_inputs(model.config)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**inputs), model(**inputs))


def test_load_draft_with_remote_code(saved_draft):
    model, directory = saved_draft
    loaded = load_draft(directory, trust_remote_code=True)
    assert type(loaded).__name__ == "DFlash2DraftModel"
    assert type(loaded) is not DFlash2DraftModel  # the checkpoint's own copy of the code ran
    inputs = draft_inputs(model.config)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**inputs), model(**inputs))


def test_plain_dflash_is_rejected_where_dflash2_is_requested(tmp_path):
    tiny_v1_draft(seed=1).save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="Expected a draft of class DFlash2DraftModel, got DFlashDraftModel"):
        load_draft(tmp_path)
    assert type(load_draft(tmp_path, expected=("DFlashDraftModel",))) is DFlashDraftModel

"""trainer.models.loading: drafts are loaded with their class asserted (no silent Qwen3Model)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from tests.support.drafts import AskedTheHub, draft_inputs, tiny_config, tiny_draft, tiny_v1_draft
from trainer.models.loading import assert_draft_class, load_draft
from trainer.models.warm_start import warm_start
from trainer.publishing.export import load_trained_draft


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


def _truncated_copy(directory: Path, destination: Path) -> Path:
    """A copy of a saved draft whose model.safetensors lost its last 100 bytes; returns the weights file."""
    shutil.copytree(directory, destination)
    weights = destination / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return weights


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_a_truncated_draft_is_named(saved_draft, tmp_path, trust_remote_code):
    weights = _truncated_copy(saved_draft[1], tmp_path / "draft")
    with pytest.raises(ValueError) as caught:
        load_draft(tmp_path / "draft", trust_remote_code=trust_remote_code)
    assert str(caught.value).startswith(f"{weights} is truncated or corrupt: header says ")


def test_a_truncated_warm_start_source_is_named(saved_draft, tmp_path):
    model, directory = saved_draft
    weights = _truncated_copy(directory, tmp_path / "draft")
    with pytest.raises(ValueError) as caught:
        warm_start(str(tmp_path / "draft"), model.config)
    assert str(caught.value).startswith(f"{weights} is truncated or corrupt: header says ")


def test_a_truncated_bare_checkpoint_is_named_at_export(saved_draft, tmp_path):
    model, directory = saved_draft
    bare = tmp_path / "merged"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes()[:-100])
    model.config.to_json_file(tmp_path / "draft.json")
    with pytest.raises(ValueError) as caught:
        load_trained_draft(bare, tmp_path / "draft.json")
    assert str(caught.value).startswith(f"{bare / 'model.safetensors'} is truncated or corrupt: header says ")


@pytest.mark.parametrize(
    ("load", "what"),
    [
        (load_draft, "draft"),
        (lambda spec: warm_start(spec, tiny_config()), "init_from"),
        (lambda spec: load_trained_draft(spec), "checkpoint"),
    ],
)
@pytest.mark.parametrize("spec", ["./drafts/missing", "/data/x", "runs/my/draft"])
def test_a_missing_local_draft_is_named_not_taken_for_a_hub_id(tmp_path, monkeypatch, load, what, spec):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as caught:
        load(spec)
    assert str(caught.value) == f"{what}: local path {spec} does not exist"


def test_a_hub_draft_id_still_goes_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def from_hub(name, **kwargs):
        raise AskedTheHub(name)

    monkeypatch.setattr(DFlash2Config, "from_pretrained", from_hub)
    # a warm start reads config.json alone first, for its size checks: from the Hub too
    monkeypatch.setattr("transformers.utils.cached_file", lambda name, filename, **kwargs: from_hub(name))
    for load in (load_draft, lambda spec: warm_start(spec, tiny_config())):
        with pytest.raises(AskedTheHub, match=r"^org/draft$"):
            load("org/draft")

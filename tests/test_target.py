"""trainer.target: frozen target, capture of hidden_states[id + 1] in list order, compatibility checks."""

from __future__ import annotations

import logging

import pytest
import torch

from modeling_dflash2 import DFlash2DraftModel
from tests.conftest import AskedTheHub
from tests.tiny_target import tiny_draft_config_for, tiny_target
from trainer import target as target_module
from trainer.export import TargetDimensions
from trainer.target import FrozenTarget, TargetSource


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_capture_concatenates_hidden_states_plus_one_in_list_order(kind):
    target = tiny_target(kind)
    input_ids = torch.randint(4, 40, (2, 7))
    attention_mask = torch.ones_like(input_ids)
    captured = target.capture(input_ids, attention_mask, [2, 0, 3])
    with torch.no_grad():
        reference = target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    states = reference.hidden_states
    assert captured.shape == (2, 7, 3 * 32)
    torch.testing.assert_close(captured[..., :32], states[3])
    torch.testing.assert_close(captured[..., 32:64], states[1])
    torch.testing.assert_close(captured[..., 64:], states[4])
    assert not captured.requires_grad


def test_target_is_frozen_and_exposes_embedding_and_tied_head():
    target = tiny_target()
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not target.model.training
    assert target.lm_head.weight.data_ptr() == target.embedding_weight.data_ptr()  # tied
    assert target.vocab_rows == len(target.tokenizer)
    assert target.num_layers == 4 and target.hidden_size == 32


@pytest.mark.parametrize(
    ("dflash", "overrides", "message"),
    [
        (None, {"hidden_size": 64, "intermediate_size": 64}, "hidden_size=64"),
        (None, {"vocab_size": 40}, "vocab_size=40"),
        ({"target_layer_ids": [1, 5]}, {"num_target_layers": 8}, r"reach past the target's 4 layers: \[5\]"),
        (None, {"num_target_layers": 6}, "num_target_layers=6"),
    ],
)
def test_check_draft_names_the_mismatch(dflash, overrides, message):
    target = tiny_target()
    config = tiny_draft_config_for(target, dflash, **overrides)
    with pytest.raises(ValueError, match=message):
        target.check_draft(config.dflash_settings, config)


def test_check_draft_accepts_a_matching_draft_and_warns_on_rope(caplog):
    target = tiny_target()
    config = tiny_draft_config_for(target)
    target.check_draft(config.dflash_settings, config)
    other = tiny_draft_config_for(target)
    other.rope_parameters = {"rope_theta": 500.0, "rope_type": "default"}
    with caplog.at_level(logging.WARNING):
        target.check_draft(other.dflash_settings, other)
    assert "RoPE base 500.0 differs" in caplog.text
    assert DFlash2DraftModel(config).get_input_embeddings() is None


def test_local_directory_target_round_trips(tmp_path):
    target = tiny_target()
    target.model.save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    loaded = FrozenTarget.load(str(tmp_path))
    input_ids = torch.randint(4, 40, (1, 5))
    torch.testing.assert_close(loaded.capture(input_ids, None, [1]), target.capture(input_ids, None, [1]))
    assert loaded.fingerprint() == FrozenTarget.load(str(tmp_path)).fingerprint()


def test_packaged_gguf_source_errors_clearly():
    with pytest.raises(ValueError, match="distribution is not installed"):
        TargetSource.parse("pypi:no-such-distribution-dflash2")


@pytest.mark.parametrize("spec", ["./models/foo", "/data/x", "runs/my/target", "~/no-such-dflash2-target"])
def test_a_missing_local_target_is_named_not_taken_for_a_hub_id(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for load in (FrozenTarget.load, TargetDimensions.from_target):
        with pytest.raises(FileNotFoundError) as caught:
            load(spec)
        assert str(caught.value) == f"target: local path {spec} does not exist"


def test_a_hub_target_id_still_goes_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def from_hub(name, **kwargs):
        raise AskedTheHub(name)

    monkeypatch.setattr(target_module.AutoModelForCausalLM, "from_pretrained", from_hub)
    for spec in ("org/name", "name"):
        with pytest.raises(AskedTheHub, match=f"^{spec}$"):
            FrozenTarget.load(spec)


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError) as caught:
        FrozenTarget.load(str(tmp_path), gguf_file="model.Q4_K_M.gguf")
    assert str(caught.value) == f"target_gguf_file: model.Q4_K_M.gguf is not a file in {tmp_path}"


def test_truncated_target_weights_are_named(tmp_path):
    target = tiny_target()
    target.model.save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError) as caught:
        FrozenTarget.load(str(tmp_path))
    assert str(caught.value).startswith(f"{weights} is truncated or corrupt: header says ")

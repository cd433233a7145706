"""trainer.models.target: frozen target, capture of hidden_states[id + 1] in list order, compatibility checks."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from modeling_dflash2 import DFlash2DraftModel
from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.drafts import AskedTheHub
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.models import target as target_module
from trainer.models.target import FrozenTarget, TargetSource, check_target_sharding, target_dimensions


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
        (None, {"hidden_size": 64, "intermediate_size": 64}, "hidden_size 64 != the target's hidden size 32"),
        (None, {"vocab_size": 40}, "vocab_size 40 != the target's padded vocab"),
        ({"target_layer_ids": [1, 5]}, {"num_target_layers": 8}, r"reach past the target's 4 layers: \[5\]"),
        (None, {"num_target_layers": 6}, "num_target_layers 6 != the target's depth 4"),
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
    for load in (FrozenTarget.load, target_dimensions):
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


# -- capture stops at the deepest needed layer ---------------------------------------------------------------------


def tiny_hf_target(kind: str, layers: int = 4) -> FrozenTarget:
    """A tiny random target of another architecture (sliding windows shorter than the test sequences)."""
    config = AutoConfig.for_model(
        kind,
        vocab_size=60,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        sliding_window=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return FrozenTarget(AutoModelForCausalLM.from_config(config).float())


def any_target(kind: str) -> FrozenTarget:
    return tiny_target(kind) if kind in ("llama", "qwen3") else tiny_hf_target(kind)


KINDS = ["llama", "qwen3", "mistral", "qwen2", "gemma2", "gemma3_text"]
LAYER_ID_SETS = [[0], [1], [2, 0], [0, 1, 2], [3], [1, 3], [3, 0, 2]]


def full_run_hidden_states(target: FrozenTarget, input_ids, attention_mask) -> tuple[torch.Tensor, ...]:
    """What capture read before truncation: the whole causal LM with output_hidden_states=True."""
    with torch.no_grad():
        return target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_capture_is_bit_identical_to_the_full_run(kind):
    target = any_target(kind)
    input_ids = torch.randint(4, 40, (3, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0  # right padding, as the collator pads
    attention_mask[2, 3:] = 0
    states = full_run_hidden_states(target, input_ids, attention_mask)
    assert len(states) == target.num_layers + 1
    for layer_ids in LAYER_ID_SETS:
        expected = torch.cat([states[layer_id + 1] for layer_id in layer_ids], dim=-1)
        assert torch.equal(target.capture(input_ids, attention_mask, layer_ids), expected), layer_ids
        assert torch.equal(target.capture(input_ids, attention_mask, layer_ids, full_depth=True), expected), layer_ids


def layer_output(target: FrozenTarget, index: int, input_ids) -> torch.Tensor:
    seen = []
    handle = target.decoder_layers[index].register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        target.capture(input_ids, None, [target.num_layers - 1], full_depth=True)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_the_last_layer_keeps_transformers_semantics_its_output_after_the_final_norm(kind):
    """transformers 5 returns the final-normed output as hidden_states[-1]; capture keeps that for id L-1."""
    target = any_target(kind)
    input_ids = torch.randint(4, 40, (2, 6))
    last = target.num_layers - 1
    raw = layer_output(target, last, input_ids)
    captured = target.capture(input_ids, None, [last])
    with torch.no_grad():
        assert torch.equal(captured, target.backbone.norm(raw))
    assert not torch.allclose(captured, raw)
    # an intermediate layer is its raw output
    assert torch.equal(target.capture(input_ids, None, [1]), layer_output(target, 1, input_ids))


class Refuses(torch.nn.Module):
    def forward(self, *args, **kwargs):
        raise AssertionError("a layer past the deepest needed one ran")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_layers_past_the_deepest_the_final_norm_and_the_head_never_run(kind):
    target = any_target(kind)
    input_ids = torch.randint(4, 40, (2, 7))
    states = full_run_hidden_states(target, input_ids, None)
    calls = []
    target.decoder_layers[2].register_forward_hook(lambda *_: calls.append(2))
    target.decoder_layers[3] = Refuses()
    target.backbone.norm = Refuses()
    target.model.lm_head = Refuses()
    assert torch.equal(target.capture(input_ids, None, [1, 0]), torch.cat([states[2], states[1]], dim=-1))
    assert calls == []
    assert torch.equal(target.capture(input_ids, None, [2]), states[3])
    assert calls == [2]


def test_a_failing_forward_leaves_no_hook_behind_and_the_next_capture_is_exact():
    target = tiny_target()
    input_ids = torch.randint(4, 40, (2, 7))
    expected = torch.cat([full_run_hidden_states(target, input_ids, None)[i + 1] for i in (0, 2)], dim=-1)
    hooks_before = [len(layer._forward_hooks) for layer in target.decoder_layers]
    layers = list(target.decoder_layers)
    original = target.decoder_layers[1]
    target.decoder_layers[1] = Refuses()
    with pytest.raises(AssertionError, match="a layer past the deepest"):
        target.capture(input_ids, None, [0, 2])
    target.decoder_layers[1] = original
    assert [len(layer._forward_hooks) for layer in target.decoder_layers] == hooks_before
    assert list(target.decoder_layers) == layers
    assert torch.equal(target.capture(input_ids, None, [0, 2]), expected)
    assert [len(layer._forward_hooks) for layer in target.decoder_layers] == hooks_before


@pytest.mark.parametrize("layer_ids", [[], [4], [-1], [0, 9]])
def test_capture_refuses_layer_ids_outside_the_target(layer_ids):
    with pytest.raises(ValueError, match=r"target_layer_ids .*each in 0\.\.3 \(the target has 4 layers\)"):
        tiny_target().capture(torch.randint(4, 40, (1, 5)), None, layer_ids)


def test_capture_never_runs_the_forward_past_a_missing_layer_silently():
    """A backbone whose forward skips the deepest layer is an error, not a short feature tensor."""
    target = tiny_target()
    target.backbone.forward = lambda **kwargs: None  # returns before any layer
    with pytest.raises(RuntimeError, match=r"never ran decoder layer 2"):
        target.capture(torch.randint(4, 40, (1, 5)), None, [2])


# -- target_sharding on one process --------------------------------------------------------------------------------


def test_fsdp_sharding_on_a_single_process_warns_and_keeps_the_target_whole(caplog):
    target = tiny_target()
    input_ids = torch.randint(4, 40, (1, 5))
    before = target.capture(input_ids, None, [1, 2])
    with caplog.at_level(logging.WARNING, logger="trainer.models.target"):
        target.place("cpu", "fsdp")
    assert "target_sharding: fsdp on a single process: the target stays whole on cpu" in caplog.text
    assert not target.sharded
    local, whole = target.decoder_layer_bytes()
    assert local == whole == 4 * sum(p.numel() for p in target.decoder_layers.parameters())
    assert torch.equal(target.capture(input_ids, None, [1, 2]), before)


def test_target_sharding_choices_and_the_uneven_paths_are_refused():
    with pytest.raises(ValueError, match=r"^target_sharding: 'zero3' is not one of 'none', 'fsdp'$"):
        tiny_target().place("cpu", "zero3")
    with pytest.raises(ValueError, match=r"^spec_eval_prompts=3 needs target_sharding: none \("):
        check_target_sharding("fsdp", spec_eval_prompts=3)
    check_target_sharding("none", spec_eval_prompts=3)
    check_target_sharding("fsdp", spec_eval_prompts=0)


def sharded_trainer(tmp_path, target_sharding: str, **overrides):
    from trainer.data.dataset import DFlashCollator
    from trainer.training.arguments import DFlashTrainingArguments
    from trainer.training.trainer import DFlash2Trainer

    target = tiny_target()
    values = {"output_dir": str(tmp_path), "max_steps": 1, "report_to": [], "use_cpu": True, **overrides}
    return DFlash2Trainer(
        model=DFlash2DraftModel(tiny_draft_config_for(target)),
        args=DFlashTrainingArguments(**values),
        target=target,
        target_sharding=target_sharding,
        data_collator=DFlashCollator(target.tokenizer.pad_token_id),
    )


def test_the_trainer_refuses_fsdp_sharding_with_uneven_batches(tmp_path):
    """The sharding mode itself is checked once, by train_run, before anything loads (next test)."""
    with pytest.raises(ValueError, match=r"^target_sharding: fsdp needs accelerator_config.even_batches: true \("):
        sharded_trainer(tmp_path, "fsdp", accelerator_config={"even_batches": False})
    assert sharded_trainer(tmp_path, "none", accelerator_config={"even_batches": False}).target.device.type == "cpu"


def test_train_script_refuses_the_combination_before_loading_anything(tmp_path, capsys):
    from trainer.commands import train
    from trainer.commands.runner import USER_ERROR_STATUS, run

    recipe = write_tiny_run(tmp_path, target=str(tmp_path / "not-there"), target_sharding="fsdp", spec_eval_prompts=3)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run(train.main, [str(recipe)])
    assert stopped.value.code == USER_ERROR_STATUS
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: spec_eval_prompts=3 needs target_sharding: none (")


def test_a_decoder_without_a_layers_list_runs_whole_with_one_warning(caplog):
    """GPT-2 keeps its blocks in `h`: capture falls back to the full run, exact, and says so once."""
    target_module._warn_whole_target_runs.cache_clear()
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=60, n_embd=32, n_layer=3, n_head=4, n_positions=64)
    target = FrozenTarget(AutoModelForCausalLM.from_config(config).float())
    assert target.decoder_layers is None and target.num_layers == 3
    input_ids = torch.randint(4, 40, (2, 6))
    states = full_run_hidden_states(target, input_ids, None)
    with caplog.at_level(logging.WARNING, logger="trainer.models.target"):
        for _ in range(2):
            assert torch.equal(target.capture(input_ids, None, [0]), states[1])
    assert caplog.text.count("GPT2Model has no `layers` ModuleList: capture runs the whole target.") == 1


@pytest.mark.parametrize("kind", ["llama", "gemma2"])  # gemma2: a soft-capped head
def test_final_hidden_states_are_what_the_lm_head_reads(kind):
    """Distillation's teacher: capture(final_hidden=True) keeps the same features (truncated or not)
    and adds the backbone's final-normed output, from which the LM head gives the target's logits."""
    target = any_target(kind)
    input_ids = torch.randint(4, 40, (2, 8))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5:] = 0
    with torch.no_grad():
        full = target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    for layer_ids in ([1], [2, 0], [target.num_layers - 1, 0]):
        features, final = target.capture(input_ids, attention_mask, layer_ids, final_hidden=True)
        assert torch.equal(features, target.capture(input_ids, attention_mask, layer_ids)), layer_ids
        assert torch.equal(final, full.hidden_states[-1]), layer_ids
    with torch.no_grad():
        logits = target.lm_head(final)
    softcap = getattr(target.text_config, "final_logit_softcapping", None)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    torch.testing.assert_close(logits, full.logits)

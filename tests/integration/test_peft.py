"""LoRA on a warm-started draft: merged before export, equal to base + delta, loadable via AutoModel."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModel

from modeling_dflash2 import DFlash2DraftModel
from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.drafts import randomize
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.commands import train
from trainer.publishing.contract import TargetDimensions
from trainer.publishing.export import export_draft, load_trained_draft

TARGET = TargetDimensions("org/tiny-target", hidden_size=32, vocab_size=53, num_layers=4)


def test_merged_export_is_base_plus_delta_and_loads_through_automodel(tmp_path):
    base = randomize(DFlash2DraftModel(tiny_draft_config_for(tiny_target())), seed=0)
    base.save_pretrained(tmp_path / "base")
    base = DFlash2DraftModel.from_pretrained(tmp_path / "base")
    original = {k: v.clone() for k, v in base.state_dict().items()}
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], task_type=None)
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:  # zero at init: give the adapter a real delta
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    layer = peft_model.base_model.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * (8 / 4)

    merged = load_trained_draft(tmp_path / "adapter")
    assert type(merged) is DFlash2DraftModel
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(
        merged.state_dict()["layers.0.self_attn.q_proj.weight"],
        original["layers.0.self_attn.q_proj.weight"] + delta,
        rtol=1e-5,
        atol=1e-6,
    )
    untouched = "layers.0.self_attn.k_proj.weight"
    assert torch.equal(merged.state_dict()[untouched], original[untouched])

    out = export_draft(merged, tmp_path / "export", target=TARGET)
    loaded = AutoModel.from_pretrained(out, trust_remote_code=True)
    expected = (original["layers.0.self_attn.q_proj.weight"] + delta).to(torch.bfloat16)
    torch.testing.assert_close(loaded.state_dict()["layers.0.self_attn.q_proj.weight"].to(torch.bfloat16), expected)


def test_recipe_with_lora_trains_an_adapter_that_exports(tmp_path):
    base = randomize(DFlash2DraftModel(tiny_draft_config_for(tiny_target())), seed=2)
    base.save_pretrained(tmp_path / "base")
    recipe = write_tiny_run(
        tmp_path, init_from=str(tmp_path / "base"), lora_r=4, save_strategy="no", num_eval_samples=0
    )
    train.main([str(recipe)])
    output = tmp_path / "output"
    assert (output / "adapter_config.json").exists() and (output / "adapter_model.safetensors").exists()
    merged = load_trained_draft(output)
    changed = [k for k, v in base.state_dict().items() if not torch.equal(merged.state_dict()[k], v)]
    assert changed and all(any(m in k for m in ("proj",)) for k in changed)
    assert export_draft(merged, tmp_path / "export", target=TARGET).is_dir()


def test_lora_without_a_warm_start_is_refused(tmp_path):
    recipe = write_tiny_run(tmp_path, lora_r=4)
    with pytest.raises(ValueError, match="set init_from"):
        train.main([str(recipe)])

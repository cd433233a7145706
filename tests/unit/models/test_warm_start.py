"""Warm starts from checkpoints built in the exact published layouts (z-lab DFlash2, z-lab v1, ours)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from modeling_dflash2 import DFlashDraftModel
from tests.support.drafts import draft_inputs, randomize, rewrite_safetensors
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.models.draft import build_draft
from trainer.models.warm_start import warm_start

IGNORED = ("auto_map", "transformers_version", "_name_or_path")


@pytest.fixture(scope="module")
def recipe_config():
    return tiny_draft_config_for(tiny_target())


def zlab_dflash2_dir(directory: Path, recipe_config, seed=0, weight_spelled=False) -> dict[str, torch.Tensor]:
    """As z-lab publishes DFlash2: no auto_map, nested dflash_config, BF16, bare codebook names
    (or, as z-lab's reference save writes them, `.weight`-suffixed)."""
    from modeling_dflash2 import DFlash2DraftModel

    directory.mkdir(parents=True)
    model = randomize(DFlash2DraftModel(recipe_config), seed).to(torch.bfloat16)
    config = {k: v for k, v in recipe_config.to_dict().items() if k not in IGNORED}
    config["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if weight_spelled:
        for side in ("predecessor", "successor"):
            tensors[f"candidate_selector.{side}_codebook.weight"] = tensors.pop(f"candidate_selector.{side}_codebook")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return {k: v for k, v in model.state_dict().items()}


def zlab_v1_dir(directory: Path, recipe_config, seed=1) -> DFlashDraftModel:
    """As z-lab publishes DFlash v1: auto_map to dflash.py, top-level block_size and rope_theta."""
    directory.mkdir(parents=True)
    config = {k: v for k, v in recipe_config.to_dict().items() if k not in IGNORED}
    dfc = config.pop("dflash_config")
    config.update(
        architectures=["DFlashDraftModel"],
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        block_size=dfc["block_size"],
        dflash_config={"mask_token_id": dfc["mask_token_id"], "target_layer_ids": dfc["target_layer_ids"]},
        rope_theta=config.pop("rope_parameters")["rope_theta"],
    )
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "dflash.py").write_text("# z-lab remote code (not used by this loader)\n")
    from modeling_dflash2 import DFlash2Config

    v1 = randomize(DFlashDraftModel(DFlash2Config(**config)), seed).eval()
    save_file({k: v.contiguous() for k, v in v1.state_dict().items()}, directory / "model.safetensors")
    assert len(v1.state_dict()) == 11 * recipe_config.num_hidden_layers + 3
    return v1


@pytest.mark.parametrize("weight_spelled", [False, True])
def test_zlab_dflash2_layouts_load_every_tensor(tmp_path, recipe_config, weight_spelled):
    expected = zlab_dflash2_dir(tmp_path / "zlab", recipe_config, weight_spelled=weight_spelled)
    model = warm_start(tmp_path / "zlab", recipe_config)
    assert type(model).__name__ == "DFlash2DraftModel"
    for name, tensor in expected.items():
        assert torch.equal(model.state_dict()[name], tensor.float()), name


def test_v1_warm_start_reproduces_the_v1_logits_at_step_0(tmp_path, recipe_config):
    v1 = zlab_v1_dir(tmp_path / "v1", recipe_config)
    model = warm_start(tmp_path / "v1", recipe_config).eval()
    inputs = draft_inputs(recipe_config, batch=2, context=5, blocks=2)
    head = torch.randn(recipe_config.vocab_size, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, v1_hidden = model(**inputs), v1(**inputs)
        assert torch.equal(model.compute_logits(hidden, head), v1.compute_logits(v1_hidden, head))
        tokens, _, _ = model.propose(hidden[:, 1:4], torch.tensor([3, 4]), head)
        assert torch.equal(tokens, v1.compute_logits(v1_hidden, head)[:, 1:4].argmax(-1))


def test_own_checkpoint_warm_starts(tmp_path, recipe_config):
    from modeling_dflash2 import DFlash2DraftModel

    ours = randomize(DFlash2DraftModel(recipe_config), 3)
    ours.save_pretrained(tmp_path / "ours")
    model = warm_start(tmp_path / "ours", recipe_config)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    ("dflash", "overrides", "message"),
    [
        ({"mask_token_id": 5}, {}, "mask_token_id=3 but the recipe's draft config has 5"),
        ({"target_layer_ids": [0, 3]}, {}, r"target_layer_ids=\(1, 2\) but the recipe's draft config has \(0, 3\)"),
        (None, {"hidden_size": 64, "intermediate_size": 64}, "hidden_size=32 but the recipe's draft config has 64"),
        ({"selector_rank": 4}, {}, "selector_rank=8 but the recipe's draft config has 4"),
        ({"block_size": 8}, {}, "block_size=4 but the recipe's draft config has 8; set init_allow_block_size_change"),
    ],
)
def test_config_disagreements_are_refused_by_field(tmp_path, recipe_config, dflash, overrides, message):
    zlab_dflash2_dir(tmp_path / "zlab", recipe_config)
    other = tiny_draft_config_for(tiny_target(), dflash, **overrides)
    with pytest.raises(ValueError, match=message):
        warm_start(tmp_path / "zlab", other)


def test_block_size_change_only_when_the_recipe_says_so(tmp_path, recipe_config):
    zlab_dflash2_dir(tmp_path / "zlab", recipe_config)
    larger = tiny_draft_config_for(tiny_target(), {"block_size": 8})
    model = warm_start(tmp_path / "zlab", larger, allow_block_size_change=True)
    assert model.block_size == 8


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("layers.0.mlp.up_proj.weight"), r"lacks tensors: \['layers.0.mlp.up_proj.weight'\]"),
        (lambda t: t.update({"lm_head.weight": torch.zeros(2, 2)}), r"does not define: \['lm_head.weight'\]"),
        (lambda t: t.update({"norm.weight": torch.zeros(16)}), r"wrong shape.*norm\.weight"),
        (lambda t: t.pop("layers.0.attention_conv.base_kernel"), "only part of the DFlash2 modules"),
    ],
)
def test_key_problems_are_refused_naming_the_keys(tmp_path, recipe_config, edit, message):
    zlab_dflash2_dir(tmp_path / "zlab", recipe_config)
    rewrite_safetensors(tmp_path / "zlab", edit)
    with pytest.raises(ValueError, match=message):
        warm_start(tmp_path / "zlab", recipe_config)


def test_train_py_warm_starts_in_float32_whatever_dtype_the_config_file_records(tmp_path, monkeypatch):
    """hub_configs record "dtype": "bfloat16" (the published format); the run trains float32 master
    weights, so a warm-started draft reaches the Trainer exactly as the float32 source computed it."""
    from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
    from tests.support.distributed.tiny_setup import write_tiny_run
    from trainer.commands import train
    from trainer.training import run as training_run
    from trainer.training.arguments import parse_arguments

    recipe = write_tiny_run(tmp_path, init_from=str(tmp_path / "source"), max_steps=1, num_eval_samples=0)
    config_file = tmp_path / "draft.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "dtype": "bfloat16"}))
    source = randomize(DFlash2DraftModel(DFlash2Config.from_json_file(config_file)), seed=5)
    source.save_pretrained(tmp_path / "source")
    received = {}

    class Recording(training_run.DFlash2Trainer):
        def __init__(self, model, *args, **kwargs):
            received.update({name: tensor.detach().clone() for name, tensor in model.state_dict().items()})
            super().__init__(model, *args, **kwargs)

    monkeypatch.setattr(training_run, "DFlash2Trainer", Recording)
    train.main([str(recipe)])
    assert received.keys() == source.state_dict().keys()
    for name, tensor in source.state_dict().items():
        assert received[name].dtype == torch.float32, name
        assert torch.equal(received[name], tensor), name
    draft = build_draft(parse_arguments([str(recipe)])[0]).eval()
    inputs = draft_inputs(draft.config, batch=1, context=5)
    with torch.no_grad():
        assert torch.equal(draft(**inputs), source.eval()(**inputs))


def _edit_config(directory: Path, dflash: dict | None = None, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    config["dflash_config"].update(dflash or {})
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("layout", "dflash", "changes", "message"),
    [
        ("dflash2", {"block_size": 1000000}, {}, r"dflash_config.block_size is 1000000, outside \[2, 64\]"),
        ("dflash2", None, {"hidden_size": 10**9}, r"hidden_size is 1000000000, outside \[1, 65536\]"),
        ("v1", None, {"block_size": 1000000}, r"block_size is 1000000, outside \[2, 64\]"),  # v1: top level
        ("v1", None, {"intermediate_size": 10**9}, r"intermediate_size is 1000000000, outside \[1, 262144\]"),
        (
            "dflash2",
            None,
            {"hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 4, "layer_types": ["x"] * 4},
            r"warm-starting from this checkpoint needs about .* parameters x 8 bytes: the fp32 draft and the "
            r"checkpoint's tensors as read\), more than the .* of memory available$",
        ),
    ],
)
def test_an_absurd_source_config_is_refused_before_anything_is_built(
    tmp_path, recipe_config, layout, dflash, changes, message
):
    source = tmp_path / "source"
    (zlab_dflash2_dir if layout == "dflash2" else zlab_v1_dir)(source, recipe_config)
    _edit_config(source, dflash, **changes)
    start = time.monotonic()
    with pytest.raises(ValueError, match=message) as refused:
        warm_start(source, recipe_config, allow_block_size_change=True)
    assert time.monotonic() - start < 10
    assert str(refused.value).startswith(f"init_from {source}/config.json: ") and "\n" not in str(refused.value)


def test_a_v1_source_without_num_target_layers_is_within_bounds(tmp_path, recipe_config):
    """z-lab's v1 configs may omit num_target_layers: the bounds do not require it."""
    from trainer.models.config_bounds import bounds_violations

    zlab_v1_dir(tmp_path / "v1", recipe_config)
    config = json.loads((tmp_path / "v1" / "config.json").read_text())
    config.pop("num_target_layers")
    assert bounds_violations(config) == []

"""A draft config the export would refuse is refused before training, by the export's own rules.

Issue 31 (Deliver 5) and issue 32: `selector_top_k: 1`, `input_embedding_scale: 2.0` and mixed
full/sliding layers with `is_causal` unset trained and were then refused at export (rules 8, 11, 14);
a DFlash v1 draft trained and its export ended in a TypeError traceback; the selector's bound lived
in three homes that disagreed. The bounds are now defined once (modeling_dflash2.configuration_dflash2)
and training runs the export's config rules on the recipe's draft before anything is built.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from modeling_dflash2.configuration_dflash2 import MIN_SELECTOR_TOP_K, softcap_value
from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.drafts import FIXTURES, load_fixture_json, tiny_config_kwargs, tiny_dflash_config, tiny_v1_draft
from trainer.commands import train
from trainer.commands.runner import run
from trainer.models.config_bounds import bounds_violations, parameter_count
from trainer.publishing.contract import (
    ExportValidationError,
    TargetDimensions,
    config_violations,
    draft_config_violations,
    public_config,
)
from trainer.publishing.draft_gate import check_draft_for_target, load_draft_config
from trainer.publishing.export import export_draft, load_trained_draft

TARGET = TargetDimensions("org/tiny", hidden_size=32, vocab_size=50, num_layers=6)


def draft_args(path: Path | None = None, init_from: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(draft_config=str(path) if path else None, init_from=init_from)


def write_config(where: Path, **overrides: Any) -> Path:
    """The tiny DFlash2 config as a JSON file, with `overrides` (raw values, not validated)."""
    values = tiny_config_kwargs(**overrides)
    values["model_type"] = "qwen3"
    path = where / "draft.json"
    path.write_text(json.dumps(values))
    return path


MIXED_LAYERS = {
    "is_causal": None,
    "layer_types": ["full_attention", "sliding_attention"],
    "sliding_window": 8,
    "use_sliding_window": True,
}
EXPORT_REFUSED = [
    pytest.param({"dflash_config": tiny_dflash_config(input_embedding_scale=2.0)}, 11, id="input_embedding_scale"),
    pytest.param(MIXED_LAYERS, 14, id="is_causal-unset-mixed-layers"),
]


# -- one definition of each bound ------------------------------------------------------------------


def test_selector_top_k_has_one_bound_in_config_contract_and_size_bounds():
    assert MIN_SELECTOR_TOP_K == 2
    with pytest.raises(ValueError, match=r"selector_top_k` must be an integer in \[2, vocab_size=50\].*rule 8"):
        DFlash2Config(**tiny_config_kwargs(dflash_config=tiny_dflash_config(selector_top_k=1)))
    raw = tiny_config_kwargs(dflash_config=tiny_dflash_config(selector_top_k=1))
    assert any("selector_top_k is 1, outside [2," in failure for failure in bounds_violations(raw))
    public = public_config(DFlash2Config(**tiny_config_kwargs()), torch.bfloat16)
    public["dflash_config"]["selector_top_k"] = 1
    # the contract numbers the config's own verdict (rule 8), in the config's words
    assert config_violations(public, TARGET) == [
        "rule 8: selector_top_k must be an integer in [2, vocab_size=50] (docs/contract.md rule 8: the selector "
        "chooses among its top-k candidates) (got 1)"
    ]
    # the edges agree in all three homes
    for top_k in (2, 50):
        config = DFlash2Config(**tiny_config_kwargs(dflash_config=tiny_dflash_config(selector_top_k=top_k)))
        assert draft_config_violations(config, TARGET) == []
    with pytest.raises(ValueError, match=r"selector_top_k` must be an integer in \[2, vocab_size=50\].*got 51"):
        DFlash2Config(**tiny_config_kwargs(dflash_config=tiny_dflash_config(selector_top_k=51)))


def test_a_softcap_of_zero_means_off_everywhere_and_is_never_written():
    assert softcap_value(0) is None and softcap_value(None) is None and softcap_value(20) == 20.0
    with pytest.raises(ValueError, match="final_logit_softcapping -1"):
        softcap_value(-1)
    config = DFlash2Config(**tiny_config_kwargs(dflash_config=tiny_dflash_config(final_logit_softcapping=0)))
    assert config.final_logit_softcapping is None
    assert draft_config_violations(config, TARGET) == []  # trains, and exports with the cap omitted
    assert "final_logit_softcapping" not in public_config(config, torch.bfloat16)["dflash_config"]


def test_released_configs_still_load_and_pass_the_export_rules():
    shared = FIXTURES.parents[2] / "shared" / "contract" / "zlab-dflash2-config.json"  # beside the checkout
    shipped = sorted((FIXTURES.parents[1] / "hub_configs").glob("*.json"))  # the starter configs
    for path in (FIXTURES / "zlab-dflash2-config.json", shared, *shipped):
        if not path.exists():
            continue
        config = DFlash2Config.from_json_file(path)
        assert draft_config_violations(config) == [], path
    assert bounds_violations(load_fixture_json("zlab-dflash2-config.json")) == []


# -- refused before training, with the export's rule and message -----------------------------------


@pytest.mark.parametrize(("overrides", "rule"), EXPORT_REFUSED)
def test_a_draft_config_export_would_refuse_is_refused_when_read(tmp_path, overrides, rule):
    path = write_config(tmp_path, **overrides)
    # what the export says about this draft, trained or not
    draft = DFlash2DraftModel(DFlash2Config.from_json_file(path))
    with pytest.raises(ExportValidationError) as exported:
        export_draft(draft, tmp_path / "export", target=TARGET)
    export_lines = [line.strip() for line in str(exported.value).splitlines() if line.strip().startswith("rule ")]
    assert export_lines and all(line.startswith(f"rule {rule}:") for line in export_lines)
    # the same rule and message, before anything is built
    with pytest.raises(ExportValidationError) as refused:
        load_draft_config(draft_args(path))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"draft_config {path}: export would refuse this draft")
    for line in export_lines:
        assert line in message
    with pytest.raises(ExportValidationError, match=f"rule {rule}:"):
        load_draft_config(draft_args(path), building=False)  # dflash2 plan says it too


def test_selector_top_k_of_one_is_refused_naming_the_file(tmp_path):
    path = write_config(tmp_path, dflash_config=tiny_dflash_config(selector_top_k=1))
    with pytest.raises(ValueError, match=rf"^draft_config {path}: .*selector_top_k is 1, outside \[2, .*rule 8"):
        load_draft_config(draft_args(path))


def test_init_from_a_checkpoint_export_would_refuse_is_refused(tmp_path):
    config = DFlash2Config(**tiny_config_kwargs(**MIXED_LAYERS))
    DFlash2DraftModel(config).save_pretrained(tmp_path / "init")
    with pytest.raises(ExportValidationError, match=r"^init_from .*init: export would refuse .*rule 14: is_causal"):
        load_draft_config(draft_args(init_from=str(tmp_path / "init")), building=False)


def test_rules_that_need_the_target_are_checked_once_it_is_known():
    config = DFlash2Config(**tiny_config_kwargs())
    target = SimpleNamespace(source_name="org/tiny", hidden_size=32, vocab_rows=50, num_layers=6)
    check_draft_for_target(config, target)  # the matching target passes
    other = SimpleNamespace(source_name="org/other", hidden_size=32, vocab_rows=60, num_layers=8)
    with pytest.raises(ExportValidationError) as refused:
        check_draft_for_target(config, other)
    message = str(refused.value)
    assert "rule 13: vocab_size 50 != the target's padded vocab 60" in message
    assert "rule 10: num_target_layers 6 != the target's depth 8" in message


# -- DFlash v1: trains as a baseline, never exported with a traceback --------------------------------


def test_a_v1_checkpoint_export_is_one_rule_22_line(tmp_path):
    tiny_v1_draft().save_pretrained(tmp_path / "v1")
    with pytest.raises(ExportValidationError, match=r"^rule 22: checkpoint .*v1/config.json is a DFlash v1 draft"):
        load_trained_draft(tmp_path / "v1")
    # a bare weights folder with a v1 --config: refused the same way, not a TypeError in the size check
    (tmp_path / "weights").mkdir()
    (tmp_path / "v1" / "model.safetensors").rename(tmp_path / "weights" / "model.safetensors")
    with pytest.raises(ExportValidationError, match=r"^rule 22: draft config .* is a DFlash v1 draft"):
        load_trained_draft(tmp_path / "weights", tmp_path / "v1" / "config.json")


def test_parameter_count_reads_absent_dflash2_fields_written_as_null():
    config = tiny_config_kwargs()
    config["dflash_config"] = {**config["dflash_config"], "conv_kernel_size": None, "selector_rank": None}
    assert parameter_count(config) > 0


def test_a_v1_draft_trains_with_a_warning_and_is_refused_only_before_a_push(tmp_path, caplog):
    path = tmp_path / "v1.json"
    tiny_v1_draft().config.to_json_file(path)
    with caplog.at_level(logging.WARNING):
        config = load_draft_config(draft_args(path))
    assert not config.is_dflash2
    assert "is a DFlash v1 draft: it trains" in caplog.text and "rule 22" in caplog.text
    target = SimpleNamespace(source_name="org/tiny", hidden_size=32, vocab_rows=50, num_layers=6)
    check_draft_for_target(config, target, push_to_hub=False)
    with pytest.raises(ValueError, match=r"^rule 22: the draft is a DFlash v1 draft.*unset push_to_hub"):
        check_draft_for_target(config, target, push_to_hub=True)


# -- end to end: dflash2 train stops with one line before any step --------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("draftrules")
    write_tiny_run(root)
    return root


def test_train_refuses_a_draft_export_would_refuse_before_any_step(tiny_run, tmp_path, capsys):
    draft = json.loads((tiny_run / "draft.json").read_text())
    draft["dflash_config"]["input_embedding_scale"] = 2.0
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    recipe = yaml.safe_load((tiny_run / "recipe.yaml").read_text())
    recipe.update(draft_config=str(tmp_path / "draft.json"), output_dir=str(tmp_path / "output"))
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exit_info:
        run(train.main, [str(tmp_path / "recipe.yaml")])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rule 11: input_embedding_scale must be 1.0" in errors[0], errors
    assert not list((tmp_path / "output").glob("checkpoint-*"))
    assert not (tmp_path / "output" / "model.safetensors").exists()


def test_a_v1_draft_config_still_trains_as_the_compare_baseline(tiny_run, tmp_path, caplog):
    from modeling_dflash2.configuration_dflash2 import DFLASH2_REQUIRED_FIELDS

    draft = json.loads((tiny_run / "draft.json").read_text())
    draft["architectures"] = ["DFlashDraftModel"]
    for name in DFLASH2_REQUIRED_FIELDS:
        draft["dflash_config"].pop(name)
    (tmp_path / "v1.json").write_text(json.dumps(draft))
    argv = [str(tiny_run / "recipe.yaml"), "--draft_config", str(tmp_path / "v1.json")]
    argv += ["--output_dir", str(tmp_path / "output"), "--max_steps", "1", "--eval_strategy", "'no'"]
    argv += ["--save_strategy", "'no'", "--num_eval_samples", "0", "--spec_eval_prompts", "0"]
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as exit_info:
        run(train.main, argv)
    assert exit_info.value.code == 0
    assert (tmp_path / "output" / "model.safetensors").exists()
    assert "is a DFlash v1 draft: it trains" in caplog.text

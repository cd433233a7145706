"""Export: the public layout, every contract rule named, atomic writes, round trip, card, provenance."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoModel

from modeling_dflash2 import DFlash2DraftModel
from modeling_dflash2.checkpoint_dflash2 import REMOTE_CODE_FILES
from tests.support.drafts import randomize
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.evaluation.report import render_markdown
from trainer.models.target import target_dimensions
from trainer.publishing.contract import ExportValidationError, TargetDimensions, contract_violations, public_config
from trainer.publishing.export import (
    EXPORT_FILES,
    PLOT_FILE,
    RECIPE_FILE,
    export_draft,
    load_trained_draft,
    training_record,
)
from trainer.publishing.model_card import per_position_series

TARGET = TargetDimensions(name="org/tiny-target", hidden_size=32, vocab_size=53, num_layers=4)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture
def draft(target):
    return randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=0)


def _dims(target):
    return TargetDimensions("org/tiny-target", target.hidden_size, target.vocab_rows, target.num_layers)


EVALUATION = {
    "eval_loss": 2.5,
    "eval_tau_walk": 2.75,
    "eval_tau_unary": 2.5,
    "eval_accuracy": 0.4,
    "eval_accuracy_position_1": 0.6,
    "eval_accuracy_position_2": 0.4,
    "eval_accuracy_position_3": 0.2,
    "step": 10,
}


def test_export_writes_exactly_the_public_folder(tmp_path, target, draft):
    record = {
        "training_arguments": {"learning_rate": 1e-3, "hub_token": "hf_secret_token", "num_anchors": 6},
        "global_step": 10,
        "evaluation": EVALUATION,
    }
    out = export_draft(draft, tmp_path / "export", target=_dims(target), record=record)
    assert {p.name for p in out.iterdir()} == EXPORT_FILES | {PLOT_FILE}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": 3,
        "target_layer_ids": [1, 2],
        "conv_kernel_size": 2,
        "conv_group_size": 8,
        "selector_rank": 8,
        "selector_top_k": 4,
    }
    assert config["is_causal"] is False and config["num_target_layers"] == 4
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert config["layer_types"] == ["full_attention"] and "sliding_window" not in config
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash2.DFlash2Config",
        "AutoModel": "modeling_dflash2.DFlash2DraftModel",
    }
    for key in ("block_size", "partial_rotary_factor", "eagle_aux_hidden_state_layer_ids", "rope_theta"):
        assert key not in config
    with safe_open(out / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
        assert all(handle.get_tensor(name).dtype == torch.bfloat16 for name in names)
    assert names == set(draft.state_dict()) and len(names) == 15 * 1 + 6
    assert "candidate_selector.successor_codebook" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    provenance = (out / "dflash2_provenance.json").read_text()
    assert "hf_secret_token" not in provenance and '"learning_rate": 0.001' in provenance
    assert json.loads(provenance)["serving"]["vllm"]["num_speculative_tokens"] == 3
    # the code copied into the checkpoint carries its licence, the same one the card declares
    for code_file in REMOTE_CODE_FILES:
        assert (out / code_file).read_text().startswith("# SPDX-License-Identifier: Apache-2.0\n")
    assert "\nlicense: apache-2.0\n" in (out / "README.md").read_text()


def test_model_card_snippet_decodes_with_the_exported_folder(tmp_path, target, draft):
    """The card's plain-transformers snippet, run as written on the bf16 export and an fp32 target
    saved where the card names the base model: greedy output equals the target's greedy output."""
    out = export_draft(draft, tmp_path / "export", target=_dims(target), record={})
    card = (out / "README.md").read_text()
    section = card.split("## Speculative decoding in plain transformers", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    snippet = snippet.replace("<this repo>", str(out)).replace("org/tiny-target", str(tmp_path / "target"))
    namespace: dict = {}
    exec(snippet, namespace)
    input_ids, output_ids = namespace["input_ids"], namespace["output_ids"]
    assert namespace["draft"].dtype == torch.bfloat16 and namespace["target"].dtype == torch.float32
    eos = target.tokenizer.eos_token_id
    expected = target.model.generate(input_ids, max_new_tokens=256, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(output_ids, expected)


def test_model_card_metadata_and_serving_lines(tmp_path, target, draft):
    out = export_draft(draft, tmp_path / "export", target=_dims(target), record={"evaluation": EVALUATION})
    card = (out / "README.md").read_text()
    metadata = yaml.safe_load(card.split("---")[1])
    assert metadata["library_name"] == "transformers" and metadata["base_model"] == "org/tiny-target"
    assert {"speculative-decoding", "dflash", "dflash2", "draft-model"} <= set(metadata["tags"])
    assert metadata["license"] == "apache-2.0"
    assert '"num_speculative_tokens": 3' in card
    assert "--speculative-num-draft-tokens 4" in card and "--speculative-algorithm DFLASH" in card
    assert "trust_remote_code=True" in card
    assert "| τ, selector walk" in card and "2.7500" in card
    assert f"![per-position acceptance]({PLOT_FILE})" in card
    assert (out / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _report(benchmark: str | None, tau: float) -> dict:
    """A speculative-decoding report as evaluate.py writes it (`None`: from before benchmarks)."""
    path = {
        "mean_tau": tau,
        "tau_histogram": [1, 1, 0, 0],
        "per_position_acceptance": [0.5, 0.0, 0.0],
        "tokens_per_second": 9.0,
        "speedup": 0.75,
    }
    report = {"prompts": 2, "max_new_tokens": 8, "temperature": 0.0, "target_tokens_per_second": 12.0}
    report["paths"] = {"trained/selector": path}
    return report if benchmark is None else {"benchmark": benchmark, "skipped_for_length": 0, **report}


def test_model_card_embeds_each_benchmarks_table_under_its_heading(tmp_path, target, draft):
    heldout, humaneval = _report(None, 1.5), _report("humaneval", 1.25)  # an old report counts as heldout
    out = export_draft(
        draft, tmp_path / "export", target=_dims(target), record={}, evaluation_report=[heldout, humaneval]
    )
    card = (out / "README.md").read_text()
    first = f"### Speculative decoding: heldout\n\n{render_markdown(heldout)}"
    second = f"### Speculative decoding: humaneval\n\n{render_markdown(humaneval)}"
    assert first in card and second in card and card.index(first) < card.index(second)
    assert "| trained/selector | 1.250 | 9.0 | 0.75× |" in second
    provenance = json.loads((out / "dflash2_provenance.json").read_text())
    assert provenance["speculative_evaluation"] == {"heldout": heldout, "humaneval": humaneval}
    assert f"![per-position acceptance]({PLOT_FILE})" in card  # measured acceptance alone makes a plot


def test_a_single_report_still_exports_and_two_on_one_benchmark_are_refused(tmp_path, target, draft):
    out = export_draft(draft, tmp_path / "one", target=_dims(target), evaluation_report=_report("humaneval", 2.0))
    provenance = json.loads((out / "dflash2_provenance.json").read_text())
    assert list(provenance["speculative_evaluation"]) == ["humaneval"]
    with pytest.raises(ValueError, match="two evaluation reports are for benchmark 'heldout'"):
        reports = [_report(None, 2.0), _report("heldout", 3.0)]
        export_draft(draft, tmp_path / "two", target=_dims(target), evaluation_report=reports)
    assert not (tmp_path / "two").exists()


def test_acceptance_plot_has_a_curve_per_benchmark_and_path():
    series = per_position_series(EVALUATION, {"heldout": _report(None, 1.5), "humaneval": _report("humaneval", 1.0)})
    assert series == {
        "teacher-forced accuracy": [0.6, 0.4, 0.2],
        "heldout: trained/selector": [0.5, 0.0, 0.0],
        "humaneval: trained/selector": [0.5, 0.0, 0.0],
    }


def test_exported_folder_loads_through_automodel_and_reproduces_bf16_logits(tmp_path, target, draft):
    out = export_draft(draft, tmp_path / "export", target=_dims(target))
    loaded = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16).eval()
    assert type(loaded).__name__ == "DFlash2DraftModel"
    reference = draft.to(torch.bfloat16).eval()
    inputs = {
        "position_ids": torch.arange(9)[None],
        "noise_embedding": torch.randn(1, 4, 32).to(torch.bfloat16),
        "target_hidden": torch.randn(1, 5, 64).to(torch.bfloat16),
    }
    with torch.no_grad():
        assert torch.equal(loaded(**inputs), reference(**inputs))


def _violations(draft, target, edit_config=None, edit_tensors=None, **kwargs):
    config = public_config(draft.config, torch.bfloat16)
    tensors = {k: v.to(torch.bfloat16) for k, v in draft.state_dict().items()}
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    return contract_violations(config, tensors, _dims(target), **kwargs)


RULE_CASES = [
    (lambda c: c.update(architectures=["DFlashDraftModel"]), None, 1),
    (lambda c: c.update(model_type="dflash2"), None, 1),
    (lambda c: c.update(block_size=4), None, 2),
    (lambda c: c["dflash_config"].pop("selector_rank"), None, 3),
    (lambda c: c["dflash_config"].update(attention_mode="mla"), None, 4),
    (lambda c: c.update(target_hidden_size=32), None, 5),
    (lambda c: c["dflash_config"].update(conv_kernel_size=5), None, 7),
    (lambda c: c["dflash_config"].update(selector_top_k=1), None, 8),
    (lambda c: c["dflash_config"].update(mask_token_id=53), None, 9),
    (lambda c: c.update(num_target_layers=6), None, 10),
    (lambda c: c["dflash_config"].update(final_logit_softcapping=0), None, 11),
    (lambda c: c["dflash_config"].update(input_embedding_scale=2.0), None, 11),
    (lambda c: c.update(hidden_act="gelu"), None, 12),
    (lambda c: c.update(vocab_size=60), None, 13),
    (lambda c: c.update(is_causal=None), None, 14),
    (lambda c: c.update(layer_types=["sliding_attention"]), None, 14),
    (lambda c: c.update(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"}), None, 15),
    (None, lambda t: t.update({"lm_head.weight": torch.zeros(53, 32, dtype=torch.bfloat16)}), 16),
    (None, lambda t: t.pop("layers.0.mlp_conv.base_kernel"), 16),
    (None, lambda t: t.update({"fc.weight": torch.zeros(32, 96, dtype=torch.bfloat16)}), 17),
    (None, lambda t: t.update({"norm.weight": torch.zeros(32)}), 19),
    (None, lambda t: t["fc.weight"].__setitem__((0, 0), float("nan")), 19),
]


@pytest.mark.parametrize(("edit_config", "edit_tensors", "rule"), RULE_CASES)
def test_each_broken_rule_is_named(target, draft, edit_config, edit_tensors, rule):
    failures = _violations(draft, target, edit_config, edit_tensors)
    assert any(f.startswith(f"rule {rule}:") for f in failures), failures


def test_a_valid_draft_breaks_no_rule_and_block_size_is_pinned(target, draft):
    assert _violations(draft, target) == []
    assert _violations(draft, target, expected_block_size=8)[0].startswith("rule 6:")


def test_failed_export_writes_nothing_and_keeps_an_existing_folder(tmp_path, target, draft):
    out = export_draft(draft, tmp_path / "export", target=_dims(target))
    before = (out / "model.safetensors").read_bytes()
    wrong_target = TargetDimensions("org/other", hidden_size=64, vocab_size=53, num_layers=4)
    with pytest.raises(ExportValidationError, match="rule 12: hidden_size 32 != the target's hidden size 64"):
        export_draft(draft, tmp_path / "export", target=wrong_target, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before
    with pytest.raises(ExportValidationError, match="rule 12"):
        export_draft(draft, tmp_path / "fresh", target=wrong_target)
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary leftovers
    with pytest.raises(FileExistsError):
        export_draft(draft, tmp_path / "export", target=_dims(target))


def test_plain_dflash_is_rejected(tmp_path, target):
    from tests.support.drafts import tiny_v1_draft

    with pytest.raises(ExportValidationError, match="rule 22"):
        export_draft(tiny_v1_draft(), tmp_path / "export", target=None)


def test_unset_is_causal_with_mixed_layers_cannot_be_served_by_one_flag(tmp_path, target):
    config = tiny_draft_config_for(
        target,
        num_hidden_layers=2,
        layer_types=["full_attention", "sliding_attention"],
        use_sliding_window=True,
        sliding_window=8,
        is_causal=None,
    )
    with pytest.raises(ExportValidationError, match="rule 14: is_causal is unset"):
        export_draft(DFlash2DraftModel(config), tmp_path / "export", target=_dims(target))


def test_export_from_training_checkpoint_and_bare_safetensors(tmp_path, target, draft):
    draft.save_pretrained(tmp_path / "checkpoint")
    torch.save({"not": "used"}, tmp_path / "checkpoint" / "optimizer.pt")
    loaded = load_trained_draft(tmp_path / "checkpoint")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in draft.state_dict().items())
    bare = tmp_path / "merged"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((tmp_path / "checkpoint" / "model.safetensors").read_bytes())
    draft.config.to_json_file(tmp_path / "draft.json")
    with pytest.raises(ValueError, match="--config"):
        load_trained_draft(bare)
    loaded = load_trained_draft(bare, tmp_path / "draft.json")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in draft.state_dict().items())


def test_training_record_reads_the_json_recipe_and_strips_secrets(tmp_path):
    recipe = {
        "format": "dflash2-hub recipe",
        "model_arguments": {"target": "org/tiny-target", "init_from": None},
        "training_arguments": {"learning_rate": 0.001, "hub_token": "hf_abcdef_secret", "push_to_hub_token": "x"},
    }
    (tmp_path / RECIPE_FILE).write_text(json.dumps(recipe))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": [EVALUATION]}))
    record = training_record(tmp_path)
    assert record["global_step"] == 3 and record["evaluation"]["eval_tau_walk"] == 2.75
    assert record["model_arguments"]["target"] == "org/tiny-target"
    assert record["training_arguments"] == {"learning_rate": 0.001}
    assert "hf_abcdef_secret" not in json.dumps(record)


class Payload:
    """Unpickling this runs `touch`: what a crafted training_args.bin from a stranger does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_exporting_a_strangers_checkpoint_never_unpickles_its_training_args(tmp_path, target, draft, caplog):
    checkpoint = tmp_path / "checkpoint"
    draft.save_pretrained(checkpoint)
    marker = tmp_path / "payload-ran"
    (checkpoint / "training_args.bin").write_bytes(pickle.dumps(Payload(marker)))
    with caplog.at_level(logging.WARNING, logger="trainer.publishing.export"):
        record = training_record(checkpoint)
    assert not marker.exists() and record == {}
    assert f"has no {RECIPE_FILE}; its training_args.bin is a pickle and is not read" in caplog.text
    export_draft(load_trained_draft(checkpoint), tmp_path / "export", target=_dims(target), record=record)
    assert not marker.exists()


@pytest.fixture
def run_with_checkpoint(tmp_path, draft):
    """outputs/run holding checkpoint-4 (with its optimizer state) and the final draft."""
    run = tmp_path / "run"
    draft.save_pretrained(run / "checkpoint-4")
    (run / "checkpoint-4" / "optimizer.pt").write_bytes(b"optimizer state")
    draft.save_pretrained(run)
    return run


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("run", "export output .*run is or holds the checkpoint .*checkpoint-4: choose another folder"),
        ("run/checkpoint-4", "export output .*checkpoint-4 is or holds the checkpoint"),
        ("run/checkpoint-4/export", "export output .*export lies inside the checkpoint .*checkpoint-4"),
        (".", "is or holds the checkpoint"),
    ],
)
def test_overwrite_never_replaces_the_source_or_the_run_holding_it(
    tmp_path, target, draft, run_with_checkpoint, output, message
):
    before = _tree(run_with_checkpoint)
    with pytest.raises(ValueError, match=message):
        export_draft(
            draft,
            tmp_path / output,
            target=_dims(target),
            overwrite=True,
            source=run_with_checkpoint / "checkpoint-4",
        )
    assert _tree(run_with_checkpoint) == before


def test_overwrite_replaces_only_an_earlier_export_and_keeps_the_users_siblings(tmp_path, target, draft):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes is not an earlier export .* choose another folder"):
        export_draft(draft, other, target=_dims(target), overwrite=True)
    assert (other / "todo.txt").read_text() == "mine"
    with pytest.raises(FileExistsError, match=r"set overwrite=True \(--overwrite\) to replace it"):
        export_draft(draft, other, target=_dims(target))
    out = export_draft(draft, tmp_path / "export", target=_dims(target))
    for sibling in ("export.old", "export.new"):  # the user's own folders, named like a naive backup
        (tmp_path / sibling).mkdir()
        (tmp_path / sibling / "keep.txt").write_text(sibling)
    export_draft(randomize(draft, seed=1), out, target=_dims(target), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "export.new", "export.old", "notes"]
    assert (tmp_path / "export.old" / "keep.txt").read_text() == "export.old"
    assert (tmp_path / "export.new" / "keep.txt").read_text() == "export.new"
    assert load_trained_draft(out).state_dict().keys() == draft.state_dict().keys()


def test_target_dimensions_from_a_local_target(tmp_path, target):
    target.model.save_pretrained(tmp_path / "target")
    dims = target_dimensions(str(tmp_path / "target"), name="org/tiny")
    assert dims == TargetDimensions("org/tiny", 32, target.vocab_rows, 4)


def test_cli_exports_a_checkpoint(tmp_path, target, draft, capsys):
    from trainer.commands import export as export_cli

    target.model.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "checkpoint")
    out = export_cli.main(
        [
            str(tmp_path / "checkpoint"),
            str(tmp_path / "export"),
            "--target",
            str(tmp_path / "target"),
            "--block-size",
            "4",
        ]
    )
    assert Path(out).is_dir() and "exported" in capsys.readouterr().out


def test_cli_embeds_one_evaluation_report_per_benchmark(tmp_path, target, draft):
    from trainer.commands import export as export_cli

    target.model.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "checkpoint")
    for benchmark in ("heldout", "humaneval"):
        (tmp_path / f"{benchmark}.json").write_text(json.dumps(_report(benchmark, 1.5)))
    out = export_cli.main(
        [
            *(str(tmp_path / "checkpoint"), str(tmp_path / "export"), "--target", str(tmp_path / "target")),
            *("--evaluation-report", str(tmp_path / "heldout.json")),
            *("--evaluation-report", str(tmp_path / "humaneval.json")),
        ]
    )
    card = (Path(out) / "README.md").read_text()
    assert "### Speculative decoding: heldout" in card and "### Speculative decoding: humaneval" in card


@pytest.mark.parametrize(
    ("training", "expected"),
    [
        ({"loss_type": "ce"}, "loss `ce`, selector α"),
        ({"loss_type": "kd"}, "loss `kd` with distillation from the target (weight 1, temperature 1), selector"),
        (
            {"loss_type": "ce", "kd_weight": 0.5, "kd_temperature": 2.0},
            "loss `ce` with distillation from the target (weight 0.5, temperature 2), selector",
        ),
    ],
)
def test_model_card_names_the_distillation_the_draft_was_trained_with(training, expected):
    from trainer.publishing.model_card import render_model_card

    config = json.loads((Path(__file__).resolve().parents[2] / "hub_configs" / "smollm2-135m-dflash2.json").read_text())
    card = render_model_card(config, None, {"training_arguments": training}, {}, None)
    assert expected in str(card)


def _checkpoint_with(directory: Path, draft, dflash: dict | None = None, **changes) -> Path:
    """The draft saved as a training checkpoint whose config.json then says `changes`."""
    draft.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    config["dflash_config"].update(dflash or {})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


HUGE = {
    "hidden_size": 65536,
    "intermediate_size": 262144,
    "num_hidden_layers": 4,
    "layer_types": ["full_attention"] * 4,
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dflash": {"block_size": 1000000}}, r"dflash_config.block_size is 1000000, outside \[2, 64\]"),
        ({"hidden_size": 10**9}, r"hidden_size is 1000000000, outside \[1, 65536\]"),
        ({"num_hidden_layers": 10**9}, r"num_hidden_layers is 1000000000, outside \[1, 256\]"),
        ({"vocab_size": 10**12}, r"vocab_size is 1000000000000, outside \[2, 4194304\]"),
        ({"hidden_size": 1e9}, r"hidden_size must be an integer, got 1000000000.0"),
        ({"num_attention_heads": 5, "head_dim": None}, "num_attention_heads 5 must divide hidden_size 32"),
        (HUGE, r"exporting this draft needs about 3024.4 GiB \(231,956,677,520 parameters x 14 bytes: .* available$"),
    ],
)
def test_absurd_sizes_are_refused_from_config_json_before_anything_is_built(tmp_path, draft, changes, message):
    checkpoint = _checkpoint_with(tmp_path / "checkpoint", draft, **changes)
    start = time.monotonic()
    with pytest.raises(ValueError, match=message) as refused:
        load_trained_draft(checkpoint)
    assert time.monotonic() - start < 10
    assert str(refused.value).startswith(f"checkpoint {checkpoint}/config.json: ")
    assert "\n" not in str(refused.value)


def test_a_bare_checkpoints_config_is_checked_too(tmp_path, draft):
    bare = tmp_path / "merged"
    draft.save_pretrained(bare)
    (bare / "config.json").rename(tmp_path / "draft.json")
    _checkpoint_with(tmp_path / "wide", draft, hidden_size=10**9)
    with pytest.raises(ValueError, match=r"^draft config .*wide/config.json: hidden_size is 1000000000, outside"):
        load_trained_draft(bare, tmp_path / "wide" / "config.json")


def test_export_of_a_huge_block_size_is_refused_at_once_not_after_minutes_of_rule_20(tmp_path, target, draft, capsys):
    """The reported case: a config.json saying block_size 1000000 ran the round trip's forward for
    ten minutes. Now it is refused in one line, long before any forward."""
    from trainer.commands import export as export_cli
    from trainer.commands.runner import run

    target.model.save_pretrained(tmp_path / "target")
    checkpoint = _checkpoint_with(tmp_path / "checkpoint", draft, dflash={"block_size": 1000000})
    capsys.readouterr()  # the saves' progress bars
    start = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        run(export_cli.main, [str(checkpoint), str(tmp_path / "export"), "--target", str(tmp_path / "target")])
    elapsed = time.monotonic() - start
    assert stopped.value.code == 2 and elapsed < 10, elapsed
    assert capsys.readouterr().err == (
        f"error: checkpoint {checkpoint}/config.json: dflash_config.block_size is 1000000, outside [2, 64] "
        "(servers draft block_size - 1 tokens per step; published drafts use 8 or 16)\n"
    )
    assert not (tmp_path / "export").exists()


def test_an_in_memory_draft_with_a_block_beyond_the_bound_is_refused_before_rule_20(tmp_path, target):
    wide_block = DFlash2DraftModel(tiny_draft_config_for(target, {"block_size": 100}))
    with pytest.raises(ValueError, match=r"^the draft: dflash_config.block_size is 100, outside \[2, 64\]"):
        export_draft(wide_block, tmp_path / "export", target=_dims(target))
    assert list(tmp_path.iterdir()) == []


def test_an_export_that_would_not_fit_in_memory_says_how_much_it_needs(tmp_path, draft, monkeypatch):
    checkpoint = _checkpoint_with(tmp_path / "checkpoint", draft)
    monkeypatch.setattr("trainer.models.config_bounds.available_memory", lambda: 1000)
    count = sum(tensor.numel() for tensor in draft.state_dict().values())
    with pytest.raises(ValueError) as refused:
        load_trained_draft(checkpoint, dtype=torch.float32)
    assert str(refused.value) == (
        f"checkpoint {checkpoint}/config.json: exporting this draft needs about {count * 20 / 1024:.1f} KiB "
        f"({count:,} parameters x 20 bytes: the draft as loaded, its cast copy, and the round trip's reloaded "
        "folder and fp32 reference), more than the 1000 bytes of memory available"
    )


def test_available_memory_is_read_from_this_machine():
    from trainer.models.config_bounds import available_memory

    total = (
        int(
            next(
                line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
            ).split()[1]
        )
        * 1024
    )
    assert 0 < available_memory() <= total


def test_a_failing_overwrite_keeps_the_earlier_export_whole(tmp_path, target, draft, monkeypatch):
    """The swap into place fails (a full disk, a permission): the earlier export is still there, unchanged,
    and the new copy written beside it is cleaned up."""
    import trainer.fileio as fileio

    out = export_draft(draft, tmp_path / "export", target=_dims(target))
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    real_replace = fileio.os.replace

    def replace(source, destination):
        if Path(source).name.startswith(".export.new-"):
            raise OSError(28, "No space left on device")
        real_replace(source, destination)

    monkeypatch.setattr(fileio.os, "replace", replace)
    with pytest.raises(OSError, match=f"^no space left on device while writing the export {out} .*the earlier export"):
        export_draft(randomize(draft, seed=1), out, target=_dims(target), overwrite=True)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export"]

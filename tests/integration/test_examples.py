"""`dflash2 prepare` and `dflash2 train` (trainer/commands/prepare.py, train.py) in-process on a tiny recipe."""

from __future__ import annotations

import json

import pytest

from tests.support.distributed.tiny_setup import write_tiny_run
from trainer.commands import prepare, train
from trainer.evaluation.report import run_summary
from trainer.models.draft import build_draft
from trainer.models.target import FrozenTarget


@pytest.mark.parametrize("objective", [{}, {"kd_weight": 0.5}], ids=["ce", "distillation"])
def test_prepare_then_train_reuses_the_offline_features(tmp_path, monkeypatch, capsys, objective):
    """A distilling recipe's store also holds the final hidden states, so training still reads all
    it needs from disk."""
    recipe = write_tiny_run(tmp_path, offline=True, save_strategy="no", **objective)
    prepare.main([str(recipe)])
    assert "prepared 20 training and 4 evaluation samples" in capsys.readouterr().out
    monkeypatch.setattr(FrozenTarget, "capture", lambda *a, **k: pytest.fail("features were recomputed"))
    metrics = train.main([str(recipe)])
    out = capsys.readouterr().out
    assert "Draft checkpoint:" in out and "tau_walk" in out
    summary = run_summary(tmp_path / "output")  # what the command printed, from the run's trainer_state.json
    assert summary["untrained"]["eval_tau_unary"] == 1.0  # step-0 evaluation of the untrained draft
    assert metrics["eval_loss"] == summary["trained"]["eval_loss"]
    assert f"{'loss':<24}{summary['untrained']['eval_loss']:>12.4f}{metrics['eval_loss']:>12.4f}" in out
    assert not (tmp_path / "output" / "demo_summary.json").exists()  # a demo file, not every run's
    assert (tmp_path / "output" / "model.safetensors").exists()


def test_a_v1_draft_config_trains_a_dflash_v1_draft(tmp_path):
    """The recipe comparison's DFlash v1 baseline: a config without conv and selector builds the v1
    class (a DFlash2 class would give it identity convs and a no-op selector it never had)."""
    from benchmarks.compare import DRAFT_CONFIG, v1_config
    from modeling_dflash2 import DFlash2DraftModel, DFlashDraftModel
    from trainer.training.arguments import ModelArguments

    (tmp_path / "v1.json").write_text(json.dumps(v1_config(json.loads(DRAFT_CONFIG.read_text()))))
    draft = build_draft(ModelArguments(target="unused", draft_config=str(tmp_path / "v1.json")))
    assert type(draft) is DFlashDraftModel
    assert type(build_draft(ModelArguments(target="unused", draft_config=str(DRAFT_CONFIG)))) is DFlash2DraftModel


@pytest.mark.parametrize(
    ("keys", "regenerate_only", "loads"),
    [
        ({"regenerate": True}, True, "weights"),  # answers in process
        ({"regenerate": True, "regenerate_endpoint": "http://e/v1"}, True, "tokenizer"),
        ({"regenerate": True, "regenerate_endpoint": "http://e/v1", "offline": True}, False, "weights"),  # captures
        (
            {
                "regenerate": True,
                "regenerate_endpoint": "http://e/v1",
                "offline": True,
                "feature_endpoint": "http://f/v1",
            },
            False,
            "tokenizer",
        ),
        ({"regenerate": False, "offline": True, "feature_endpoint": "http://f/v1"}, False, "tokenizer"),
        ({"regenerate": True, "offline": True, "feature_endpoint": "http://f/v1"}, False, "weights"),  # answers here
    ],
)
def test_prepare_loads_the_targets_weights_only_where_it_runs_the_target(monkeypatch, keys, regenerate_only, loads):
    from types import SimpleNamespace

    from trainer.models.target import TargetTokenizer

    monkeypatch.setattr(FrozenTarget, "load", classmethod(lambda cls, *a, **k: "weights"))
    monkeypatch.setattr(TargetTokenizer, "load", classmethod(lambda cls, *a, **k: "tokenizer"))
    data = SimpleNamespace(**{"regenerate_endpoint": None, "offline": False, "feature_endpoint": None, **keys})
    model = SimpleNamespace(target="t", target_gguf_file=None, target_dtype="float32")
    assert prepare.load_target(model, data, regenerate_only) == loads

"""examples/prepare.py and examples/train.py in-process on a tiny recipe."""

from __future__ import annotations

import json

import pytest

from examples import prepare, train
from tests.distributed.tiny_setup import write_tiny_run
from trainer.target import FrozenTarget


def test_prepare_then_train_reuses_the_offline_features(tmp_path, monkeypatch, capsys):
    recipe = write_tiny_run(tmp_path, offline=True, save_strategy="no")
    prepare.main([str(recipe)])
    assert "prepared 20 training and 4 evaluation samples" in capsys.readouterr().out
    monkeypatch.setattr(FrozenTarget, "capture", lambda *a, **k: pytest.fail("features were recomputed"))
    metrics = train.main([str(recipe)])
    out = capsys.readouterr().out
    assert "Draft checkpoint:" in out and "tau_walk" in out
    summary = json.loads((tmp_path / "output" / "demo_summary.json").read_text())
    assert summary["untrained"]["eval_tau_unary"] == 1.0  # step-0 evaluation of the untrained draft
    assert metrics["eval_loss"] == summary["trained"]["eval_loss"]
    assert (tmp_path / "output" / "model.safetensors").exists()

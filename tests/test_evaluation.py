"""Speculative evaluation: summaries by hand, the report, the eval_spec_tau callback, the CLI."""

from __future__ import annotations

import json

import pytest

from modeling_dflash2 import DFlash2DraftModel
from tests.conftest import randomize
from tests.test_trainer import make_trainer
from tests.tiny_target import tiny_chat_dataset, tiny_draft_config_for, tiny_target
from trainer.evaluation import evaluate_paths, prompt_ids, summarize
from trainer.speculative import SpeculativeResult


def test_summary_by_hand():
    results = [
        SpeculativeResult(tokens=[1] * 8, acceptance_lengths=[3, 1, 4], prefill_seconds=0.5, decode_seconds=1.5),
        SpeculativeResult(tokens=[1, 2], acceptance_lengths=[], prefill_seconds=0.0, decode_seconds=0.0),
    ]
    summary = summarize(results, block_size=4)
    assert summary["mean_tau"] == pytest.approx(8 / 3)
    assert summary["tau_histogram"] == [1, 0, 1, 1]
    assert summary["per_position_acceptance"] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert summary["tokens_per_second"] == pytest.approx(10 / 2.0)


def test_prompt_is_everything_before_the_first_supervised_token():
    assert prompt_ids({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}) == [5, 6]


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(seed=1)
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=2, scale=0.2)
    return target, draft


def test_report_covers_both_paths_and_is_lossless(tiny):
    target, draft = tiny
    report = evaluate_paths(target.model, {"trained": draft}, [[1, 9, 14], [1, 30, 31, 32]], 12)
    assert set(report["paths"]) == {"trained/selector", "trained/unary"}
    assert report["lossless"] is True
    for summary in report["paths"].values():
        assert summary["matches_target"] and summary["mean_tau"] >= 1.0 and summary["speedup"] > 0
        assert len(summary["tau_histogram"]) == 4 and len(summary["per_position_acceptance"]) == 3


def test_callback_logs_eval_spec_tau(tmp_path):
    target = tiny_target()
    dataset = tiny_chat_dataset(target, 12, seed=5)
    trainer = make_trainer(
        target,
        dataset,
        tmp_path,
        eval_dataset=dataset.select(range(4)),
        eval_strategy="steps",
        eval_steps=2,
        max_steps=2,
        spec_eval_prompts=2,
        spec_eval_max_new_tokens=6,
    )
    trainer.train()
    taus = [log["eval_spec_tau"] for log in trainer.state.log_history if "eval_spec_tau" in log]
    assert len(taus) == 1 and 1.0 <= taus[0] <= 4.0


def test_cli_writes_report_and_plot(tmp_path, tiny, capsys):
    from examples import evaluate

    target, draft = tiny
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    (tmp_path / "prompts.txt").write_text("hi how are you\ntell me about the weather\n")
    report = evaluate.main(
        [
            "--target",
            str(tmp_path / "target"),
            "--draft",
            str(tmp_path / "draft"),
            "--prompts",
            str(tmp_path / "prompts.txt"),
            "--max-new-tokens",
            "8",
            "--compare-untrained",
        ]
    )
    assert set(report["paths"]) == {"untrained/unary", "trained/selector", "trained/unary"}
    saved = json.loads((tmp_path / "draft" / "speculative" / "speculative_report.json").read_text())
    assert saved["lossless"] is True and saved["prompts"] == 2
    assert (tmp_path / "draft" / "speculative" / "speculative_report.png").read_bytes()[:4] == b"\x89PNG"
    assert "target alone" in capsys.readouterr().out

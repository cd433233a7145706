"""Chat templating: rendering a conversation with the target's template, its end-of-turn tokens, and
the loss mask that supervises exactly the assistant turns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase


def template_kwargs(tokenizer: PreTrainedTokenizerBase, enable_thinking: bool | None) -> dict[str, Any]:
    """`enable_thinking` is passed only to templates that have the switch; asking for it on a
    template without one is an error rather than a silent no-op."""
    if enable_thinking is None:
        return {}
    if "enable_thinking" not in (tokenizer.chat_template or ""):
        raise ValueError("enable_thinking is set but this tokenizer's chat template has no thinking switch.")
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


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, str]],
    enable_thinking: bool | None = None,
) -> dict[str, list[int]]:
    """Token ids of a conversation and a loss mask that is 1 exactly on assistant tokens.

    Templates with `{% generation %}` markers report the assistant tokens themselves; otherwise
    each assistant turn is located by incremental templating: the tokens added between
    `template(messages[:i], add_generation_prompt=True)` and `template(messages[:i+1])`, up to and
    including the end-of-turn token.
    """
    extra = template_kwargs(tokenizer, enable_thinking)
    if "{% generation %}" in (tokenizer.chat_template or "") or "{%- generation %}" in (tokenizer.chat_template or ""):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **extra
        )
        return {"input_ids": list(rendered["input_ids"]), "loss_mask": list(rendered["assistant_masks"])}
    input_ids = render(tokenizer, messages, False, extra)
    loss_mask = [0] * len(input_ids)
    end_of_turn = end_of_turn_ids(tokenizer)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:index], True, extra)
        through = render(tokenizer, messages[: index + 1], False, extra)
        if through[: len(prefix)] != prefix or input_ids[: len(through)] != through:
            raise ValueError(
                f"Cannot locate assistant turn {index} by incremental templating: the chat template renders "
                "earlier turns differently once later ones exist. Use a template with {% generation %} markers."
            )
        end = len(through)
        for position in range(len(prefix), len(through)):
            if through[position] in end_of_turn:
                end = position + 1
                break
        loss_mask[len(prefix) : end] = [1] * (end - len(prefix))
    return {"input_ids": input_ids, "loss_mask": loss_mask}

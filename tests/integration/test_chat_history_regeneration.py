"""Issue 34: regeneration with a thinking target behind a template that rewrites history
(tests/fixtures/qwen3_like_chat_template.jinja): in process, through a loopback OpenAI server that
returns the thinking inline, and through one that splits it off as a reasoning parser does, the
samples are token for token the same, each answer supervised with its thinking after exactly the
prompt the engine rendered for it (earlier thinking dropped); thinking mixed by `thinking_share`;
and a conversation the old templating refused trains a few steps."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.openai_loopback import LoopbackOpenAI
from tests.support.qwen3_like import qwen3_like_target
from trainer.data.endpoint import EndpointSettings
from trainer.data.regeneration import GenerationSettings, conversation_thinking, regenerate

QUESTIONS = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "old answer"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "old answer"},
    {"role": "user", "content": "q3"},
]
SETTINGS = GenerationSettings(max_new_tokens=64, batch_size=1)


def scripted(target) -> list[str]:
    """Make the target answer turn n (its n-th user message) with '<think>\\nr{n}\\n</think>\\n\\na{n}'
    and the end of the turn, or 'a{n}' alone after a prompt that ends with an empty think block
    (thinking off). Returns the list the prompts it is asked are appended to, as text."""
    tokenizer, asked = target.tokenizer, []
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")

    def generate(input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **_):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = [token for token, keep in zip(ids, mask, strict=True) if keep]
            text = tokenizer.decode(prompt)
            asked.append(text)
            turn = text.count("<|im_start|>user")
            answer = f"a{turn}" if text.endswith("</think>\n\n") else f"<think>\nr{turn}\n</think>\n\na{turn}"
            rows.append(ids + tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id])
        width = max(len(row) for row in rows)
        return torch.tensor([row + [pad_token_id] * (width - len(row)) for row in rows])

    assert start is not None
    target.model.generate = generate
    return asked


class ReasoningParser(LoopbackOpenAI):
    """A server with a reasoning parser: the thinking comes back apart, as `reasoning_content`."""

    def complete(self, request: dict) -> dict:
        body = super().complete(request)
        message = body["choices"][0]["message"]
        if "</think>" in message["content"]:
            reasoning, content = message["content"].split("</think>")
            message["reasoning_content"] = reasoning.split("<think>")[-1].strip("\n")
            message["content"] = content.lstrip("\n")
        return body


def fast(server) -> EndpointSettings:
    return EndpointSettings(url=server.url, concurrency=2, backoff=0.01, max_backoff=0.05, max_retries=2)


def supervised_texts(tokenizer, dataset) -> list[tuple[str, str]]:
    """(prompt text, supervised text) of every sample with one supervised span."""
    result = []
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True):
        start = mask.index(1)
        end = start + sum(mask)
        assert mask[start:end] == [1] * (end - start)
        result.append((tokenizer.decode(ids[:start]), tokenizer.decode(ids[start:end])))
    return result


@pytest.fixture(scope="module")
def target():
    return qwen3_like_target()


def turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def test_thinking_is_kept_where_the_template_keeps_it_in_process_and_through_both_endpoints(target, tmp_path):
    asked = scripted(target)
    in_process = regenerate(target, [QUESTIONS], SETTINGS, tmp_path / "in-process")
    history = turn("user", "q1")
    assert supervised_texts(target.tokenizer, in_process) == [
        (history + "<|im_start|>assistant\n", "<think>\nr1\n</think>\n\na1<|im_end|>"),
        (
            history + turn("assistant", "a1") + turn("user", "q2") + "<|im_start|>assistant\n",
            "<think>\nr2\n</think>\n\na2<|im_end|>",
        ),
        (
            history
            + turn("assistant", "a1")
            + turn("user", "q2")
            + turn("assistant", "a2")
            + turn("user", "q3")
            + "<|im_start|>assistant\n",
            "<think>\nr3\n</think>\n\na3<|im_end|>",
        ),
    ]
    # each sample's prompt is exactly what the target was asked at that turn
    assert [prompt for prompt, _ in supervised_texts(target.tokenizer, in_process)] == asked
    rows = list(zip(in_process["input_ids"], in_process["loss_mask"], strict=True))
    for server_class, name in ((LoopbackOpenAI, "inline"), (ReasoningParser, "parser")):
        with server_class(target) as server:
            through = regenerate(target, [QUESTIONS], SETTINGS, tmp_path / name, endpoint=fast(server))
        assert list(zip(through["input_ids"], through["loss_mask"], strict=True)) == rows, name
        # the server saw the earlier answers with their thinking, and dropped it as the template does
        second = [json.loads(messages) for messages in server.asked if "q2" in messages and "q3" not in messages]
        assert second[0][1]["content"] == ("a1" if name == "parser" else "<think>\nr1\n</think>\n\na1")
        assert second[0][1].get("reasoning_content") == ("r1" if name == "parser" else None)


def test_thinking_share_mixes_on_and_off_and_records_which(target, tmp_path):
    scripted(target)
    candidates = [[{"role": "user", "content": f"q{i}"}] for i in range(20)]
    on = next(c for c in candidates if conversation_thinking(c, None, 0.5))
    off = next(c for c in candidates if not conversation_thinking(c, None, 0.5))
    settings = GenerationSettings(max_new_tokens=64, batch_size=2, thinking_share=0.5)
    in_process = regenerate(target, [on, off], settings, tmp_path / "in-process")
    assert in_process["enable_thinking"] == [True, False]
    texts = supervised_texts(target.tokenizer, in_process)
    assert texts[0][1] == "<think>\nr1\n</think>\n\na1<|im_end|>" and texts[0][0].endswith("assistant\n")
    assert texts[1] == (
        turn("user", off[0]["content"]) + "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "a1<|im_end|>",
    )
    with ReasoningParser(target) as server:
        through = regenerate(target, [on, off], settings, tmp_path / "endpoint", endpoint=fast(server))
    assert through["input_ids"] == in_process["input_ids"] and through["loss_mask"] == in_process["loss_mask"]
    assert through["enable_thinking"] == [True, False]


def test_conversations_the_old_templating_refused_train(tmp_path, capsys):
    """Multi-turn thinking conversations and a tool conversation (with its `tools` column), thinking
    mixed half and half: `dflash2 train` tokenizes them into one sample per rewrite group and trains."""
    import yaml

    from tests.support.tiny_target import tiny_draft_config_for
    from tests.unit.data.test_chat_history import THREE_TURNS, TOOL_CONVERSATION, WEATHER
    from trainer.commands import train

    target = qwen3_like_target()
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    tiny_draft_config_for(target).to_json_file(tmp_path / "draft.json")
    rows = [
        {"messages": [*THREE_TURNS[:1], {"role": "user", "content": f"q{i}"}, *THREE_TURNS[2:]], "tools": None}
        for i in range(6)
    ]
    rows.insert(0, {"messages": TOOL_CONVERSATION, "tools": json.dumps([WEATHER])})
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    recipe = {
        "target": str(tmp_path / "target"),
        "draft_config": str(tmp_path / "draft.json"),
        "dataset": str(tmp_path / "chat.jsonl"),
        "regenerate": False,
        "thinking_share": 0.5,
        "num_eval_samples": 3,
        "max_length": 400,
        "cache_dir": str(tmp_path / "cache"),
        "output_dir": str(tmp_path / "output"),
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "num_anchors": 6,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    metrics = train.main([str(tmp_path / "recipe.yaml")])
    assert metrics["eval_loss"] == metrics["eval_loss"] and metrics["eval_loss"] > 0  # finite, trained and evaluated
    # the held-out conversations mix thinking on and off: each mode's acceptance is reported apart
    assert metrics["eval_thinking_tau_walk"] >= 1 and metrics["eval_no_thinking_tau_walk"] >= 1
